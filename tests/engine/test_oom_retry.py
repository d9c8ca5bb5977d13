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


def test_the_budget_asked_for_comes_back_at_the_next_prompt(tiny_model, monkeypatch):
    """A back-off after out-of-memory is not kept for good: the next prompt re-plans at the budget asked
    for (the game that took the room may be gone), with the same tokens; where it fails every time, the
    engine asks for a retry after at most OOM_RETRIES back-offs until a new budget is set."""
    from engine.backends import torch_engine

    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    full = eng.spec.total_weight_bytes * 2
    eng.set_vram_budget(full)
    want = tokens(eng, 8)
    real_ffn = dense.ffn_block
    state = {"fire": 1, "fired": 0}

    def flaky_ffn(cfg, w, x):
        if state["fire"] and eng.budget == full:
            state["fire"] -= 1
            state["fired"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_ffn(cfg, w, x)

    monkeypatch.setattr(dense, "ffn_block", flaky_ffn)
    assert tokens(eng, 8) == want
    assert state["fired"] == 1 and eng.budget < full
    assert tokens(eng, 8) == want
    assert eng.budget == full
    assert any("retry the budget" in r["reason"] for r in eng.replans)

    state["fire"] = 1000                   # the room never comes back
    for _ in range(torch_engine.OOM_RETRIES + 3):
        assert tokens(eng, 4) == want[:4]
    assert eng.budget < full
    assert state["fired"] == 1 + torch_engine.OOM_RETRIES     # back-offs that ask for a retry: OOM_RETRIES
    eng.set_vram_budget(full)               # a new budget asked for: tried again
    state["fire"] = 0
    tokens(eng, 2)
    assert eng.budget == full
    eng.close()


def tokens(eng, n: int) -> list[int]:
    return [e.token_id for e in eng.generate("a b c", max_new_tokens=n) if e.token_id is not None]
