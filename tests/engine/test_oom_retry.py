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


def test_the_retry_survives_running_short_itself(tiny_model, monkeypatch):
    """The re-plan after an out-of-memory cuts the KV cache before any weight leaves, and cutting a GPU pool
    takes new VRAM (the H200's MoE 2 GiB row, session 18: a 2 MiB pool failed where a 2 MiB weight had, and
    the error ended the request). A pool that cannot shrink on the GPU moves to host memory and comes back
    with the plan, and a re-plan that fails outright is followed by a smaller one: the step completes, with
    the same tokens, and every KV pool ends where the plan in force wants it."""
    from engine.backends.torch_engine import TorchEngine
    from engine.sharding import executor as executor_mod
    from engine.sharding.kvcache import PagedKVCache
    from engine.sharding.plan import Placement, Plan, PlanSet

    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    full = eng.spec.total_weight_bytes * 2

    def planset(self, budget, kv_tokens=None):     # attention (and so its KV) on the GPU while it fits
        where = {s.name: (Placement.RESIDENT if s.kind == "attn" and budget >= full // 4 else Placement.CPU)
                 for s in self.spec.sublayers}
        return PlanSet(budget, [Plan(t, "manual", dict(where), 0) for t in self.tiers])

    monkeypatch.setattr(TorchEngine, "_make_planset", planset)
    eng.set_vram_budget(full)
    list(eng.generate("a b c " * 80, max_new_tokens=2))       # the KV cache grows past what "a b c" needs
    want = [e.token_id for e in eng.generate("a b c", max_new_tokens=16)]
    kv = eng.executor.kv
    assert all(p.on_gpu for p in kv.pools) and kv.n_blocks > 4

    real_ffn, real_parts, real_activate = dense.ffn_block, PagedKVCache._new_parts, executor_mod.Executor.activate
    state = {"armed": False, "ffn": 0, "parts": 0, "activate": 0, "moved_to_host": 0}

    def flaky_ffn(cfg, w, x):
        if state["armed"] and not state["ffn"]:
            state["ffn"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_ffn(cfg, w, x)

    def short_parts(self, pool, n_blocks, on_gpu, device):
        if state["ffn"] and on_gpu and pool.on_gpu and n_blocks < pool.capacity:
            state["parts"] += 1            # the cut's new, smaller GPU pools: no VRAM for them
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        if state["parts"] and not on_gpu:
            state["moved_to_host"] += 1
        return real_parts(self, pool, n_blocks, on_gpu, device)

    def short_activate(self, plan, *args, **kwargs):
        if state["parts"] and not state["activate"]:
            state["activate"] += 1         # the first re-plan's weights do not fit either
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_activate(self, plan, *args, **kwargs)

    monkeypatch.setattr(dense, "ffn_block", flaky_ffn)
    monkeypatch.setattr(PagedKVCache, "_new_parts", short_parts)
    monkeypatch.setattr(executor_mod.Executor, "activate", short_activate)
    got = []
    for i, ev in enumerate(eng.generate("a b c", max_new_tokens=16)):
        got.append(ev.token_id)
        if i == 5:
            state["armed"] = True
    assert state["ffn"] == 1 and state["parts"] >= 1 and state["moved_to_host"] >= 1 and state["activate"] == 1
    assert got == want
    assert full // 4 <= eng.budget < full * 3 // 4      # the failed re-plan at 3/4, then one at 9/16
    assert sum("out of memory" in r["reason"] for r in eng.replans) == 1
    plan = eng.executor.plan
    assert all(pool.on_gpu and plan.kv_on_gpu(i) for i, pool in enumerate(kv.pools))
    assert eng.accel.total_used <= eng.budget
    eng.close()


def _attention_on_gpu_planset(full):
    from engine.sharding.plan import Placement, Plan, PlanSet

    def planset(self, budget, kv_tokens=None):     # attention (and so its KV) on the GPU while it fits
        where = {s.name: (Placement.RESIDENT if s.kind == "attn" and budget >= full // 4 else Placement.CPU)
                 for s in self.spec.sublayers}
        return PlanSet(budget, [Plan(t, "manual", dict(where), 0) for t in self.tiers])
    return planset


def _growing_context(tiny_model, monkeypatch, fail_gpu_pools: int):
    """A short prompt, then a long one whose KV growth meets `fail_gpu_pools` refused GPU pool allocations
    (the allocator's cap): (tokens of the long prompt before, after, the engine, the releases asked for)."""
    from engine.backends.torch_engine import TorchEngine
    from engine.sharding.kvcache import PagedKVCache

    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    full = eng.spec.total_weight_bytes * 2
    monkeypatch.setattr(TorchEngine, "_make_planset", _attention_on_gpu_planset(full))
    eng.set_vram_budget(full)
    long_prompt = "a b c " * 80
    want = tokens_of(eng, long_prompt, 6)
    eng.close()

    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    eng.set_vram_budget(full)
    tokens_of(eng, "a b c", 2)
    assert all(p.on_gpu for p in eng.executor.kv.pools)
    real_parts = PagedKVCache._new_parts
    state = {"left": fail_gpu_pools, "released": 0}

    def capped_parts(self, pool, n_blocks, on_gpu, device):
        if on_gpu and n_blocks > pool.capacity and state["left"]:
            state["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: the allocator's cap)")
        return real_parts(self, pool, n_blocks, on_gpu, device)

    def release():
        state["released"] += 1

    monkeypatch.setattr(PagedKVCache, "_new_parts", capped_parts)
    monkeypatch.setattr(eng.accel, "release_to_driver", release)
    got = tokens_of(eng, long_prompt, 6)
    return want, got, eng, state, full


def tokens_of(eng, prompt: str, n: int) -> list[int]:
    return [e.token_id for e in eng.generate(prompt, max_new_tokens=n) if e.token_id is not None]


def test_a_kv_pool_meeting_the_allocators_cap_gives_cached_blocks_back_and_grows(tiny_model, monkeypatch):
    """A GPU pool that grows for a longer context and is refused once (cached free blocks of the allocator
    count against its cap) is made again after the cache is given back: no back-off, same tokens."""
    want, got, eng, state, full = _growing_context(tiny_model, monkeypatch, fail_gpu_pools=1)
    assert got == want
    assert state["left"] == 0 and state["released"] == 1
    assert eng.budget == full and not any("out of memory" in r["reason"] for r in eng.replans)
    assert all(p.on_gpu for p in eng.executor.kv.pools)
    eng.close()


def test_a_kv_growth_out_of_memory_backs_off_like_a_step(tiny_model, monkeypatch):
    """Where the pools cannot grow on the GPU even then, the step re-plans at a smaller budget (as an
    out-of-memory inside the step does) instead of ending the request: same tokens."""
    want, got, eng, state, full = _growing_context(tiny_model, monkeypatch, fail_gpu_pools=1000)
    assert got == want
    assert state["released"] >= 1 and eng.budget < full
    assert any("out of memory" in r["reason"] for r in eng.replans)
    assert eng.accel.total_used <= eng.budget
    eng.close()


def _short_activation_once(monkeypatch, caller: str) -> dict:
    """The executor's activation runs short once (a booking over the budget), where it is called from
    `caller` (a TorchEngine method) and armed."""
    import inspect

    from engine.errors import OutOfBudgetError
    from engine.sharding import executor as executor_mod

    real = executor_mod.Executor.activate
    state = {"armed": False, "fired": 0}

    def short(self, plan, *args, **kwargs):
        if state["armed"] and not state["fired"] and any(f.function == caller for f in inspect.stack()):
            state["fired"] += 1
            raise OutOfBudgetError(f"scratch for {plan.tier}-token steps: more would exceed the VRAM budget "
                                   "(simulated)")
        return real(self, plan, *args, **kwargs)

    monkeypatch.setattr(executor_mod.Executor, "activate", short)
    return state


def test_a_kv_cut_whose_re_plan_runs_short_backs_off_like_a_step(tiny_model, monkeypatch):
    """A shorter request after a long one cuts the KV capacity and re-plans; where that re-plan runs short
    (on the H200 the process overhead had grown by kernels loaded since the budget was set: session 29,
    calls CI and CJ, the MoE shape at 4 GiB), the request backs off to a smaller budget and runs, with the
    same tokens, instead of ending in the error; the next request tries the budget asked for again."""
    from engine.backends import torch_engine
    from engine.backends.torch_engine import TorchEngine

    monkeypatch.setattr(torch_engine, "INITIAL_KV_TOKENS", 64)          # a 240-token prompt grows the KV
    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    full = eng.spec.total_weight_bytes * 2
    monkeypatch.setattr(TorchEngine, "_make_planset", _attention_on_gpu_planset(full))
    eng.set_vram_budget(full)
    want = tokens(eng, 8)
    tokens_of(eng, "a b c d " * 60, 2)
    grown = eng.kv_tokens
    state = _short_activation_once(monkeypatch, "_fit_kv_to_request")
    state["armed"] = True
    assert tokens(eng, 8) == want
    assert state["fired"] == 1 and eng.kv_tokens < grown
    assert eng.budget < full and "out of memory" in eng.replans[-1]["reason"]
    assert eng.accel.total_used <= eng.budget
    assert tokens(eng, 8) == want and eng.budget == full      # the budget asked for, tried again
    eng.close()


def test_a_budget_raise_whose_re_plan_runs_short_backs_off_instead_of_raising(tiny_model, monkeypatch):
    """set_vram_budget's re-plan running short does not raise to the caller (the app's slider, the suite's
    next budget): the engine backs off from the budget asked for, keeps giving the same tokens, and tries
    that budget again at the next request."""
    from engine.backends.torch_engine import TorchEngine

    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    full = eng.spec.total_weight_bytes * 2
    monkeypatch.setattr(TorchEngine, "_make_planset", _attention_on_gpu_planset(full))
    eng.set_vram_budget(full)
    want = tokens(eng, 8)
    eng.set_vram_budget(full // 8)
    state = _short_activation_once(monkeypatch, "_apply_pending_budget")
    state["armed"] = True
    eng.set_vram_budget(full)
    assert state["fired"] == 1
    assert full // 8 < eng.budget < full and "out of memory" in eng.replans[-1]["reason"]
    assert eng.accel.total_used <= eng.budget
    assert tokens(eng, 8) == want and eng.budget == full
    eng.close()


def test_force_plan_whose_re_plan_runs_short_backs_off_instead_of_raising(tiny_model, monkeypatch):
    """force_plan re-plans at once; where that runs short it backs off like a budget change, with the kind
    forced kept, and the same tokens."""
    from engine.backends.torch_engine import TorchEngine

    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    full = eng.spec.total_weight_bytes * 2
    monkeypatch.setattr(TorchEngine, "_make_planset", _attention_on_gpu_planset(full))
    eng.set_vram_budget(full)
    want = tokens(eng, 8)
    state = _short_activation_once(monkeypatch, "force_plan")
    state["armed"] = True
    eng.force_plan("static")
    assert state["fired"] == 1 and eng.plan_report()["forced"] == "static"
    assert eng.budget < full and "out of memory" in eng.replans[-1]["reason"]
    assert tokens(eng, 8) == want and eng.budget == full
    eng.close()
