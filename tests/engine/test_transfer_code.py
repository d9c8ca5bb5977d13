"""Transfer coding of streamed bf16 weights (`engine.sharding.transfer_code`): exact, smaller, booked.

The coded form must give back every bit (signs, zeros, subnormals, infinities, NaNs, another dtype's
bytes), move about 75% of a normal matrix's bytes, and change nothing but the bytes over PCIe: a plan that
streams coded sub-layers scores and generates exactly what the same plan does with raw copies, and the
staging ring is booked as the planner's VRAM math says.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

import engine
from engine.sharding import transfer_code as tc
from engine.sharding.memory import slot_bytes, transfer_bytes
from engine.sharding.plan import Placement, Plan, PlanSet
from tests.engine.tiny_plans import all_cpu_planset, force_planset, plain_on_gpu

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")


@pytest.fixture(autouse=True)
def four_bit_code(monkeypatch):
    """The 4-bit code unless a test asks for the tight form (`tight`), whatever the environment says."""
    monkeypatch.delenv("SLIPSTREAM_TRANSFER_CODE_TIGHT", raising=False)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _special() -> torch.Tensor:
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e38, -1e-38, 3e-41, -3e-41, 1.0, -2.0]
    return torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("scale", [1e-3, 0.02, 1.0, 300.0])
def test_normal_weights_come_back_exactly_at_three_quarters(scale):
    g = torch.Generator().manual_seed(1)
    raw = _bytes((torch.randn(199_999, generator=g) * scale).to(torch.bfloat16))
    coded = tc.encode(raw, chunk_words=50_000)
    assert coded is not None and len(coded.chunks) == 4 and all(c.coded for c in coded.chunks)
    assert torch.equal(tc.decode(coded), raw)
    assert coded.nbytes / raw.numel() < 0.76


def test_special_values_and_outliers_are_escapes():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(40_000, generator=g) * 0.02).to(torch.bfloat16)
    w[::997] = _special().repeat(len(w[::997]) // len(_special()) + 1)[:len(w[::997])]
    raw = _bytes(w)
    coded = tc.encode(raw)
    assert coded.escapes > 0
    back = tc.decode(coded)
    assert torch.equal(back, raw)        # bit for bit: NaN payloads and signed zeros too


def test_bytes_that_do_not_code_well_stay_raw():
    g = torch.Generator().manual_seed(3)
    fp32 = _bytes(torch.randn(30_000, generator=g))                   # float32 words: random high bytes
    assert tc.encode(fp32) is None
    bf16 = _bytes((torch.randn(30_000, generator=g) * 0.05).to(torch.bfloat16))
    mixed = torch.cat([bf16, fp32, bf16])                              # chunks of either kind
    coded = tc.encode(mixed, chunk_words=30_000)
    assert [c.coded for c in coded.chunks] == [True, False, False, True]
    assert torch.equal(tc.decode(coded), mixed)
    odd = _bytes((torch.randn(1001, generator=g)).to(torch.bfloat16))    # an odd number of words
    assert torch.equal(tc.decode(tc.encode(odd)), odd)
    assert tc.encode(torch.zeros(5, dtype=torch.uint8)) is None        # not whole words


def test_the_native_encoder_writes_what_the_tensor_path_writes(monkeypatch):
    from engine import kernels

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(300_001, generator=g) * 0.03).to(torch.bfloat16)
    w[::1013] = _special().repeat(300)[:len(w[::1013])]
    raw = _bytes(w)
    native = tc.encode(raw, chunk_words=100_000)
    if kernels.status(wait=True).startswith("torch"):
        pytest.skip("no native CPU kernels here")
    monkeypatch.setattr(kernels, "bf16_code", lambda *a: None)
    tensor = tc.encode(raw, chunk_words=100_000)
    assert native.chunks == tensor.chunks and native.escapes == tensor.escapes > 0
    for c in native.chunks:               # (padding between the pieces is left as allocated)
        assert torch.equal(native.host[c.off:c.off + c.nbytes], tensor.host[c.off:c.off + c.nbytes])
    e = slice(native.esc_off, native.esc_off + 6 * native.escapes)
    assert torch.equal(native.host[e], tensor.host[e])
    assert torch.equal(tc.decode(native), raw)


# ---- in the engine ---------------------------------------------------------------------------------

@pytest.fixture()
def coded_env(monkeypatch):
    from engine.backends.torch_engine import TorchEngine

    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu_planset)
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE_MIN", "0")      # the tiny model's sub-layers are small


def _streaming_planset(eng, n_slots: int) -> PlanSet:
    """Every attention and FFN streamed through `n_slots` slots, the head resident."""
    place = {s.name: (Placement.STREAMED if s.kind in ("attn", "ffn") else
                      Placement.RESIDENT if s.kind == "head" else Placement.CPU) for s in eng.spec.sublayers}
    return PlanSet(eng.budget, [Plan(t, "manual", dict(place), n_slots) for t in eng.tiers])


def _open(path, code: bool, monkeypatch):
    # (no n-gram speculation: whether a step verifies proposals is decided from measured step times, and on
    # CUDA a multi-token verify step rounds its bf16 apart from a one-token step; session 26, calls BO-BU:
    # the raw side's first run, fewer graph replays, its last token moved)
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE", "1" if code else "0")
    return engine.open_model(path, device=DEVICE, backend="torch", vram_budget="1GiB", speculative=False)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("n_slots", [1, 3])
def test_a_coded_stream_gives_the_same_logits_and_tokens(tiny_model, coded_env, monkeypatch, arch, n_slots):
    path = tiny_model(arch, dtype="bfloat16")
    ids = list(range(3, 40))
    out = {}
    for code in (False, True):
        eng = _open(path, code, monkeypatch)
        assert bool(eng.executor.store.coded) is code
        force_planset(eng, _streaming_planset(eng, n_slots))
        before = eng.executor.copied_bytes
        logits = eng.score(ids)
        copied = eng.executor.copied_bytes - before
        text = "".join(e.text for e in eng.generate("hello there", max_new_tokens=12) if e.text)
        out[code] = (logits, text, copied, eng.stats(), len(eng.spec.sublayers))
        eng.close()
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1] == out[False][1]
    assert out[True][2] < 0.9 * out[False][2]          # fewer bytes crossed for the same work
    assert 0 < out[True][3]["transfer_coded_sublayers"] <= out[True][4] - 1   # (never the embedding)
    assert out[True][3]["transfer_coded_ratio"] < 0.85   # (the tiny models' weights have heavier tails)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_coded_copies_issued_from_their_own_thread_or_the_steps_give_the_same_logits(tiny_model, coded_env,
                                                                                      monkeypatch, arch):
    path = tiny_model(arch, dtype="bfloat16")
    ids = list(range(3, 30))
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SLIPSTREAM_COPY_ISSUER", flag)
        eng = _open(path, True, monkeypatch)
        force_planset(eng, _streaming_planset(eng, 2))
        out[flag] = eng.score(ids)
        assert (eng.accel._issuer is not None) is (flag == "1")      # (the issuer thread is made on first use)
        eng.accel.set_issue_thread(flag == "0")                         # switched mid-run: still the same
        assert torch.equal(eng.score(ids), out[flag])
        eng.close()
        assert eng.accel._issuer is None and eng.accel.total_used == 0
    assert torch.equal(out["0"], out["1"])


def test_weights_admitted_while_the_ring_is_there_cross_coded_and_are_not_kept_by_it(tiny_model, coded_env,
                                                                                     monkeypatch):
    """A plan that keeps streaming (so the staging ring stays) and makes more sub-layers resident admits
    them through the ring: the resident buffers hold the host's bytes, the logits are those of raw
    admissions, the ring keeps no copy program of a resident buffer (its views would hold the memory of an
    evicted one), and evicting them gives their booking back."""
    path = tiny_model("llama3", dtype="bfloat16")
    ids = list(range(3, 30))
    out = {}
    for code in (False, True):
        eng = _open(path, code, monkeypatch)
        store = eng.executor.store
        force_planset(eng, _streaming_planset(eng, 2))
        names = [s.name for s in eng.spec.sublayers if s.kind in ("attn", "ffn")]
        calls, real = [], eng.accel.copy_coded

        def spy(dst, coded, stages, after=None, keep=True, real=real, calls=calls):
            calls.append(keep)
            return real(dst, coded, stages, after, keep)
        monkeypatch.setattr(eng.accel, "copy_coded", spy)
        place = dict(_streaming_planset(eng, 2).plans[0].placement)
        place.update({n: Placement.RESIDENT for n in names[:2]})        # (layer 0; layer 1 still streams)
        force_planset(eng, PlanSet(eng.budget, [Plan(t, "manual", dict(place), 2) for t in eng.tiers]))
        for n in names[:2]:
            assert torch.equal(store.resident[n][0].cpu(), store.sublayers[n].host.cpu())
        assert (calls.count(False) == 2) is code             # one coded copy per admission, not kept
        slot_ptrs = {b.data_ptr() for b in store.slots}
        assert all(ptr in slot_ptrs for ptr, _ in (store.stages._programs if code else {}))
        out[code] = eng.score(ids)
        weights = eng.accel.used["weights"]
        force_planset(eng, _streaming_planset(eng, 2))
        assert eng.accel.used["weights"] == weights - sum(store.sublayers[n].nbytes for n in names[:2])
        eng.close()
    assert torch.equal(out[True], out[False])


def _cpu_tokens(path, prompt: str, n: int) -> list[int]:
    cpu = engine.open_model(path, device="cpu", backend="torch")
    try:
        return [e.token_id for e in cpu.generate(prompt, max_new_tokens=n)]
    finally:
        cpu.close()


def _graph_state(eng) -> tuple:
    """How a token's step ran so far: n-gram proposals verified (a verify step is a multi-token step, whose
    bf16 kernels round apart from a one-token step's on CUDA) and CUDA graph captures and replays."""
    g = eng.executor.graphs
    st = g.stats() if g is not None else {}
    return (eng.spec_stats["proposed"], st.get("cuda_graph_captures"), st.get("cuda_graph_replays"))


def _follow(path, code: bool, monkeypatch, schedule: dict[int, PlanSet], prompt: str, n: int,
            trace: list | None = None) -> list[int]:
    """Greedy tokens of `path` on DEVICE with coding on or off, the plan sets of `schedule` forced before
    the first step (key -1) and after the step of each other key (`trace`: each token's `_graph_state`)."""
    eng = _open(path, code, monkeypatch)
    force_planset(eng, schedule[-1])
    got = []
    for i, ev in enumerate(eng.generate(prompt, max_new_tokens=n)):
        got.append(ev.token_id)
        if trace is not None:
            trace.append(_graph_state(eng))
        if i in schedule:
            force_planset(eng, schedule[i])
    eng.close()
    return got


def _first_difference(a: list, b: list) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return "none" if at is None else f"token {at}: {a[at]} / {b[at]}"


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_placements_changing_mid_generation_keep_the_tokens_coded(tiny_model, coded_env, monkeypatch, arch):
    """Random placements (resident, streamed, CPU) switched every few tokens, slots 1-3, coded copies: the
    tokens of raw copies under the same placements (a coded copy lands the same bytes in the slot) and, on
    "sim", whose GPU is the CPU, the tokens of the model on the CPU alone (on CUDA a placement's bf16 kernels
    round their own way)."""
    import random

    from engine.backends.torch_engine import TorchEngine
    from tests.engine.test_executor import random_planset

    # (no plans re-priced on a thread of their own: that re-plan lands wherever its thread finishes, and
    # on CUDA a re-plan's fresh graphs may round a step's attention otherwise)
    monkeypatch.setattr(TorchEngine, "_refine_in_background", lambda self: None)
    path = tiny_model(arch, dtype="bfloat16")
    prompt = "the quick brown fox"
    eng = _open(path, True, monkeypatch)
    rng = random.Random(11)
    schedule = {-1: random_planset(eng, rng, 2)}
    force_planset(eng, schedule[-1])
    got, traces = [], {"coded": [], "raw": [], "coded again": [], "raw again": []}
    for i, ev in enumerate(eng.generate(prompt, max_new_tokens=24)):
        got.append(ev.token_id)
        traces["coded"].append(_graph_state(eng))
        if i % 5 == 2:
            schedule[i] = random_planset(eng, rng, 1 + i % 3)
            force_planset(eng, schedule[i])
            assert eng.accel.total_used <= eng.budget
    assert eng.executor.copied_bytes > 0 and eng.stats()["transfer_coded_sublayers"] > 0
    eng.close()
    assert eng.accel.total_used == 0
    raw = _follow(path, False, monkeypatch, schedule, prompt, 24, traces["raw"])
    if got != raw:
        # (say which side moves, and where the runs' steps first went apart)
        again = {code: _follow(path, code, monkeypatch, schedule, prompt, 24, traces[f"{name} again"])
                 for code, name in ((True, "coded"), (False, "raw"))}
        pytest.fail(f"coded {got} != raw {raw}; replayed: coded {'same' if again[True] == got else again[True]}, "
                    f"raw {'same' if again[False] == raw else again[False]}; steps (proposals verified, graph "
                    f"captures, replays) first differ: coded/raw {_first_difference(traces['coded'], traces['raw'])}"
                    f", raw/raw again {_first_difference(traces['raw'], traces['raw again'])}; last: "
                    + "; ".join(f"{k} {v[-1] if v else None}" for k, v in traces.items()))
    if DEVICE == "sim":
        assert got == _cpu_tokens(path, prompt, 24)


def test_planned_budget_changes_mid_generation_with_coded_streams(tiny_model, monkeypatch):
    """The planner's own plans (a slow CPU, so weights go to the GPU and stream) at budgets that move while
    a greedy generation runs: coded copies give the tokens of raw copies under the same plans, switched at
    the same points (on "sim", those of the CPU alone too; on CUDA a sub-layer moving between the CPU and
    the GPU rounds its bf16 its own way), and the bookings (slots and the staging ring included) stay within
    every budget."""
    import threading

    from engine.backends.torch_engine import TorchEngine
    from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights

    # (no plans re-priced on a thread of their own: that re-plan lands wherever its thread finishes)
    monkeypatch.setattr(TorchEngine, "_refine_in_background", lambda self: None)
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE_MIN", "0")
    path = tiny_model("llama3", dtype="bfloat16")
    prompt = "a b c d e"
    made: list[PlanSet] = []

    def run(code: bool) -> tuple[list[int], int]:
        monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE", "1" if code else "0")
        eng = engine.open_model(path, device=DEVICE, backend="torch",
                                **plain_on_gpu(DEVICE), tiers=TIERS, profile=slow_cpu_profile())
        assert bool(eng.executor.store.coded) is code
        if code:                     # the plan sets the planner makes, in order...
            planned = eng._make_planset
            eng._make_planset = lambda *a, **k: made.append(planned(*a, **k)) or made[-1]
        else:                        # ...and the same, in the same order, for raw copies
            queue = list(made)
            eng._make_planset = lambda *a, **k: queue.pop(0)
        full = eng.spec.total_weight_bytes
        base = third_of_weights(eng) - full // 3
        budgets = [base + full // 3, base + full // 8, base + full * 2, base + full // 2]
        eng.set_vram_budget(budgets[0])
        got, streamed = [], 0
        for i, ev in enumerate(eng.generate(prompt, max_new_tokens=30)):
            got.append(ev.token_id)
            streamed += eng.plan_report()["in_use"]["slots"] > 0
            assert eng.accel.total_used <= max(r["budget"] for r in eng.replans[-2:])
            if i % 6 == 3:
                t = threading.Thread(target=eng.set_vram_budget, args=(budgets[(i // 6) % len(budgets)],))
                t.start()
                t.join()
        if not code:
            assert not queue
        eng.close()
        return got, streamed

    got, streamed = run(True)
    assert streamed > 0                                   # some steps ran with slots (and the ring)
    assert len(made) >= 5
    assert got == run(False)[0]
    if DEVICE == "sim":
        assert got == _cpu_tokens(path, prompt, 30)


def test_the_staging_ring_is_booked_as_planned(tiny_model, coded_env, monkeypatch):
    eng = _open(tiny_model("llama3", dtype="bfloat16"), True, monkeypatch)
    store = eng.executor.store
    assert eng.spec.stage_bytes == store.stage_bytes > 0
    assert eng.spec.escape_index_bytes == store.escape_index_bytes \
        == 8 * min(tc.ESCAPE_SLICE, max(c.escapes for c in store.coded.values()))
    rep = eng.plan_report()["transfer_coding"]
    assert rep["on"] and rep["sublayers"] == len(store.coded) and 0 < rep["coded_bytes"] < rep["raw_bytes"]
    sizes = transfer_bytes(eng.spec)
    for name, c in store.coded.items():
        assert sizes[name] == c.nbytes < store.nbytes(name)
    ps = _streaming_planset(eng, 2)
    force_planset(eng, ps)
    eng.score([1, 2, 3])
    place = ps.plans[0].placement
    assert eng.accel.used["slots"] == slot_bytes(eng.spec, place, 2)
    assert eng.accel.used["slots"] == 2 * max(store.nbytes(n) for n, p in place.items() if p is Placement.STREAMED) \
        + tc.N_STAGES * store.stage_bytes + store.escape_index_bytes
    force_planset(eng, PlanSet(eng.budget, all_cpu_planset(eng, eng.budget).plans))
    assert eng.accel.used["slots"] == 0                # no stream, no ring
    eng.close()


def test_escapes_put_slice_by_slice_give_the_bytes_back(monkeypatch):
    g = torch.Generator().manual_seed(5)
    raw = (torch.randn(200_000, generator=g) * 0.02)
    raw[::100] = raw[::100] * 1e12          # one word in a hundred escapes
    raw = _bytes(raw.to(torch.bfloat16))
    coded = tc.encode(raw, chunk_words=8192)
    assert coded.escapes >= 2000
    calls = []
    real_put = torch.Tensor.index_put_

    def counted(self, indices, values, *args, **kwargs):
        calls.append(indices[0].numel())
        return real_put(self, indices, values, *args, **kwargs)

    monkeypatch.setattr(tc, "ESCAPE_SLICE", 300)
    monkeypatch.setattr(torch.Tensor, "index_put_", counted)
    assert torch.equal(tc.decode(coded), raw)
    assert max(calls) == 300 and sum(calls) == coded.escapes     # (the index's copy: a slice's at most)


@pytest.mark.parametrize("keeps_streaming", [False, True])
def test_a_coded_copy_that_runs_out_of_memory_is_copied_again_after_the_back_off(tiny_model, coded_env,
                                                                                   monkeypatch, keeps_streaming):
    """A coded copy fails in the issuer thread (its decode allocates): the step backs off and copies again,
    with the same tokens, whether the re-plan drops the slots or keeps streaming through the same ones. The
    failed copy is raised once, not at every later wait (session 29, call CG)."""
    path = tiny_model("llama3", dtype="bfloat16")
    eng = _open(path, True, monkeypatch)
    force_planset(eng, _streaming_planset(eng, 2))
    want = [e.token_id for e in eng.generate("a b c", max_new_tokens=12)]
    force_planset(eng, _streaming_planset(eng, 2))
    slots = 2 if keeps_streaming else 1      # the re-plan's: the same slots, or new ones (the old drained)
    eng._make_planset = lambda budget, kv_tokens=None: PlanSet(budget, _streaming_planset(eng, slots).plans)
    real_decode = tc.decode_chunk
    state = {"armed": False, "fired": 0}

    def flaky_decode(*args):
        if state["armed"] and not state["fired"]:
            state["fired"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, in the copy's decode)")
        return real_decode(*args)

    monkeypatch.setattr(tc, "decode_chunk", flaky_decode)
    budget = eng.budget
    got = []
    for i, ev in enumerate(eng.generate("a b c", max_new_tokens=12)):
        got.append(ev.token_id)
        if i == 4:
            state["armed"] = True
    assert state["fired"] == 1
    assert got == want
    assert 0 < eng.budget < budget            # one back-off, not down to nothing on the GPU
    assert any("out of memory" in r["reason"] for r in eng.replans)
    assert len(eng.executor.store.slots) == slots
    assert eng.accel.total_used <= eng.budget
    eng.close()


def test_coded_copies_are_priced_by_their_bytes(tiny_model, coded_env, monkeypatch):
    from engine.sharding.estimator import copy_costs
    from engine.sharding.profile import ProfileDatabase, sim_profile_dict

    prof = ProfileDatabase(sim_profile_dict())
    raw = _open(tiny_model("llama3", dtype="bfloat16"), False, monkeypatch)
    coded = _open(tiny_model("llama3", dtype="bfloat16"), True, monkeypatch)
    a, _ = copy_costs(raw.spec, prof)
    b, _ = copy_costs(coded.spec, prof)
    names = [s.name for s in coded.spec.sublayers]
    for i, n in enumerate(names):
        if n in coded.executor.store.coded:
            assert b[i] == pytest.approx(a[i] * coded.executor.store.coded[n].nbytes / raw.executor.store.nbytes(n))
        else:
            assert b[i] == a[i]
    raw.close()
    coded.close()


def test_off_for_other_dtypes_and_the_cpu(tiny_model, coded_env, monkeypatch):
    eng = _open(tiny_model("llama3"), True, monkeypatch)       # float32 weights: nothing to code
    assert not eng.executor.store.coded and eng.spec.transfer == ()
    eng.close()
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE", "1")
    cpu = engine.open_model(tiny_model("llama3", dtype="bfloat16"), device="cpu", backend="torch")
    assert not cpu.executor.store.coded
    cpu.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the fused decode against the tensor path")
def test_the_fused_cuda_decode_matches_the_tensor_path():
    if not tc.triton_available():
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(3_000_003, generator=g) * 0.02).to(torch.bfloat16)
    w[::4999] = float("inf")
    raw = _bytes(w)
    coded = tc.encode(raw, chunk_words=1 << 20)
    dev = torch.empty(raw.numel(), dtype=torch.uint8, device="cuda")
    tc.decode(coded, dev)
    assert torch.equal(dev.cpu(), raw)


@pytest.fixture()
def tight(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE_TIGHT", "1")


@pytest.mark.parametrize("scale", [1e-3, 0.02, 1.0, 300.0])
def test_tight_chunks_come_back_exactly_at_under_72_percent(tight, scale):
    g = torch.Generator().manual_seed(11)
    raw = _bytes((torch.randn(399_999, generator=g) * scale).to(torch.bfloat16))
    coded = tc.encode(raw, chunk_words=100_000)
    assert [c.tight for c in coded.chunks] == [True] * 4
    assert torch.equal(tc.decode(coded), raw)
    assert coded.nbytes / raw.numel() < 0.72


def test_tight_chunks_keep_special_values_outliers_and_odd_lengths(tight):
    """Signed zeros, infinities, NaN payloads, subnormals and words far from both windows (escapes), a
    second window's words, a chunk of odd length and one whose blocks hold no second-stream word."""
    g = torch.Generator().manual_seed(12)
    w = (torch.randn(7 * tc.TIGHT_BLOCK + 333, generator=g) * 0.02).to(torch.bfloat16)
    w[::101] = _special().repeat(len(w[::101]) // len(_special()) + 1)[:len(w[::101])]
    w[::53] = w[::53] * 3e-3                                    # (a second window below the first)
    w[2 * tc.TIGHT_BLOCK:4 * tc.TIGHT_BLOCK] = 0.015            # (blocks with no second-stream word)
    raw = _bytes(w)
    coded = tc.encode(raw, chunk_words=3 * tc.TIGHT_BLOCK + 77)
    assert all(c.tight for c in coded.chunks) and coded.escapes > 0
    assert any(c.n2 for c in coded.chunks)
    assert torch.equal(tc.decode(coded), raw)


def test_the_native_tight_encoder_writes_what_the_tensor_path_writes(tight, monkeypatch):
    from engine import kernels

    g = torch.Generator().manual_seed(16)
    w = (torch.randn(5 * tc.TIGHT_BLOCK + 1001, generator=g) * 0.03).to(torch.bfloat16)
    w[::1013] = _special().repeat(300)[:len(w[::1013])]
    w[::29] = w[::29] * 2e-3
    raw = _bytes(w)
    if kernels.status(wait=True).startswith("torch"):
        pytest.skip("no native CPU kernels here")
    native = tc.encode(raw, chunk_words=2 * tc.TIGHT_BLOCK + 300)
    monkeypatch.setattr(kernels, "bf16_tight_code", lambda *a, **k: None)
    tensor = tc.encode(raw, chunk_words=2 * tc.TIGHT_BLOCK + 300)
    assert native.chunks == tensor.chunks and native.escapes == tensor.escapes > 0
    assert all(c.tight for c in native.chunks) and all(c.n2 for c in native.chunks)
    for c in native.chunks:
        assert torch.equal(native.host[c.off:c.off + c.nbytes], tensor.host[c.off:c.off + c.nbytes])
    e = slice(native.esc_off, native.esc_off + 6 * native.escapes)
    assert torch.equal(native.host[e], tensor.host[e])
    assert torch.equal(tc.decode(native), raw)


def test_tight_block_starts_let_each_block_decode_alone(tight):
    """What the fused CUDA decode relies on: a block's second-stream words start at its stored start, so a
    block's prefix sum alone finds each word's code (checked here block by block against the whole)."""
    g = torch.Generator().manual_seed(13)
    w = (torch.randn(5 * tc.TIGHT_BLOCK + 17, generator=g) * 0.02).to(torch.bfloat16)
    raw = _bytes(w)
    coded = tc.encode(raw, chunk_words=10 * tc.TIGHT_BLOCK)
    (c,) = coded.chunks
    b0, lo, _sgn, c2, nib2, end = tc._tight_layout(c.words, c.n2)
    buf = coded.host[c.off:c.off + c.nbytes]
    starts = buf[b0:lo].view(torch.int32)
    code = tc._unpack(buf[c2:nib2], 2, c.words)
    vals = tc._unpack(buf[nib2:end], 4, c.n2)
    top = torch.bitwise_and(raw.view(-1, 2)[:, 1], 0x7F)
    for b in range(len(starts)):
        blk = code[b * tc.TIGHT_BLOCK:(b + 1) * tc.TIGHT_BLOCK]
        second = (blk == 3).to(torch.int32)
        pos = int(starts[b]) + torch.cumsum(second, 0) - second
        got = torch.where(blk == 3, c.base2 + vals[pos.clamp(max=max(c.n2 - 1, 0)).long()], c.base + blk)
        want = top[b * tc.TIGHT_BLOCK:(b + 1) * tc.TIGHT_BLOCK]
        esc = (blk == 3) & (vals[pos.clamp(max=max(c.n2 - 1, 0)).long()] == tc.ESCAPE2)
        assert torch.equal(got[~esc].to(torch.uint8) & 0x7F, want[~esc])


def test_a_chunk_takes_the_tight_form_only_where_it_is_smaller(tight):
    g = torch.Generator().manual_seed(14)
    bf16 = _bytes((torch.randn(30_000, generator=g) * 0.05).to(torch.bfloat16))
    fp32 = _bytes(torch.randn(30_000, generator=g))                # float32 words: stays raw
    coded = tc.encode(torch.cat([bf16, fp32]), chunk_words=30_000)
    assert [(c.coded, c.tight) for c in coded.chunks] == [(True, True), (False, False), (False, False)]
    with pytest.raises(ValueError, match="tight"):
        tc.CpuMatrix(coded, 0, 100, 300)                            # (the CPU reads only the 4-bit form)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the fused tight decode")
def test_the_fused_tight_decode_gives_the_bytes_back(tight):
    """The fused CUDA decode of tight chunks passes its own check at warm-up and decodes a large buffer (many
    blocks, escapes, a second window) to the same bytes as the tensor path."""
    if not tc.triton_available():
        pytest.skip("no Triton")
    tc.warm_up(torch.device("cuda"))
    assert tc._tight_triton is not None
    g = torch.Generator().manual_seed(15)
    w = (torch.randn(3_000_003, generator=g) * 0.02).to(torch.bfloat16)
    w[::4999] = float("inf")
    w[::37] = w[::37] * 1e-3
    raw = _bytes(w)
    coded = tc.encode(raw, chunk_words=1 << 20)
    assert all(c.tight for c in coded.chunks)
    dev = torch.empty(raw.numel(), dtype=torch.uint8, device="cuda")
    tc.decode(coded, dev)
    assert torch.equal(dev.cpu(), raw)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_a_tight_coded_stream_gives_the_raw_streams_logits_and_tokens(tiny_model, coded_env, monkeypatch, arch):
    path = tiny_model(arch, dtype="bfloat16")
    ids = list(range(3, 40))
    out = {}
    for code, tight_on in ((False, "0"), (True, "0"), (True, "1")):
        monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE_TIGHT", tight_on)
        eng = _open(path, code, monkeypatch)
        tights = [c.tight for b in eng.executor.store.coded.values() for c in b.chunks]
        force_planset(eng, _streaming_planset(eng, 2))
        before = eng.executor.copied_bytes
        logits = eng.score(ids)
        tokens = [e.token_id for e in eng.generate("hello there", max_new_tokens=12)]
        out[(code, tight_on)] = (logits, tokens, eng.executor.copied_bytes - before, tights,
                                 eng.stats()["transfer_coded_tight_chunks"])
        eng.close()
    raw, coded, tight_coded = out[(False, "0")], out[(True, "0")], out[(True, "1")]
    assert tight_coded[3] and any(tight_coded[3]) and not any(coded[3])
    assert torch.equal(tight_coded[0], raw[0]) and tight_coded[1] == raw[1]
    assert tight_coded[2] < coded[2] < raw[2]                        # fewer bytes crossed again
    assert tight_coded[4] == sum(tight_coded[3]) > 0 and coded[4] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: streams and events")
@pytest.mark.parametrize("ahead", [False, True])
def test_a_coded_copy_writes_its_destination_only_after_the_compute_it_waits_for(ahead):
    """`after` gates the writes into the destination, whether or not the pieces cross into the ring ahead of
    it: compute that still writes the destination when the copy is asked for (a long sleep, then a fill)
    is overwritten by the copy, never the other way round. Raw pieces (straight into the destination)
    and coded ones both."""
    if not tc.triton_available():
        pytest.skip("no Triton")
    from engine.sharding.device import Accelerator
    from engine.sharding.weights import Stages

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3_000_000, generator=g) * 0.02).to(torch.bfloat16)
    raw = _bytes(w)
    raw[: 2 << 20] = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8, generator=g)   # a chunk kept raw
    coded = tc.encode(raw, pin=True, chunk_words=1 << 20)
    assert any(not c.coded for c in coded.chunks) and any(c.coded for c in coded.chunks)
    accel = Accelerator("cuda")
    accel.set_ring_ahead(ahead)
    stages = Stages([torch.empty(coded.stage_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)])
    dst = torch.zeros(raw.numel(), dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(200_000_000)            # (about 0.1 s of GPU clock: the copy is asked for meanwhile)
    dst.fill_(7)
    after = torch.cuda.Event()
    after.record()
    handle = accel.copy_coded(dst, coded, stages, after=after, keep=False)
    handle.wait_host()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), raw)


def test_a_cuda_decode_that_does_not_build_leaves_coding_off(monkeypatch, caplog):
    """Triton present but its launcher not building (no C compiler) must not fail an open: raw streaming."""
    def broken(device):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(tc, "triton_available", lambda: True)
    monkeypatch.setattr(tc, "warm_up", broken)
    with caplog.at_level("WARNING", logger="engine.sharding.transfer_code"):
        assert tc.cuda_decode_works(torch.device("cpu")) is False
    assert "transfer coding off" in caplog.text and "C compiler" in caplog.text


def test_the_rate_bench_runs_its_steps_on_sim(tmp_path):
    """`transfer_code_rate --device sim`: the GPU bench's steps on the CPU (its JSON and its exactness check)."""
    import json

    from engine.bench import transfer_code_rate

    assert transfer_code_rate.main(["--device", "sim", "--mib", "4", "--reps", "2", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "transfer_code_rate.json").read_text())
    assert got["exact"] and got["device"] == "sim" and 0.74 < got["ratio"] < 0.76 and got["escapes"] > 0
    assert set(got["rows"]) == {"plain copy", "coded copy", "GPU decode alone"}
    assert all(r["median_ms"] > 0 for r in got["rows"].values()) and "issue_us" in got["rows"]["coded copy"]


def test_chunks_end_only_at_row_ends_and_cover_the_buffer():
    segs = [(0, 100, 100), (100, 64 * 50 + 6, 64), (3306, 30 * 40, 40), (4506, 2, 2)]   # (a 1-D tensor first)
    bounds = tc.chunk_bounds(4508, 1000, segs)
    assert bounds[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(bounds))
    assert sum(n for _, n in bounds) == 4508 and all(n <= 1000 for _, n in bounds)
    for a, n in bounds:                      # every chunk end falls on a row end of the tensor it ends in
        end = a + n
        s0, words, row = next(s for s in segs if s[0] < end <= s[0] + s[1])
        assert (end - s0) % row == 0 or end == s0 + words
    assert tc.chunk_bounds(10, 4, [(0, 10, 7)]) == [(0, 7), (7, 3)]     # a row longer than a chunk


@pytest.mark.parametrize("k,chunk_rows", [(128, 7), (100, 3), (4096, 40)])
def test_the_cpu_matmul_reads_a_coded_matrix_to_the_same_bits(k, chunk_rows):
    """`kernels.linear_coded` over a matrix in coded form (sharing its first chunk with a tensor before it,
    escapes inside, a K that is no multiple of 64) gives `kernels.linear`'s bits over the raw matrix."""
    from engine import kernels

    if not kernels.coded_ready():
        pytest.skip("the native kernel does not read coded matrices on this CPU (no AVX512-BF16)")
    g = torch.Generator().manual_seed(k)
    n = 61
    before = (torch.randn(3 * k, generator=g) * 0.1).to(torch.bfloat16)           # a tensor before it
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    w.view(-1)[::331] = _special().repeat(200)[:len(w.view(-1)[::331])].nan_to_num(0.0, 1e3, -1e3)
    raw = _bytes(torch.cat([before, w.view(-1)]))
    layout = tc.plan(raw, chunk_words=chunk_rows * k, segments=[(0, 3 * k, 3 * k), (3 * k, n * k, k)])
    coded = tc.encode_into(raw, layout, torch.empty(tc.coded_size(*layout[1:]), dtype=torch.uint8))
    assert coded.escapes > 0 and len(coded.chunks) > 1
    mat = tc.CpuMatrix(coded, 3 * k, n, k)
    kernels.status(wait=True)
    while kernels._building.is_set():      # (an engine opened before may still be building the library)
        time.sleep(0.01)
    for m in (1, 2, 5):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        want = kernels.linear(x, w, min_weights=0, rows=m)   # (AMX hosts leave more than 4 rows to PyTorch)
        got = kernels.linear_coded(x, mat, n, k)
        why = (f"enabled {kernels._enabled}, building {kernels._building.is_set()}, pool busy {kernels._busy.locked()}, "
               f"max rows {kernels.max_rows(torch.bfloat16)}, {kernels.status()}")
        assert want is not None and got is not None, why
        assert torch.equal(got, want)


def test_a_matrix_with_a_raw_chunk_is_not_read_coded():
    g = torch.Generator().manual_seed(9)
    w = torch.cat([(torch.randn(4000, generator=g) * 0.02).to(torch.bfloat16),
                   torch.randn(2000, generator=g).view(torch.bfloat16)])        # float32 bytes: a raw chunk
    raw = _bytes(w)
    layout = tc.plan(raw, chunk_words=2000, segments=[(0, 8000, 100)])
    coded = tc.encode_into(raw, layout, torch.empty(tc.coded_size(*layout[1:]), dtype=torch.uint8))
    assert any(not c.coded for c in coded.chunks)
    with pytest.raises(ValueError):
        tc.CpuMatrix(coded, 0, 80, 100)
    assert tc.CpuMatrix(coded, 0, 20, 100).shape == (20, 100)                   # its coded rows alone


def test_the_coded_matmul_bench_checks_its_bits(tmp_path):
    import json

    from engine import kernels
    from engine.bench import coded_matmul

    if not kernels.coded_ready():
        pytest.skip("no AVX512-BF16 here")
    assert coded_matmul.main(["--shapes", "down", "--rows", "1", "--reps", "2", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "coded_matmul.json").read_text())
    assert got["exact"] and got["rows"][0]["shape"] == "down [4096, 14336]" and got["rows"][0]["coded_ms"] > 0


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_cpu_calls_read_coded_give_the_same_tokens(tiny_model, monkeypatch, arch):
    """`SLIPSTREAM_CPU_CODED=1`: the native CPU calls (the FFN call, the attention call, the head's matmul) read
    coded weights; the logits and greedy tokens of a plan with everything on the CPU are those of the same
    plan reading raw weights."""
    from engine import kernels

    if not kernels.coded_ready():
        pytest.skip("no AVX512-BF16 here")
    from engine.backends.torch_engine import TorchEngine

    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu_planset)
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE", "1")
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE_MIN", "0")
    monkeypatch.setattr(tc, "CHUNK_WORDS", 1 << 12)          # several chunks to an FFN of the tiny model
    path = tiny_model(arch, dtype="bfloat16", intermediate_size=512, hidden_size=256, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32)             # (matrices the native calls take)
    out = {}
    for coded in ("0", "1"):
        monkeypatch.setenv("SLIPSTREAM_CPU_CODED", coded)
        eng = engine.open_model(path, device="sim", backend="torch", vram_budget="1GiB")
        assert bool(eng.executor.store._read_coded) is (coded == "1")
        before = dict(kernels.coded_calls)
        logits = eng.score(list(range(3, 11)))[-4:]
        tokens = [e.token_id for e in eng.generate("a b c", max_new_tokens=8)]
        out[coded] = (logits, tokens, {k: n - before[k] for k, n in kernels.coded_calls.items()})
        eng.close()
    assert not kernels._coded                               # forgotten when the store closed
    assert torch.equal(out["1"][0], out["0"][0]) and out["1"][1] == out["0"][1]
    assert not any(out["0"][2].values())
    assert all(n > 0 for n in out["1"][2].values()), out["1"][2]     # each kind of call read coded weights


def test_coding_is_on_by_default_only_where_the_host_has_room(tiny_model, monkeypatch):
    """Unforced, the engine codes where host memory holds the coded copy beside a reserve once open (a
    quarter of the memory), and the packed buffers and the coded copy beside the loaded weights while it
    opens (2 GiB to spare). Here as for a 16 GiB model."""
    import types

    import psutil

    from engine.backends.torch_engine import TorchEngine
    from engine.sharding.spec import ModelSpec

    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu_planset)
    monkeypatch.delenv("SLIPSTREAM_TRANSFER_CODE", raising=False)
    eng = engine.open_model(tiny_model("llama3", dtype="bfloat16"), device="sim", backend="torch",
                            vram_budget="1GiB")
    GiB = 1 << 30
    monkeypatch.setattr(ModelSpec, "total_weight_bytes", property(lambda self: 16 * GiB))
    for total, available, want in ((128, 60, True),      # room once open (47.8 >= 32) and while opening
                                   (64, 30, False),      # room once open (17.8 >= 16), not while opening
                                   (64, 27, False)):     # under the reserve once open
        monkeypatch.setattr(psutil, "virtual_memory", lambda t=total, a=available: types.SimpleNamespace(
            total=t * GiB, available=a * GiB))
        assert eng._host_room_for_coding() is want, (total, available)
    eng.close()
