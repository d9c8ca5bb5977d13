"""Mixture-of-experts models (qwen3_moe, mixtral): fidelity against transformers, placement of routers and
expert groups, live budget changes, the planner's MoE pricing, and the Qwen3-30B-A3B shape on the CLI.

`score()` must match transformers' logits within 1e-3 relative on the CPU and on the accelerator (sim in
CI, cuda on the GPU machine) under every plan kind at a budget of about a third of the weights; greedy
tokens must not change when the budget moves mid-generation.

The engines here plan with a profile whose CPU is 1000x slower than the "sim" default and with tiers up to
64 tokens: a tiny model's weights are smaller than its KV cache and scratch, and on the default profile
every plan of it would run on the CPU. With these, the forced kinds really place routers and expert
groups resident, streamed and on the CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.config import ModelConfig, weight_names
from engine.sharding.plan import PLAN_KINDS, Placement, Plan, PlanSet
from engine.sharding.spec import ModelSpec
from tests.engine.planner_cases import moe_configs
from tests.engine.test_planner import check_planset

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")
VARIANTS = [
    ("qwen3_moe", {}),                                          # norm_topk_prob, every layer MoE
    ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [1], "tie_word_embeddings": True}),
    ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3}),   # layers 0 and 2 dense
    ("mixtral", {}),
]
IDS = [(7 * i + 3) % 300 + 5 for i in range(90)]

from tests.engine.reference import rel_err, transformers_logits
from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights


def open_tiny(path, group_size: int = 0, **kwargs):
    """A TorchEngine on DEVICE over the model at `path` (optionally `group_size` experts per group)."""
    from engine.backends.torch_engine import TorchEngine
    from engine.loading import load_model

    loaded = load_model(path)
    if group_size:
        loaded.config = dataclasses.replace(loaded.config, expert_group_size=group_size)
    kwargs.setdefault("device", DEVICE)
    kwargs.setdefault("speculative", False)      # steps of one token each: byte counts per decode step
    return TorchEngine(loaded, tiers=TIERS, profile=slow_cpu_profile(), **kwargs)


def variant_id(v) -> str:
    return v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "default"


def reference(path) -> torch.Tensor:
    return transformers_logits(path, IDS)


# ---- configuration and loading -----------------------------------------------------------------

def test_config_and_sub_layers(tiny_model):
    from engine.loading import read_config

    cfg = read_config(tiny_model("qwen3_moe", mlp_only_layers=[1], tie_word_embeddings=True))
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 8, 2, 32)
    assert cfg.qk_norm and cfg.mlp_only_layers == (1,) and cfg.is_moe_layer(0) and not cfg.is_moe_layer(1)
    groups = weight_names(cfg)
    assert groups["layers.0.ffn"] == ("layers.0.ffn_norm.weight", "layers.0.router.weight")
    assert groups["layers.1.ffn"][1:] == ("layers.1.gate.weight", "layers.1.up.weight", "layers.1.down.weight")
    assert [n for n in groups if n.startswith("layers.0.experts.")] == [f"layers.0.experts.{g}" for g in range(8)]
    mixtral = read_config(tiny_model("mixtral"))
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 64 and not mixtral.qk_norm
    grouped = dataclasses.replace(mixtral, expert_group_size=3)
    assert [list(r) for r in grouped.expert_groups()] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    spec = ModelSpec.from_config(grouped)
    kinds = {s.name: s.kind for s in spec.sublayers}
    assert kinds["layers.0.ffn"] == "router" and kinds["layers.0.experts.2"] == "experts"
    assert spec.by_name()["layers.0.experts.2"].n_experts == 2


def test_canonical_expert_names():
    from engine.loading.hf import canonical_name

    assert canonical_name("model.layers.3.mlp.experts.17.up_proj.weight") == "layers.3.experts.17.up.weight"
    assert canonical_name("model.layers.3.block_sparse_moe.experts.7.w1.weight") == "layers.3.experts.7.gate.weight"
    assert canonical_name("model.layers.3.block_sparse_moe.experts.7.w2.weight") == "layers.3.experts.7.down.weight"
    assert canonical_name("model.layers.1.mlp.gate.weight") == "layers.1.router.weight"
    assert canonical_name("model.layers.1.block_sparse_moe.gate.weight") == "layers.1.router.weight"
    assert canonical_name("model.layers.0.mlp.experts.0.w1.weight") is None      # mixed-up layouts
    assert canonical_name("model.layers.0.block_sparse_moe.experts.0.up_proj.weight") is None


def test_default_group_size():
    base = ModelConfig("qwen3_moe", 100, 64, 128, 1, 4, 2, 16, num_experts=128, num_experts_per_tok=8,
                       moe_intermediate_size=32)
    assert base.experts_per_group == 16 and len(base.expert_groups()) == 8
    assert dataclasses.replace(base, num_experts=8).experts_per_group == 1
    assert len(dataclasses.replace(base, num_experts=60).expert_groups()) == 8


def test_stacked_transformers5_layout_loads(tiny_model, tmp_path):
    """A checkpoint saved with transformers 5's stacked expert tensors loads to the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.loading import load_model

    src = tiny_model("qwen3_moe")
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        n = cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"]
        gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(n)]
        up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in range(n)]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(n)]
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[p + "down_proj"] = torch.stack(down)
    save_file(tensors, str(dst / "model.safetensors"))
    a, b = load_model(src).weights, load_model(dst).weights
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_moe_config_is_one_line(tiny_model, tmp_path):
    import shutil

    from engine.errors import ModelLoadError
    from engine.loading import read_config

    dst = tmp_path / "bad"
    shutil.copytree(tiny_model("mixtral"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok") as err:
        read_config(dst)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_round_trip(tiny_model, tmp_path, arch, qtype):
    """A converter-style GGUF (qwen3moe, or llama with experts; stacked ffn_*_exps) loads to the HF
    weights: exactly in F32, within the quantization step in Q8_0."""
    from engine.loading import load_model
    from tests.tiny_models import make_tiny_gguf

    hf = tiny_model(arch)
    gguf = load_model(make_tiny_gguf(hf, tmp_path / f"{arch}.gguf", qtype))
    ref = load_model(hf)
    assert gguf.config.arch == arch and gguf.config.num_experts == 8 and gguf.config.norm_topk_prob
    assert gguf.config.moe_intermediate_size == ref.config.moe_intermediate_size
    assert gguf.weights.keys() == ref.weights.keys()
    for name, w in ref.weights.items():
        if qtype == "F32":
            assert torch.equal(gguf.weights[name], w), name
        else:
            assert (gguf.weights[name] - w).abs().max() <= 0.01 * w.abs().max(), name


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gguf_agrees_with_llamacpp_and_transformers(tiny_model, tmp_path, arch):
    """The same F32 GGUF through the torch engine and through llama.cpp: both match transformers
    (llama.cpp keeps its KV cache in f16, hence its looser bound)."""
    import importlib.util

    from tests.tiny_models import make_tiny_gguf

    hf = tiny_model(arch)
    path = make_tiny_gguf(hf, tmp_path / f"{arch}.gguf")
    ref = reference(hf)
    eng = engine.open_model(path, device="cpu", backend="torch")
    assert rel_err(eng.score(IDS), ref) < 1e-5
    eng.close()
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    importlib.import_module("engine.backends.llamacpp")   # sets llama.cpp's thread wait policy before it loads

    lc = engine.open_model(path, backend="llamacpp", device="cpu", n_threads=1, n_ctx=256)
    got = lc.score(IDS)
    lc.close()
    assert rel_err(got, ref) < 3e-3
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


# ---- fidelity ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,options", VARIANTS, ids=variant_id)
def test_score_matches_transformers(tiny_model, arch, options):
    path = tiny_model(arch, **options)
    ref = reference(path)
    cpu = engine.open_model(path, device="cpu", backend="torch")
    assert rel_err(cpu.score(IDS), ref) < 1e-3
    cpu.close()
    eng = open_tiny(path)
    eng.set_vram_budget(third_of_weights(eng))
    seen = set()
    for kind in ("gpu_only", "static", "dynamic", "auto"):
        eng.force_plan(kind)
        got = eng.score(IDS)
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert rel_err(got, ref) < 1e-3, kind
        report = eng.plan_report()
        assert all(t["vram"]["total"] <= report["budget"] for t in report["tiers"])
        assert eng.accel.peak <= max(r["budget"] for r in eng.replans)
        experts = {p for t in report["tiers"] for n, p in t["placement"].items() if ".experts." in n}
        if kind != "auto":
            assert kind in {t["plan"] for t in report["tiers"]}
        seen |= experts
    assert seen == {"resident", "streamed", "cpu"}        # expert groups ran in every placement
    eng.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_multi_expert_groups_match_transformers(tiny_model, arch):
    """Groups of 3 experts (the last one of 2), on every plan kind."""
    path = tiny_model(arch)
    ref = reference(path)
    eng = open_tiny(path, 3)
    assert [s.name for s in eng.spec.sublayers if s.layer == 0][2:] == [f"layers.0.experts.{g}" for g in range(3)]
    eng.set_vram_budget(third_of_weights(eng))
    for kind in ("gpu_only", "static", "dynamic", "auto"):
        eng.force_plan(kind)
        assert rel_err(eng.score(IDS), ref) < 1e-3, kind
    eng.close()


def test_random_placements_match_cpu(tiny_model):
    """Any mix of resident / streamed / cpu routers and expert groups gives the CPU's logits."""
    path = tiny_model("qwen3_moe", mlp_only_layers=[1])
    cpu = engine.open_model(path, device="cpu", backend="torch")
    want = cpu.score(IDS[:40])
    cpu.close()
    eng = open_tiny(path, 3, vram_budget="1GiB")
    rng = random.Random(3)
    names = [s.name for s in eng.spec.sublayers]
    for n_slots in (1, 2, 3):
        placement = {n: rng.choice(list(Placement)) for n in names}
        planset = PlanSet(eng.budget, [Plan(t, "manual", dict(placement), n_slots) for t in eng.tiers])
        eng._make_planset = lambda budget, kv_tokens=None, ps=planset: ps
        eng.set_vram_budget(eng.budget)
        assert rel_err(eng.score(IDS[:40]), want) < (1e-5 if DEVICE == "sim" else 1e-3)
        assert eng.accel.total_used <= eng.budget
    eng.close()
    assert eng.accel.total_used == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_native_expert_kernel_matches_transformers(tiny_model, arch, monkeypatch):
    """Routed experts on the CPU as one native pool job per projection (tiny matrices let through by a
    zero size threshold): scores match transformers, decode (one row per expert) and prefill (several)
    alike, with groups fused across the layer."""
    from engine import kernels
    from engine.models import moe

    if kernels._load() is None:
        pytest.skip(f"no native kernel: {kernels.status()}")
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    calls = []
    real = kernels._batch                              # (every batched native job: linear_many, linear_stacked)
    monkeypatch.setattr(kernels, "_batch", lambda dtype, xp, *a: calls.append(len(xp)) or real(dtype, xp, *a))
    path = tiny_model(arch)
    ids = IDS[:12]                                      # few enough rows per expert for the kernel
    ref = transformers_logits(path, ids)
    cpu = engine.open_model(path, device="cpu", backend="torch")
    assert rel_err(cpu.score(ids), ref) < 1e-3
    assert calls and max(calls) > 1                    # it ran, several experts per call
    calls.clear()
    greedy = [e.token_id for e in cpu.generate("a b c d e", max_new_tokens=12) if e.token_id is not None]
    assert calls
    cpu.close()
    monkeypatch.setattr(moe, "_experts_native", lambda *a: False)
    plain = engine.open_model(path, device="cpu", backend="torch")
    assert [e.token_id for e in plain.generate("a b c d e", max_new_tokens=12) if e.token_id is not None] == greedy
    plain.close()


# ---- live budget changes -----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_greedy_survives_budget_changes(tiny_model, arch):
    path = tiny_model(arch)
    eng = open_tiny(path)
    room = third_of_weights(eng)
    full = room + eng.spec.total_weight_bytes
    eng.set_vram_budget(full * 2)
    want = [e.token_id for e in eng.generate("a b c d e", max_new_tokens=40)]
    eng.set_vram_budget(full * 2)
    seen = []
    activate = eng.executor.activate

    def spy(plan, *args, **kwargs):
        seen.append(tuple(str(p) for n, p in plan.placement.items() if ".experts." in n))
        return activate(plan, *args, **kwargs)

    eng.executor.activate = spy
    budgets = [room, 0, room // 2, full * 2, (room + full) // 2, room // 3]
    got = []
    for i, ev in enumerate(eng.generate("a b c d e", max_new_tokens=40)):
        got.append(ev.token_id)
        if i % 6 == 3:
            # From another thread, as the app's budget slider or the monitor does.
            t = threading.Thread(target=eng.set_vram_budget, args=(budgets[(i // 6) % len(budgets)],))
            t.start()
            t.join()
    assert got == want
    assert len(eng.replans) >= 4
    assert len(set(seen)) >= 3                       # the expert groups really moved
    assert any("resident" in s for s in seen) and any(set(s) == {"cpu"} for s in seen)
    eng.close()


# ---- placement in plan_report ------------------------------------------------------------------

def test_plan_report_places_routers_and_expert_groups(tiny_model):
    eng = open_tiny(tiny_model("qwen3_moe"))
    names = [s.name for s in eng.spec.sublayers]
    eng.set_vram_budget(third_of_weights(eng))
    eng.force_plan("static")
    for tier in eng.plan_report()["tiers"]:
        placement = tier["placement"]
        assert list(placement) == names
        assert {"layers.0.ffn", "layers.1.ffn", "layers.0.experts.0", "layers.1.experts.7"} <= set(placement)
        assert set(placement.values()) <= {"resident", "streamed", "cpu"}
        assert "streamed" not in placement.values()
        for i in range(eng.config.num_layers):    # a router runs on the GPU only beside its attention, and
            # on the CPU beside GPU attention only where all its layer's experts run on the CPU
            groups = [v for k, v in placement.items() if k.startswith(f"layers.{i}.experts.")]
            if placement[f"layers.{i}.attn"] == "cpu":
                assert placement[f"layers.{i}.ffn"] == "cpu"
            elif placement[f"layers.{i}.ffn"] == "cpu":
                assert set(groups) == {"cpu"}
    eng.close()


# ---- the planner on MoE shapes -----------------------------------------------------------------

def _planner(cfg, tiers=(1, 4, 16, 64, 256, 1024)):
    from engine.sharding.planner import Planner
    from engine.sharding.profile import ProfileDatabase

    return Planner(ModelSpec.from_config(cfg), ProfileDatabase.sim(), tiers=tiers)


@settings(max_examples=int(os.environ.get("SLIPSTREAM_PLANNER_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=moe_configs(), fracs=st.lists(st.floats(0, 1.2), min_size=1, max_size=3),
       kv_tokens=st.sampled_from([0, 16, 300, 4096]), kind=st.sampled_from([None, *PLAN_KINDS]))
def test_moe_plans_fit_and_keep_attention_in_place(cfg, fracs, kv_tokens, kind):
    planner = _planner(cfg)
    total = planner.spec.total_weight_bytes * 2
    for budget in [0, 1, 4096] + [int(f * total) for f in fracs]:
        ps = planner.plan(budget, kv_tokens=kv_tokens, force_kind=kind)
        check_planset(planner, ps, budget, kv_tokens, kind)      # fits; attention sides equal across tiers
        for p in ps.plans:
            for s in planner.spec.sublayers:
                if s.kind == "router":
                    attn_gpu = p.placement[f"layers.{s.layer}.attn"] is not Placement.CPU
                    router_gpu = p.placement[s.name] is not Placement.CPU
                    groups = {v for k, v in p.placement.items() if k.startswith(f"layers.{s.layer}.experts.")}
                    # on the GPU only beside GPU attention; on the CPU beside it only before CPU experts
                    assert router_gpu <= attn_gpu
                    assert router_gpu or not attn_gpu or groups == {Placement.CPU}


def test_h200_decode_plans_score_routers_on_the_host_beside_cpu_experts():
    """With the H200's measured profile, the decode plan of the Qwen3-30B-A3B shape (24 layers, as the GPU
    suite runs it) keeps attention on the GPU and moves the router of each layer whose experts all run on
    the CPU there too: one hidden state crosses instead of the MoE state, and no GPU router launches."""
    import dataclasses
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.planner import Planner

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    cfg = dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=24)
    planner = Planner(ModelSpec.from_config(cfg), prof, tiers=(1, 64, 4096))   # (a 4096-token prompt keeps
    # every layer's KV in VRAM; with tiers up to 64 only, decode prices attention on the CPU within 1%)
    p = planner.plan("3584MiB", kv_tokens=4352).plans[0]
    host_routers = 0
    for j in range(cfg.num_layers):
        groups = {v for k, v in p.placement.items() if k.startswith(f"layers.{j}.experts.")}
        assert p.placement[f"layers.{j}.attn"] is not Placement.CPU
        if groups == {Placement.CPU}:
            assert p.placement[f"layers.{j}.ffn"] is Placement.CPU
            host_routers += 1
        else:
            assert p.placement[f"layers.{j}.ffn"] is Placement.RESIDENT
    assert host_routers >= cfg.num_layers // 2
    placed = dict(p.placement)
    for j in range(cfg.num_layers):       # the same plan with routers beside their attention is slower
        placed[f"layers.{j}.ffn"] = Placement.RESIDENT
    est = planner.estimator
    assert est.estimate(placed, 1, 2176) > est.estimate(p.placement, 1, 2176)


def test_expected_experts_grow_with_the_tier():
    from engine.bench.shapes import get_shape

    spec = ModelSpec.from_config(get_shape("qwen3-30b-a3b"))
    group = spec.by_name()["layers.0.experts.0"]
    assert group.n_experts == 16
    touched = [spec.expected_experts(group, t) for t in (1, 4, 16, 64, 256)]
    assert touched[0] == pytest.approx(16 * 8 / 128)               # one token: k/E of the group
    assert all(a < b for a, b in itertools.pairwise(touched)) and touched[-1] == pytest.approx(16, rel=1e-6)
    assert spec.expected_experts(group, 4) == pytest.approx(16 * (1 - (1 - 8 / 128) ** 4))


def test_decode_reads_only_the_routed_experts():
    """On the CPU a decode step of an expert group costs about k/E of reading the whole group; a long
    prefill reads (and computes) all of it."""
    from engine.bench.shapes import get_shape
    from engine.sharding.estimator import Estimator
    from engine.sharding.profile import ProfileDatabase

    prof = ProfileDatabase.sim()
    spec = ModelSpec.from_config(get_shape("qwen3-30b-a3b"))
    est = Estimator(spec, prof)
    i = [s.name for s in spec.sublayers].index("layers.0.experts.0")
    group = spec.sublayers[i]
    whole = prof.mem_ms("cpu", group.weight_bytes)
    decode = est.costs(1, 1024).cpu_ms[i]
    assert 0.5 * whole * 8 / 128 < decode < 2 * whole * 8 / 128
    assert est.costs(4096, 4096).cpu_ms[i] > whole


def test_qwen3_30b_a3b_static_plan_keeps_attention_and_head_resident_and_routers_beside_their_experts():
    from engine.bench.shapes import get_shape

    planner = _planner(get_shape("qwen3-30b-a3b"), tiers=(1, 64))
    ps = planner.plan("8GiB", kv_tokens=4096, force_kind="static")
    for p in ps.plans:
        assert p.kind == "static"
        for s in planner.spec.sublayers:
            if s.kind in ("attn", "head"):
                assert p.placement[s.name] is Placement.RESIDENT, s.name
            elif s.kind == "router":    # on the host only where every expert of its layer runs there
                groups = {v for k, v in p.placement.items() if k.startswith(f"layers.{s.layer}.experts.")}
                assert p.placement[s.name] is Placement.RESIDENT or groups == {Placement.CPU}, s.name
        assert any(p.placement[s.name] is Placement.CPU for s in planner.spec.sublayers if s.kind == "experts")
    for p in planner.plan("4GiB", kv_tokens=4096, force_kind="dynamic").plans:
        assert p.kind == "dynamic"
        assert any(p.placement[s.name] is Placement.STREAMED for s in planner.spec.sublayers
                   if s.kind == "experts")


def test_plan_cli_on_qwen3_30b_a3b(capsys):
    from engine.__main__ import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--budget", "4GiB", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["budget"] == 4 << 30
    for tier in rep["tiers"]:
        assert tier["vram"]["total"] <= rep["budget"]
        assert "layers.47.experts.7" in tier["placement"] and "layers.47.ffn" in tier["placement"]
    assert main(["plan", "--model", "qwen3-30b-a3b", "--budget", "4GiB", "--tiers", "1,256"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "router:expert groups" in out and ":" in out.splitlines()[-1]
