"""The llama.cpp baseline of the MoE shape (issue 7): the qwen3moe GGUF the harness writes, and the runs
it plans (--n-cpu-moe, -p 512) without llama.cpp's tools or a GPU."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.bench import llamacpp_plan as lp
from engine.bench import llamacpp_runs as lr
from engine.bench.gguf_shapes import gguf_shape, write_gguf
from engine.bench.partials import Deadline, Partial
from engine.bench.scenarios import SCENARIOS

MOE = gguf_shape("qwen3-30b-a3b", 24)
GiB = 1 << 30
IDS = [1, 5, 77, 300, 12, 99, 200, 3, 40, 41, 42, 7]


@pytest.mark.llamacpp
def test_tiny_qwen3moe_gguf_runs_in_llamacpp_like_the_engine(tiny_model, tmp_path):
    """The writer's qwen3moe file (F16, the vocabulary copied from a vocab GGUF and padded) loads in
    llama.cpp with finite logits equal to the torch engine's on the same weights in F32 (the engine is
    checked against transformers elsewhere): names, shapes, expert layout and metadata are read alike."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    import llama_cpp

    import engine
    from tests.tiny_models import make_tiny_gguf

    vocab = tmp_path / "vocab"
    vocab.mkdir()
    make_tiny_gguf(tiny_model("qwen3_moe"), vocab / "ggml-vocab-qwen2.gguf")     # 384 tokens with merges
    shape = gguf_shape("tiny-moe")
    f16 = write_gguf(shape, tmp_path / "moe-f16.gguf", vocab, "f16")
    f32 = write_gguf(shape, tmp_path / "moe-f32.gguf", vocab, "f32")
    assert f16["arch"] == "qwen3moe" and f16["vocab"]["padded_to"] == shape.vocab > f16["vocab"]["tokens_in_source"]

    eng = engine.open_model(f32["path"], device="cpu", backend="torch")
    want = eng.score(IDS).float()
    eng.close()
    lc = llama_cpp.Llama(f16["path"], n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    assert lc.n_vocab() == shape.vocab
    assert int(lc.metadata["qwen3moe.expert_count"]) == shape.experts
    assert int(lc.metadata["qwen3moe.expert_feed_forward_length"]) == shape.expert_ffn
    lc.eval(IDS)
    got = torch.tensor(np.array(lc.scores[:len(IDS)]))
    lc.close()
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 5e-3          # f16 activations and KV in llama.cpp
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def _args(**kw) -> argparse.Namespace:
    base = {"models": "qwen3-30b-a3b", "budgets": "4GiB,8GiB", "tuned": None, "llamacpp_prompts": None,
            "dry_run": False, "prior": None, "gguf_dtype": "f16"}
    return argparse.Namespace(**{**base, **kw})


def test_moe_scenario_runs_the_n_cpu_moe_variants_with_512_token_prompts():
    from engine.bench.gpu_parts import llamacpp_choices

    moe, dense = SCENARIOS["qwen3-30b-a3b"], SCENARIOS["llama3-8b"]
    tuned, prompts = llamacpp_choices(_args(), moe)
    assert prompts == (512,) and [v.name for v in tuned] == ["attn-gpu", "nommap+attn-gpu"]
    assert all(v.mode == "attn" for v in tuned)
    tuned, prompts = llamacpp_choices(_args(), dense)                  # the dense shape is unchanged
    assert prompts == lr.PROMPTS and [v.name for v in tuned] == [v.name for v in lp.TUNED if v.default_on]
    tuned, prompts = llamacpp_choices(_args(tuned="nommap+attn-gpu", llamacpp_prompts="512,4096"), moe)
    assert prompts == (512, 4096) and [v.name for v in tuned] == ["nommap+attn-gpu"]
    with pytest.raises(SystemExit, match="unknown variant"):
        llamacpp_choices(_args(tuned="ncmoe"), moe)


def test_plan_only_prints_n_cpu_moe_command_lines_and_short_searches(monkeypatch, tmp_path):
    from engine.bench.gpu_parts import plan_llamacpp

    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path))
    lines: list[str] = []
    assert plan_llamacpp(_args(), say=lines.append) == 0
    firsts = [s for s in lines if "first run" in s]
    assert len(firsts) == 3 * 2                                         # default + 2 tuned, 2 budgets
    for s in firsts:
        assert "llama-bench" in s and "-p 512 -n 32 -r 1" in s and "4096" not in s.split("llama-bench")[1]
    tuned = [s for s in firsts if "tuned/" in s]
    assert all("-ngl 99 --n-cpu-moe" in s for s in tuned)
    assert sum("-lm none" in s for s in tuned) == 2
    default = [s for s in firsts if "default/" in s]
    assert all("--n-cpu-moe" not in s and "-ngl " in s for s in default)
    for s in [s for s in lines if "GB off" in s]:                      # at most 3 runs a budget, 1 at 8 GiB
        four, eight = s.split(": ", 1)[1].split("; ")
        assert 1 <= len(four.split(" -> ")[0].split(",")) <= 3
        assert len(eight.split(" -> ")[0].split(",")) == 1


def test_n_cpu_moe_keeps_the_predicted_number_of_expert_layers_on_the_gpu():
    """-ngl 99 --n-cpu-moe N: 24 - N layers' experts on the GPU, the bytes offloaded_bytes counts (its x
    steps by one layer's experts once all attention and the output are on the GPU)."""
    attn = next(v for v in lp.TUNED if v.name == "attn-gpu")
    n = MOE.layers
    wb = MOE.weight_bytes()
    for on_gpu in (0, 1, 5, n):
        x = n + 1 + on_gpu
        args = lp.variant_args(MOE, attn, x)
        ngl = str(n + 1) if on_gpu == 0 else "99"                      # every layer and the output either way
        assert args[-4:] == ["-ngl", ngl, "--n-cpu-moe", str(n - on_gpu)] and "-lm" not in args
        all_attn = lp.offloaded_bytes(MOE, "attn", n + 1, 512)
        assert lp.offloaded_bytes(MOE, "attn", x, 512) - all_attn == on_gpu * wb["layer_ffn"]
    experts = MOE.experts * MOE.expert_ffn * MOE.hidden * 3 * 2
    assert wb["layer_ffn"] == pytest.approx(experts, rel=0.01) and experts > 1.2e9    # one step: 1.2 GB


def test_c_prior_borrows_from_the_variant_that_differs_only_in_loading():
    attn = next(v for v in lp.TUNED if v.name == "attn-gpu")
    nommap_attn = next(v for v in lp.TUNED if v.name == "nommap+attn-gpu")
    ub = next(v for v in lp.TUNED if v.name == "nommap+ub2048+attn-gpu")
    variants = [lp.DEFAULT, attn, nommap_attn, ub]
    learned = {f"m|{attn.key}": 2.4e9}
    assert lp.c_prior(nommap_attn, learned, "m", variants) == 2.4e9
    assert lp.c_prior(ub, learned, "m", variants) == ub.prior_c          # other batch sizes: other buffers
    assert lp.c_prior(lp.DEFAULT, learned, "m", variants) == lp.DEFAULT.prior_c
    assert lp.c_prior(nommap_attn, {**learned, f"m|{nommap_attn.key}": 2.0e9}, "m", variants) == 2.0e9
    assert lp.c_prior(attn, learned, "other", variants) == attn.prior_c


class _VramModelRunner(lr.LlamaCppRunner):
    """llama-bench replaced by the VRAM model with a fixed C per variant (the harness logic under test is
    the search, the rows and the deadline); runs after `cut_after` are cut as by the time limit."""

    def __init__(self, true_c: dict, cut_after: int | None = None, **kw):
        super().__init__(Path("/nonexistent"), Path("/nonexistent.gguf"), MOE, 16, Path("/tmp"), Deadline(None),
                         say=lambda m: None, prompts=(512,))
        self.true_c, self.cut_after, self.calls = true_c, cut_after, []

    def bench(self, variant, x):
        self.calls.append((variant.name, x))
        args = lp.variant_args(self.shape, variant, x)
        if self.cut_after is not None and len(self.calls) > self.cut_after:
            return {"peak": 0, "error": "timed out", "abort": True, "x": x, "args": args}
        peak = self.true_c[variant.name] + lp.offloaded_bytes(self.shape, variant.mode, x, self.n_ctx)
        return {"peak": int(peak), "x": x, "args": args, "command": " ".join(self.bench_argv(args)),
                "log": f"{len(self.calls):03d}", "seconds": 1.0, "pp512": 100.0 + x, "tg32": 10.0 + x}


def _budget(runner, tmp_path, monkeypatch, tuned, budgets=("4GiB", "8GiB")):
    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path))
    part = Partial(tmp_path / "out", "llamacpp")
    for b in budgets:
        lr.run_budget(runner, part, "qwen3-30b-a3b", b, int(b[0]) * GiB, 626 * 2**20, tuned)
    return part


def test_run_budget_moe_rows_fit_and_say_how_they_ran(tmp_path, monkeypatch):
    tuned = [next(v for v in lp.TUNED if v.name == n) for n in ("attn-gpu", "nommap+attn-gpu")]
    true_c = {"default": 2.3e9, "attn-gpu": 2.6e9, "nommap+attn-gpu": 2.6e9}
    runner = _VramModelRunner(true_c)
    part = _budget(runner, tmp_path, monkeypatch, tuned)
    rows = {(r["system"], r["budget"]): r for r in part.rows}
    assert set(rows) == {(s, b) for s in ("llama.cpp-default", "llama.cpp-tuned") for b in ("4GiB", "8GiB")}
    for (system, budget), r in rows.items():
        limit = int(budget[0]) * GiB + 626 * 2**20
        assert r["fits"] and r["peak_vram_bytes"] <= limit
        assert "-p 512 -n 32 -r 1" in r["note"] and r["prefill4096_tps"] is None and r["decode_tps"]
        x = r["plan"]["x"]
        variant = lp.DEFAULT if system == "llama.cpp-default" else next(v for v in tuned
                                                                         if v.name == r["decode_variant"])
        assert true_c[variant.name] + lp.offloaded_bytes(MOE, variant.mode, x + 1, 512) > limit   # the largest
        if system == "llama.cpp-tuned":
            assert "--n-cpu-moe" in r["command"] and [v["variant"] for v in r["variants"]] == [v.name for v in tuned]
    assert len(runner.calls) <= 3 * 2 + 3                                # ~2 runs at 4 GiB, 1 at 8 GiB
    nommap_runs = [x for name, x in runner.calls if name == "nommap+attn-gpu"]
    assert len(nommap_runs) == 2                                          # borrowed attn-gpu's C: 1 run a budget


def test_a_search_cut_after_a_fitting_run_keeps_that_run(tmp_path, monkeypatch):
    tuned = [v for v in lp.TUNED if v.name == "attn-gpu"]
    runner = _VramModelRunner({"default": 2.3e9, "attn-gpu": 0.5e9}, cut_after=2)    # attn-gpu's 2nd run cut
    part = _budget(runner, tmp_path, monkeypatch, tuned, budgets=("4GiB",))
    tuned_row = next(r for r in part.rows if r["system"] == "llama.cpp-tuned")
    assert tuned_row["fits"] and tuned_row["plan"]["x"] == runner.calls[1][1]
    assert "cut by the time limit" in tuned_row["variants"][0]["note"]
    assert not part.state.get("pending")
