"""Fidelity against transformers: tiny random-weight models of each architecture, float32.

`score()` must match transformers' logits within 1e-3 relative (max abs diff / max abs ref) on the CPU
and on the accelerator (sim in CI, cuda on the GPU machine) under every plan kind at a budget of about a
third of the weights; greedy tokens must not change when the budget moves mid-generation. The engines on
the accelerator plan with `tests.engine.tiny_plans` (tiers up to 64, a slow CPU) so that their plans
really put sub-layers on the GPU; the test checks that they do.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import engine
from tests.engine.reference import rel_err, transformers_logits
from tests.engine.tiny_plans import TIERS, plain_on_gpu, slow_cpu_profile, third_of_weights

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")
VARIANTS = [
    ("llama", {}),                                   # GQA, untied
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),   # MHA, tied
    ("llama3", {}),                                  # llama3 rope scaling
    ("mistral", {}),
    ("qwen2", {}),                                   # q/k/v bias
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),                                   # q/k norm
]
IDS = [(7 * i + 3) % 300 + 5 for i in range(90)]


def reference(path) -> torch.Tensor:
    return transformers_logits(path, IDS)


def open_on_device(path):
    return engine.open_model(path, device=DEVICE, backend="torch",
                             **plain_on_gpu(DEVICE), tiers=TIERS, profile=slow_cpu_profile())


def on_gpu(report) -> int:
    return sum(p != "cpu" for t in report["tiers"] for p in t["placement"].values())


@pytest.mark.parametrize("arch,options", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_score_matches_transformers(tiny_model, arch, options):
    path = tiny_model(arch, **options)
    ref = reference(path)
    cpu = engine.open_model(path, device="cpu", backend="torch")
    assert rel_err(cpu.score(IDS), ref) < 1e-3
    cpu.close()
    eng = open_on_device(path)
    eng.set_vram_budget(third_of_weights(eng))
    for kind in ("gpu_only", "static", "dynamic", "auto"):
        eng.force_plan(kind)
        got = eng.score(IDS)
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert rel_err(got, ref) < 1e-3, kind
        report = eng.plan_report()
        assert all(t["vram"]["total"] <= report["budget"] for t in report["tiers"])
        assert on_gpu(report) > 0, kind
        if kind != "auto":
            assert kind in {t["plan"] for t in report["tiers"]}
        assert eng.accel.peak <= max(r["budget"] for r in eng.replans)
    eng.close()


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_greedy_survives_budget_changes(tiny_model, arch):
    path = tiny_model(arch)
    eng = open_on_device(path)
    full = eng.spec.total_weight_bytes
    base = third_of_weights(eng) - full // 3          # KV cache and scratch
    eng.set_vram_budget(base + full * 2)
    want = [e.token_id for e in eng.generate("a b c d e", max_new_tokens=40)]
    eng.set_vram_budget(base + full * 2)
    budgets = [base + full // 3, 0, base + full // 8, base + full * 2, base + full // 2, base + full // 5]
    got, gpu_counts = [], set()
    for i, ev in enumerate(eng.generate("a b c d e", max_new_tokens=40)):
        got.append(ev.token_id)
        gpu_counts.add(on_gpu(eng.plan_report()))
        if i % 6 == 3:
            # From another thread, as the app's budget slider or the monitor does.
            t = threading.Thread(target=eng.set_vram_budget, args=(budgets[(i // 6) % len(budgets)],))
            t.start()
            t.join()
    assert len(gpu_counts) >= 3                        # the placement really moved
    assert got == want
    assert len(eng.replans) >= 4
    eng.close()
