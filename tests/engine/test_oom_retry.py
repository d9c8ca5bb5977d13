"""Out-of-memory during a step re-plans at a smaller budget and retries the step: no token is lost."""

from __future__ import annotations

import torch

import engine
from engine.models import dense


def test_step_survives_an_out_of_memory(tiny_model, monkeypatch):
    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    full = eng.spec.total_weight_bytes * 2
    eng.set_vram_budget(full)
    want = [e.token_id for e in eng.generate("a b c", max_new_tokens=16)]
    eng.set_vram_budget(full)

    real_ffn = dense.ffn_block
    state = {"armed": False, "fired": 0}

    def flaky_ffn(cfg, w, x):
        # An activation allocation fails once in the middle of a step (another process took the room).
        if state["armed"] and not state["fired"]:
            state["fired"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_ffn(cfg, w, x)

    monkeypatch.setattr(dense, "ffn_block", flaky_ffn)
    got = []
    for i, ev in enumerate(eng.generate("a b c", max_new_tokens=16)):
        got.append(ev.token_id)
        if i == 5:
            state["armed"] = True
    assert state["fired"] == 1
    assert got == want
    assert eng.budget < full            # it re-planned at a smaller budget
    assert any("out of memory" in r["reason"] for r in eng.replans)
    assert eng.accel.total_used <= eng.budget
    eng.close()
