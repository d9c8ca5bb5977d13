"""Continuous batching: many requests share batched steps and each gets exactly what it gets alone.

The reference for every request is the same prompt generated alone by a CPU engine (`generate`, n-gram
speculation off). Batched engines run on the CPU and on the simulated accelerator under every plan kind
(planned with `tests.engine.tiny_plans`, so the plans really put sub-layers on the GPU side), with
requests joining mid-run, a long prompt read in chunks beside decoding requests, preemption under a tiny
KV limit, budget changes mid-batch, cancellation of one request, and concurrent HTTP clients.
"""

from __future__ import annotations

import json
import threading

import pytest

import engine
from engine.generation import SamplingParams
from engine.sharding.memory import kv_cache_bytes
from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights

ARCHS = ["llama", "qwen3_moe"]
SETTINGS = [("cpu", None), ("sim", "gpu_only"), ("sim", "static"), ("sim", "dynamic")]
LONG = ("Models are made of layers, and each layer has an attention block and a feed-forward block. "
        "Weights can be resident, streamed or computed on the CPU. When the game ends, the memory comes back")
PROMPTS = ["the quick brown fox", "Hello, world! How are you today?", LONG, "def main():",
           "Numbers like 12, 345 and 6789", "She sells sea shells by the sea shore."]
STEP_TOKENS = 16

_refs: dict = {}


def alone(path, prompt, **params) -> list[tuple]:
    """(token id, text, finish reason) of every event of `prompt` generated alone on the CPU."""
    key = (str(path), json.dumps(prompt), json.dumps(params, sort_keys=True))
    if key not in _refs:
        if str(path) not in _refs:
            _refs[str(path)] = engine.open_model(path, device="cpu", backend="torch", speculative=False)
        _refs[key] = events(_refs[str(path)].generate(prompt, **params))
    return _refs[key]


def events(evs) -> list[tuple]:
    return [(e.token_id, e.text, e.finish_reason) for e in evs]


def open_batched(path, device, kind, **options):
    if device == "cpu":
        return engine.open_model(path, device="cpu", backend="torch", max_step_tokens=STEP_TOKENS, **options)
    eng = engine.open_model(path, device="sim", backend="torch", tiers=TIERS, profile=slow_cpu_profile(),
                            max_step_tokens=STEP_TOKENS, **options)
    # A third of the weights, with room for the KV cache of a whole batch (every context full).
    eng.set_vram_budget(third_of_weights(eng) + kv_cache_bytes(eng.spec, eng.max_kv_tokens))
    if kind:
        eng.force_plan(kind)
    return eng


def record_steps(eng) -> list[list[int]]:
    """Spy on the engine's batched steps: the new-token count of each sequence in each step."""
    steps: list[list[int]] = []
    run = eng._step_batch

    def spy(items):
        steps.append([len(it.ids) for it in items])
        out = run(items)
        eng.kinds_run.add(eng.executor.plan.kind)
        return out

    eng.kinds_run = set()

    eng._step_batch = spy
    return steps


def drain(eng) -> None:
    while eng.step_batch():
        pass


def assert_nothing_held(eng) -> None:
    kv = eng.executor.kv
    assert not kv.refs and len(kv.free_blocks) + len(kv.evictable) == kv.n_blocks
    assert eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device,kind", SETTINGS, ids=[f"{d}-{k}" if k else d for d, k in SETTINGS])
def test_batch_matches_alone_with_joins_and_chunked_prefill(tiny_model, arch, device, kind, monkeypatch):
    if device == "sim" and kind == "gpu_only":
        # the decode tokens take the GPU's one-token kernel as on CUDA (here on the CPU): a batch's decode
        # tokens over their padded caches in one call
        from engine.sharding.executor import Executor

        monkeypatch.setattr(Executor, "_one_token_kernel", lambda self, layer, segs, q: all(s.n == 1 for s in segs))
    path = tiny_model(arch)
    eng = open_batched(path, device, kind)
    steps = record_steps(eng)
    first, later = PROMPTS[:2], PROMPTS[2:]
    handles = [eng.submit(p, max_new_tokens=24, background=False) for p in first]
    for _ in range(5):
        assert eng.step_batch()
    # Requests join a running batch; the long prompt is read in chunks while the others decode.
    handles += [eng.submit(p, max_new_tokens=24 - 2 * i, background=False) for i, p in enumerate(later)]
    drain(eng)
    for i, (p, h) in enumerate(zip(PROMPTS, handles)):
        n = 24 if i < 2 else 24 - 2 * (i - 2)
        assert events(h) == alone(path, p, max_new_tokens=n), p
    long_ids = len(eng.encode_prompt(LONG))
    assert long_ids > 3 * STEP_TOKENS
    assert all(sum(s) <= STEP_TOKENS for s in steps)
    assert any(1 in s and max(s) > 1 for s in steps)                  # a prefill chunk beside decodes
    assert eng.stats()["max_batch_size"] == len(PROMPTS)
    assert_nothing_held(eng)
    if device == "sim":
        report = eng.plan_report()
        assert any(p != "cpu" for t in report["tiers"] for p in t["placement"].values())
        assert eng.kinds_run == {kind}
        assert eng.accel.peak <= max(r["budget"] for r in eng.replans)
    eng.close()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device,kind", [("cpu", None), ("sim", "dynamic")])
def test_preemption_under_a_tiny_kv_limit(tiny_model, arch, device, kind):
    path = tiny_model(arch)
    eng = open_batched(path, device, kind, max_kv_tokens=256)       # 16 blocks: one context
    limit = eng.scheduler.limit_blocks
    held = []
    steps = record_steps(eng)
    run = eng._step_batch

    def watch(items):
        out = run(items)
        held.append(len(eng.executor.kv.refs))
        return out

    eng._step_batch = watch
    prompts = [f"{w} " * 30 + "and then" for w in ("alpha", "bravo", "charlie", "delta")]
    handles = [eng.submit(p, max_new_tokens=80, background=False) for p in prompts]
    drain(eng)
    for p, c in zip(prompts, [h.result() for h in handles]):
        want = alone(path, p, max_new_tokens=80)
        assert c.token_ids[:len(want) - 1] == [t for t, _, _ in want[:-1]] and c.finish_reason == want[-1][2]
        assert c.text == "".join(x for _, x, _ in want)
    stats = eng.stats()
    assert stats["preemptions"] > 0 and max(held) <= limit and len(steps) > 0
    # Preempted KV goes to the host-RAM tier where the cache has one (then comes back by copy).
    assert stats["preemptions_to_host"] == (stats["preemptions"] if hasattr(eng.executor.kv, "offload") else 0)
    assert_nothing_held(eng)
    eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_budget_changes_mid_batch(tiny_model, arch):
    path = tiny_model(arch)
    eng = open_batched(path, "sim", None)
    full = eng.spec.total_weight_bytes
    base = third_of_weights(eng) - full // 3
    budgets = [base + full // 3, 0, base + full // 8, base + full * 2, base + full // 2, base + full // 5]
    placements = set()
    replans = len(eng.replans)
    handles = [eng.submit(p, max_new_tokens=40) for p in PROMPTS[:4]]
    got0 = []
    for i, ev in enumerate(handles[0]):
        got0.append((ev.token_id, ev.text, ev.finish_reason))
        placements.add(tuple(sorted(str(p) for p in eng.executor.plan.placement.values())))
        if i % 4 == 1:
            # From another thread, as the app's budget slider does, while the batch steps in its own.
            t = threading.Thread(target=eng.set_vram_budget, args=(budgets[(i // 4) % len(budgets)],))
            t.start()
            t.join()
    assert got0 == alone(path, PROMPTS[0], max_new_tokens=40)
    for p, h in zip(PROMPTS[1:4], handles[1:]):
        assert events(h) == alone(path, p, max_new_tokens=40)
    assert len(eng.replans) - replans >= 4 and len(placements) >= 2
    assert eng.accel.peak <= max(r["budget"] for r in eng.replans)
    eng.close()


def test_cancel_one_request_leaves_the_others(tiny_model):
    path = tiny_model("llama")
    eng = open_batched(path, "cpu", None)
    handles = [eng.submit(p, max_new_tokens=30, background=False) for p in PROMPTS[:4]]
    for _ in range(4):
        eng.step_batch()
    handles[1].cancel()
    handles[3].close()                    # a reader that goes away ends its request too
    drain(eng)
    cut = events(handles[1])
    assert cut[-1][2] == "cancelled" and len(cut) <= 6
    assert cut[:-1] == alone(path, PROMPTS[1], max_new_tokens=30)[:len(cut) - 1]
    for i in (0, 2):
        assert events(handles[i]) == alone(path, PROMPTS[i], max_new_tokens=30)
    assert_nothing_held(eng)
    eng.close()


def test_sampling_stop_strings_and_seeds_per_request(tiny_model):
    path = tiny_model("qwen3")
    eng = open_batched(path, "cpu", None)
    greedy = alone(path, PROMPTS[0], max_new_tokens=20)
    text = "".join(t for _, t, _ in greedy)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    asks = [(PROMPTS[0], {"max_new_tokens": 20, "stop": [stop]}),
            (PROMPTS[1], {"max_new_tokens": 20, "temperature": 0.9, "seed": 7}),
            (PROMPTS[1], {"max_new_tokens": 20, "temperature": 0.9, "seed": 8}),
            (PROMPTS[3], {"max_new_tokens": 20, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 1}),
            (PROMPTS[4], {"max_new_tokens": 20})]
    handles = [eng.submit(p, **kw) for p, kw in asks]
    for (p, kw), h in zip(asks, handles):
        want = alone(path, p, **kw)
        assert events(h) == want, kw
    assert events(handles[0])[-1:] == [] or handles[0].finish_reason == "stop"
    assert handles[1].text != handles[2].text          # the seeds really differ
    eng.close()


def test_prefix_cache_serves_batched_turns(tiny_model):
    path = tiny_model("qwen3")
    eng = open_batched(path, "cpu", None)
    convo = [{"role": "user", "content": "tell me about the blue river and the old mill by the hill"}]
    first = eng.generate_batch([convo, PROMPTS[1]], max_new_tokens=24)
    turn = convo + [{"role": "assistant", "content": first[0].text}, {"role": "user", "content": "and then?"}]
    hits = eng.stats()["prefix_hit_tokens"]
    second = eng.generate_batch([turn, PROMPTS[2]], max_new_tokens=16)
    assert eng.stats()["prefix_hit_tokens"] - hits >= 16
    assert second[0].text == "".join(t for _, t, _ in alone(path, turn, max_new_tokens=16))
    assert_nothing_held(eng)
    eng.close()


def test_bad_input_raises_at_submit(tiny_model):
    from engine.errors import BadInputError, ContextLengthError

    eng = open_batched(tiny_model("llama"), "cpu", None)
    with pytest.raises(ContextLengthError):
        eng.submit("word " * 400)
    with pytest.raises(BadInputError, match="temperature"):
        eng.submit("hi", temperature=-1)
    for option, value in (("max_kv_tokens", 16), ("max_kv_tokens", "lots"), ("max_batch", 0),
                          ("max_step_tokens", 0)):
        with pytest.raises(BadInputError, match=option):
            engine.open_model(tiny_model("llama"), device="cpu", backend="torch", **{option: value})
    assert eng.submit("hi", max_new_tokens=0).result().token_ids == []
    eng.close()


def test_close_ends_running_requests(tiny_model):
    eng = open_batched(tiny_model("llama"), "cpu", None)
    handles = [eng.submit(p, max_new_tokens=200, background=False) for p in PROMPTS[:3]]
    eng.step_batch()
    eng.close()
    for h in handles:
        assert h.result().finish_reason == "cancelled"


# ---- the OpenAI-compatible server ------------------------------------------------------------------

def test_concurrent_http_clients_share_batched_steps(tiny_model):
    import openai

    from engine.serve import ApiServer, EngineSlot
    from tests.serve.conftest import KEY, request

    path = tiny_model("llama")
    # Steps of up to 256 tokens: the first step reads every queued prompt, so all five share it.
    eng = engine.open_model(path, device="cpu", backend="torch", max_step_tokens=256)
    srv = ApiServer(EngineSlot(eng), KEY, port=0)
    srv.start()
    client = openai.OpenAI(api_key=KEY, base_url=srv.address, max_retries=0, timeout=120)
    results: dict = {}

    def plain(i):
        status, body, _ = request(srv.port, "POST", "/v1/completions",
                                  {"model": "m", "prompt": PROMPTS[i], "max_tokens": 20, "temperature": 0})
        results[i] = (status, body["choices"][0]["text"])

    def streamed(i):
        chunks = client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=20, temperature=0, stream=True)
        results[i] = (200, "".join(c.choices[0].text for c in chunks))

    def hang_up(i):
        chunks = client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=200, temperature=0, stream=True)
        next(iter(chunks))
        chunks.close()
        results[i] = (200, None)

    try:
        with eng._lock:                   # hold the steps until every client is queued in the batch
            threads = [threading.Thread(target=f, args=(i,))
                       for i, f in enumerate([plain, streamed, plain, streamed, hang_up])]
            for t in threads:
                t.start()
            while eng.stats()["waiting"] < len(threads):
                threading.Event().wait(0.01)
        for t in threads:
            t.join(60)
        for i in range(4):
            want = "".join(t for _, t, _ in alone(path, PROMPTS[i], max_new_tokens=20))
            assert results[i] == (200, want)
        assert results[4] == (200, None)
        assert eng.stats()["max_batch_size"] == len(threads)
        while srv.slot.active:
            threading.Event().wait(0.01)
        assert_nothing_held(eng)
    finally:
        srv.stop()
        eng.close()


def test_sampling_params_are_checked_once(tiny_model):
    eng = open_batched(tiny_model("llama"), "cpu", None)
    ids, params = eng.prepare_request("hello", 10, 0.5, 0.9, 5, "x", None, 3)
    assert ids == eng.encode_prompt("hello")
    assert params == SamplingParams(10, 0.5, 0.9, 5, ("x",), 3)
    eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_speculation_in_the_batch_keeps_greedy_output(tiny_model, arch):
    path = tiny_model(arch)
    eng = open_batched(path, "cpu", None, speculative=True)
    prompts = ["a b c d e a b c d e a b c", "one two three one two three one", PROMPTS[0], PROMPTS[2]]
    prompts += [[{"role": "user", "content": p}] for p in prompts[:2]]
    got = eng.generate_batch(prompts, max_new_tokens=30)
    for p, c in zip(prompts, got):
        want = alone(path, p, max_new_tokens=30)
        assert c.text == "".join(t for _, t, _ in want) and c.finish_reason == want[-1][2]
    stats = eng.stats()
    assert stats["spec_proposed"] > 0 and stats["spec_accepted"] > 0
    assert_nothing_held(eng)
    eng.close()


def test_images_in_the_batch(tiny_model):
    from tests.engine.vision_fixtures import picture

    path = tiny_model("qwen2_5_vl")
    asks = [([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
             [picture(123, 77)]),
            ([{"role": "user", "content": "Hello there, what is new?"}], None),
            ([{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                           {"type": "image"}]}], [picture(300, 500), picture(64, 64)])]
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False, n_ctx=256)
    want = [events(ref.generate(m, images=im, max_new_tokens=40)) for m, im in asks]
    for device in ("cpu", "sim"):
        # A KV limit of one context: the image requests are read in chunks, preempted and recomputed.
        eng = engine.open_model(path, device=device, backend="torch", n_ctx=256, max_kv_tokens=256,
                                max_step_tokens=STEP_TOKENS, speculative=False)
        handles = [eng.submit(m, images=im, max_new_tokens=40, background=False) for m, im in asks]
        drain(eng)
        for h, w in zip(handles, want):
            assert events(h) == w
        assert eng.stats()["max_batch_size"] == 3 and eng.stats()["preemptions"] >= 1
        assert_nothing_held(eng)
        eng.close()


def test_fp8_kv_cache_in_the_batch(tiny_model):
    path = tiny_model("qwen3")
    ref = engine.open_model(path, device="cpu", backend="torch", kv_dtype="fp8", speculative=False)
    want = [events(ref.generate(p, max_new_tokens=20)) for p in PROMPTS]
    eng = open_batched(path, "cpu", None, kv_dtype="fp8")
    handles = [eng.submit(p, max_new_tokens=20, background=False) for p in PROMPTS]
    drain(eng)
    assert [events(h) for h in handles] == want
    eng.close()


def test_a_failing_step_fails_its_requests_and_the_batch_goes_on(tiny_model):
    path = tiny_model("llama")
    eng = open_batched(path, "cpu", None)
    run = eng._step_batch
    calls = []

    def fail_third(items):
        calls.append(len(items))
        if len(calls) == 3:
            raise RuntimeError("the device went away")
        return run(items)

    eng._step_batch = fail_third
    first = [eng.submit(p, max_new_tokens=10, background=False) for p in PROMPTS[:2]]
    drain(eng)
    for h in first:
        with pytest.raises(RuntimeError, match="the device went away"):
            h.result()
    assert eng.generate_batch(PROMPTS[2:4], max_new_tokens=10)[0].text == \
        "".join(t for _, t, _ in alone(path, PROMPTS[2], max_new_tokens=10))
    assert_nothing_held(eng)
    eng.close()


@pytest.mark.parametrize("one_token_kernel,kv_dtype", [(False, None), (True, None), (True, "fp8")])
def test_batch_over_host_resident_kv_matches_alone(tiny_model, one_token_kernel, kv_dtype, monkeypatch):
    """Attention streamed to the (simulated) GPU while every layer's KV cache stays in host memory, as
    small budgets plan their prefill tiers: batched decodes and prefill chunks keep their solo tokens.
    `one_token_kernel`: the decode tokens take the GPU's one-token kernel as on CUDA (here on the CPU), a
    batch's decode tokens over their host caches together (one padded gather and copy, each token's own
    key and value put in at its position)."""
    from engine.sharding.executor import Executor
    from engine.sharding.plan import Placement, Plan, PlanSet

    if one_token_kernel:
        together = []
        monkeypatch.setattr(Executor, "_one_token_kernel",
                            lambda self, layer, segs, q: together.append(len(segs)) or all(s.n == 1 for s in segs))
    path = tiny_model("llama")
    eng = open_batched(path, "sim", None, **({"kv_dtype": kv_dtype} if kv_dtype else {}))
    ffn_sides = [Placement.CPU, Placement.STREAMED, Placement.RESIDENT]

    def host_kv(budget, kv_tokens=None):
        plans = []
        for j, t in enumerate(eng.tiers):
            placement = {s.name: Placement.CPU for s in eng.spec.sublayers}
            for s in eng.spec.sublayers:
                if s.kind == "attn" and (j + s.layer) % 2 == 0:
                    placement[s.name] = Placement.STREAMED
                elif s.kind == "ffn":
                    placement[s.name] = ffn_sides[(j + s.layer) % 3]
            plans.append(Plan(t, "manual", placement, 2, kv_layers=0))
        return PlanSet(budget, plans)

    eng._make_planset = host_kv
    eng.set_vram_budget(eng.budget)
    handles = [eng.submit(p, max_new_tokens=16, background=False) for p in PROMPTS[:2]]
    for _ in range(3):
        assert eng.step_batch()
    handles += [eng.submit(p, max_new_tokens=12, background=False) for p in PROMPTS[2:]]
    drain(eng)
    ref = engine.open_model(path, device="cpu", backend="torch", kv_dtype="fp8", speculative=False) if kv_dtype else None
    for i, (p, h) in enumerate(zip(PROMPTS, handles)):
        n = 16 if i < 2 else 12
        assert events(h) == (events(ref.generate(p, max_new_tokens=n)) if ref else alone(path, p, max_new_tokens=n)), p
    if ref:
        ref.close()
    assert not any(pool.on_gpu for pool in eng.executor.kv.pools)
    assert_nothing_held(eng)
    eng.close()
    if one_token_kernel:
        assert max(together) >= 2
