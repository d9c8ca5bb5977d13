"""The vision pass under the VRAM budget (VLMOpt): weights streamed through booked slots, activations
booked and bounded by the work cap, the language model making room, the pass priced by the planner.

References: transformers' own vision tower (embeddings), the engine's CPU run (greedy tokens), and the
tensors the pass really keeps alive (counted op by op) against what it books."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import engine
import tests.engine.vision_fixtures as vf
from engine.errors import BadInputError
from engine.models.vision import qwen2_5_vl_tower as tower
from engine.models.vision.qwen2_5_vl_processor import preprocess_images
from engine.models.vision.qwen2_5_vl_tower import VisionConfig
from engine.models.vision.vision_pass import (
    WORK_CAPS,
    VisionPass,
    plan_vision_pass,
)
from engine.sharding.device import Accelerator
from engine.sharding.profile import ProfileDatabase

folder, loaded, reference = vf.folder, vf.loaded, vf.reference
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
TOLERANCE = 1e-4
GIB = 1 << 30
TIERS = (1, 16)
# A larger tiny tower (more patches and width than the default one) for the memory checks.
WIDE = {"vision": {"hidden_size": 64, "num_heads": 4, "intermediate_size": 176, "depth": 3,
                   "fullatt_block_indexes": [1], "window_size": 56}, "max_pixels": 200_000}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _sim(budget: int = 1 << 40) -> Accelerator:
    accel = Accelerator("sim")
    accel.budget = budget
    return accel


def _forced(vcfg, grids, cap: int, vp: VisionPass, budget: int = 1 << 40):
    return plan_vision_pass(vcfg, grids, vp.dtype, prof=ProfileDatabase.sim(), budget=budget, where="gpu",
                            work_cap=cap, sizes=vp.sizes)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that tensors made inside the mode keep alive; the peak of their sum.
    Storages that existed before (pixels, host weights) are not counted."""

    def __init__(self, ignore=()):
        super().__init__()
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = self.peak = 0

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key in self.ignore:
                    continue
                if key not in self.refs:
                    self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.size[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out


def test_streamed_pass_equals_reference_for_every_work_cap(loaded, reference):
    """Weights streamed through slots, attention tiled and blocks chunked under small caps: the same
    embeddings as transformers; the streamed pass and the CPU pass agree bit for bit."""
    vp = VisionPass(loaded.vision, loaded.vision_weights, _sim(), torch.float32)
    pixel_values, grids = preprocess_images([vf.picture(640, 200), vf.picture(123, 77)], loaded.vision.processor)
    with torch.no_grad():
        ref = reference.model.visual(pixel_values, grid_thw=grids).pooler_output
    n = pixel_values.shape[0]
    for cap in (WORK_CAPS[0], 64 << 10, 8 << 10):
        plan = _forced(loaded.vision, grids, cap, vp)
        assert plan.where == "gpu"
        if cap < WORK_CAPS[0]:
            assert plan.rows < n, "a small cap must chunk the blocks' rows"
        gpu = vp.run(pixel_values, grids, plan)
        assert vp.last["where"] == "gpu" and vp.last["booked_bytes"] == plan.vram_bytes > 0
        assert vp.accel.total_used == 0, "the pass frees what it booked"
        plan.where = "cpu"
        cpu = vp.run(pixel_values, grids, plan)
        assert torch.equal(gpu, cpu)
        assert _rel(gpu, ref) < TOLERANCE


def unfused_attention(q, k, v):
    """Attention with its scores materialised (the worst case a fallback kernel can take)."""
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    return torch.matmul(scores.softmax(-1), v)


def test_booked_activations_cover_what_the_pass_keeps_alive(tiny_model, monkeypatch):
    from engine.loading.hf_vision import load_hf_vl

    vl = load_hf_vl(tiny_model("qwen2_5_vl", **WIDE))
    vp = VisionPass(vl.vision, vl.vision_weights, _sim(), torch.float32)
    pixel_values, grids = preprocess_images([vf.picture(600, 300)], vl.vision.processor)
    assert pixel_values.shape[0] >= 900
    booked = []
    for cap in (WORK_CAPS[0], 256 << 10, 32 << 10):
        plan = _forced(vl.vision, grids, cap, vp)
        # Unfused attention (scores materialised) is the worst case the booking covers.
        monkeypatch.setattr(tower.F, "scaled_dot_product_attention", unfused_attention)
        with torch.inference_mode(), LiveBytes([pixel_values]) as live:
            vp.run(pixel_values, grids, plan)
        monkeypatch.undo()
        slots = plan.n_slots * plan.slot_bytes
        # Booked covers what is alive at the peak, and is not wildly above it (the margin and the pixel
        # chunks, which cross to a real GPU but not to "sim", make the difference).
        print(cap, plan.rows, live.peak - slots, plan.activation_bytes)
        assert slots < live.peak <= plan.vram_bytes
        assert live.peak - slots > plan.activation_bytes / 3
        booked.append(plan.activation_bytes)
    assert booked[-1] < booked[0], "a smaller work cap books less"


def _tokens(eng, image, n=8):
    return [e.token_id for e in eng.generate(QUESTION, images=[image], max_new_tokens=n)][:n]


@pytest.mark.parametrize("overhead", [0, 3 << 20])
def test_vision_pass_stays_within_small_budgets(folder, overhead, monkeypatch):
    """`overhead`: a simulated process overhead (a CUDA context): budgets are whole-process figures, and
    the pass and the model must fit in what is left of them."""
    image = vf.picture(300, 500)
    cpu = engine.open_model(folder, device="cpu", backend="torch", speculative=False)
    want = _tokens(cpu, image)
    cpu.close()
    # Two small tiers: the plan's VRAM is then mostly the language model's weights and KV, not scratch
    # for long inputs, so a budget just over it leaves less free than the pass needs.
    probe = engine.open_model(folder, device="sim", backend="torch", speculative=False, kind="gpu_only", tiers=TIERS)
    _, grids = preprocess_images([image], probe.vision.processor)
    lm_all = probe.planner().min_budget("gpu_only", probe.kv_tokens)
    probe.force_vision("gpu")
    least = min(probe.vision_pass.plan(grids, ProfileDatabase.sim(), 1 << 40).vram_bytes
                for probe.vision_pass.work_cap in WORK_CAPS)
    probe.vision_pass.work_cap = None
    most = probe.vision_pass.plan(grids, ProfileDatabase.sim(), 1 << 40).vram_bytes
    probe.close()
    assert 0 < least < most
    budgets = {"room for both": lm_all + 2 * most, "the model makes room": lm_all + least // 2,
               "only the pass fits": least + 1024, "nothing fits": least // 2}
    made_room = []
    monkeypatch.setenv("SLIPSTREAM_SIM_OVERHEAD", str(overhead))
    for what, budget in budgets.items():
        eng = engine.open_model(folder, device="sim", backend="torch", speculative=False, kind="gpu_only",
                                vram_budget=budget + overhead, tiers=TIERS)
        assert eng.accel.budget == budget
        eng.force_vision("gpu")
        lm_before = eng.accel.total_used
        assert _tokens(eng, image) == want, what
        last = eng.vision_pass.last
        assert eng.accel.peak <= budget, what
        assert last["in_use_during_pass"] <= budget, what
        if what == "nothing fits":
            assert last["where"] == "cpu" and last["booked_bytes"] == 0
            assert "fits" in last["plan"]["reason"]
        else:
            assert last["where"] == "gpu" and last["booked_bytes"] > 0, (what, last)
            room = last["plan"]["room_bytes"]
            if budget - lm_before < least:          # the pass cannot fit beside the model as it was
                assert room > 0, what
            if room:
                made_room.append(what)
                assert last["in_use_during_pass"] - last["booked_bytes"] < lm_before, what
            else:
                assert last["in_use_during_pass"] - last["booked_bytes"] == lm_before, what
        # After the pass the language model runs its own plan for the whole budget again.
        assert eng.executor.plan is eng.planset.for_tokens(1) or eng.executor.plan in eng.planset.plans
        eng.close()
    assert made_room, "some budget must make the language model give up VRAM for the pass"


def test_budget_drop_during_the_pass_moves_the_rest_to_the_cpu(loaded):
    accel = _sim()
    vp = VisionPass(loaded.vision, loaded.vision_weights, accel, torch.float32)
    pixel_values, grids = preprocess_images([vf.picture(300, 500)], loaded.vision.processor)
    plan = _forced(loaded.vision, grids, WORK_CAPS[0], vp)
    asked = []

    def interrupt() -> bool:
        asked.append(accel.total_used)
        return len(asked) == 3          # the budget drops before the second block

    out = vp.run(pixel_values, grids, plan, interrupt)
    assert vp.last["where"] == "gpu+cpu" and "dropped" in vp.last["fell_back"]
    assert asked[:3] == [plan.vram_bytes] * 3 and accel.total_used == 0
    plan.where = "cpu"
    assert torch.equal(out, vp.run(pixel_values, grids, plan))


def test_plan_report_and_stats_show_the_vision_plan(folder):
    eng = engine.open_model(folder, device="sim", backend="torch", speculative=False)
    vision = eng.plan_report()["vision"]
    ref = vision["reference_image"]
    assert vision["passes"] == 0 and vision["last"] is None and vision["weights_bytes"] > 0
    assert ref["where"] in ("gpu", "cpu") and ref["tokens"] == ref["grid"][1] * ref["grid"][2] // 4
    assert ref["cpu_ms"] > 0 and ref["gpu_ms"] > 0 and ref["predicted_ms"] == min(ref["cpu_ms"], ref["gpu_ms"])
    eng.force_vision("gpu")
    list(eng.generate(QUESTION, images=[vf.picture(123, 77)], max_new_tokens=2))
    vision, stats = eng.plan_report()["vision"], eng.stats()
    assert vision["passes"] == stats["vision_passes"] == 1
    assert vision["last"]["plan"]["where"] == stats["vision_where"] == "gpu"
    assert stats["vision_vram_bytes"] == vision["last"]["booked_bytes"] > 0
    assert stats["vision_ms"] > 0 and stats["vision_predicted_ms"] > 0
    with pytest.raises(BadInputError):
        eng.force_vision("tpu")
    eng.close()


# ---- the planner on the real shape (no weights needed) -------------------------------------------

QWEN25_VL_7B = VisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=3584,
                            window_size=112, fullatt_block_indexes=(7, 15, 23, 31))
GRID_1440P = [(1, 102, 182)]       # 2560x1440 at the model's own pixel limits: 2548x1428 px


def test_planner_prices_the_7b_tower_on_a_1440p_image():
    prof = ProfileDatabase.sim()
    budgets = [int(g * GIB) for g in (0.125, 0.25, 0.5, 1, 2.5, 8, 24)]
    # The language model holds the whole budget: it makes room for whatever the pass needs.
    plans = [plan_vision_pass(QWEN25_VL_7B, GRID_1440P, torch.bfloat16, prof=prof, budget=b, lm_used=b)
             for b in budgets]
    for p, b in zip(plans, budgets):
        assert p.room_bytes == p.vram_bytes <= b if p.where == "gpu" else p.vram_bytes == 0
    gpu = [p for p in plans if p.where == "gpu"]
    assert plan_vision_pass(QWEN25_VL_7B, GRID_1440P, torch.bfloat16, prof=prof, budget=24 * GIB).work_cap \
        == WORK_CAPS[0], "with room to spare the largest cap"
    assert all(p.gpu_ms < p.cpu_ms for p in gpu), "20 TFLOP/s against 0.4: the GPU wins at this size"
    ms = [p.gpu_ms for p in gpu]
    assert ms == sorted(ms, reverse=True), "more budget never predicts a slower pass"
    caps = [p.work_cap for p in gpu]
    assert caps == sorted(caps)
    at_2_5 = plans[4]
    assert at_2_5.where == "gpu" and at_2_5.vram_bytes <= 2.5 * GIB and at_2_5.rows < at_2_5.patches
    # Two slots hold the largest group (the merger) and the rest of the pass is activations.
    assert at_2_5.slot_bytes * 2 < at_2_5.vram_bytes
    # The 4 full-attention blocks at 18564 patches cost far more than the 28 windowed ones together.
    assert plan_vision_pass(QWEN25_VL_7B, [(1, 28, 28)], torch.bfloat16, prof=prof, budget=GIB).gpu_ms < at_2_5.gpu_ms / 10
    assert plan_vision_pass(QWEN25_VL_7B, GRID_1440P, torch.bfloat16, prof=prof, budget=0).where == "cpu"
    assert plan_vision_pass(QWEN25_VL_7B, GRID_1440P, torch.bfloat16, prof=None, budget=GIB).where == "cpu"
