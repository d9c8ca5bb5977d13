"""The engine contract as users meet it: generation options, streaming, cancellation, stats, plan
reports, and one-line errors for bad input that leave the engine usable."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import engine
from engine.errors import BadInputError, BudgetError, ContextLengthError, ModelLoadError


@pytest.fixture(scope="module")
def eng(tiny_model):
    e = engine.open_model(tiny_model("llama3"), device="sim", backend="torch", vram_budget="1MiB")
    yield e
    e.close()


def texts(events):
    return "".join(ev.text for ev in events)


def test_stream_events_and_stats(eng):
    events = list(eng.generate("hello world", max_new_tokens=12))
    assert events[-1].finish_reason in ("length", "eos")
    assert all(ev.finish_reason is None for ev in events[:-1])
    assert all(isinstance(ev.token_id, int) for ev in events[:-1])
    s = eng.stats()
    assert s["ttft_s"] > 0 and s["prefill_tokens_per_s"] > 0
    assert s["generated_tokens"] == len(events) - 1


def test_chat_messages_use_the_template(eng):
    msgs = [{"role": "user", "content": "hi"}]
    ids = eng.encode_prompt(msgs)
    assert ids == eng.tokenizer.encode(eng.tokenizer.apply_chat_template(msgs)) or ids[1:] == \
        eng.tokenizer.encode(eng.tokenizer.apply_chat_template(msgs))
    assert list(eng.generate(msgs, max_new_tokens=3))[-1].finish_reason is not None


def test_sampling_is_reproducible_with_a_seed(eng):
    a = [e.token_id for e in eng.generate("abc", max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=3)]
    b = [e.token_id for e in eng.generate("abc", max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=3)]
    assert a == b


def test_stop_string_ends_generation_before_it(eng):
    full = texts(eng.generate("hello world", max_new_tokens=30))
    cut = full.strip()[3:6]
    assert cut
    events = list(eng.generate("hello world", max_new_tokens=30, stop=[cut]))
    assert events[-1].finish_reason == "stop"
    assert cut not in texts(events)
    assert full.startswith(texts(events))


def test_cancel_from_another_thread(eng):
    events = []
    gen = eng.generate("hello", max_new_tokens=200)
    for ev in gen:
        events.append(ev)
        if len(events) == 3:
            threading.Thread(target=eng.cancel).start()
    assert events[-1].finish_reason == "cancelled"
    assert len(events) < 20


def test_score_shape_and_dtype(eng):
    out = eng.score([1, 5, 9, 11])
    assert out.shape == (4, eng.config.vocab_size) and out.dtype == torch.float32


def test_plan_report_schema(eng):
    rep = eng.plan_report()
    assert rep["budget"] == eng.budget
    for tier in rep["tiers"]:
        assert set(tier) >= {"tokens", "plan", "predicted_ms", "vram", "placement"}
        assert tier["vram"]["total"] <= rep["budget"]
        assert set(tier["vram"]) >= {"weights", "kv", "slots", "scratch", "total"}
        assert set(tier["placement"].values()) <= {"resident", "streamed", "cpu"}


def test_bad_input_is_one_line_and_engine_stays_usable(eng):
    with pytest.raises(ContextLengthError) as exc:
        eng.generate("word " * 5000)
    assert "context" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(BudgetError):
        eng.set_vram_budget("lots")
    with pytest.raises(BadInputError):
        eng.force_plan("fastest")
    with pytest.raises(BadInputError):
        eng.score([eng.config.vocab_size + 5])
    with pytest.raises(BadInputError):
        eng.generate("x", temperature=-1)
    assert list(eng.generate("still fine", max_new_tokens=2))[-1].finish_reason is not None


def test_open_errors_name_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        engine.open_model(tmp_path / "nope.gguf")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        engine.open_model(bad, backend="torch")
    with pytest.raises(BadInputError):
        engine.open_model(bad, backend="onnx")


def test_cli_prints_one_line_errors(tmp_path, tiny_model):
    run = [sys.executable, "-m", "engine", "generate", "--backend", "torch", "--device", "cpu"]
    missing = subprocess.run(run + ["--prompt", "hi", "--model", str(tmp_path / "x.gguf")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "no such file" in missing.stderr
    long = subprocess.run(run + ["--prompt", "word " * 5000, "--model", str(tiny_model("llama"))],
                          capture_output=True, text=True, check=False)
    assert long.returncode == 2 and "Traceback" not in long.stderr and "context" in long.stderr
    ok = subprocess.run(run + ["--prompt", "hello", "--max-new-tokens", "4", "--model", str(tiny_model("llama"))],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr


def test_a_closed_engine_says_so(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="cpu", backend="torch")
    eng.close()
    for call in (lambda: eng.generate("hi"), lambda: eng.score([1, 2]), lambda: eng.set_vram_budget("1GiB"),
                 eng.plan_report, lambda: eng.force_plan("static")):
        with pytest.raises(BadInputError, match="closed"):
            call()
    assert "ttft_s" in eng.stats()
