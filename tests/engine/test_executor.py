"""The executor runs any placement it is given, on the simulated accelerator, with the same results.

Placements here are random (not planned), so every mix of resident / streamed / cpu sub-layers, slot
counts and mid-generation changes is exercised; the planner's choices are tested elsewhere.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import engine
from engine.sharding.plan import Placement, Plan, PlanSet
from tests.engine.tiny_plans import all_cpu_planset, force_planset, plain_on_gpu

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
# "sim" in CI; the GPU machine runs the same tests with SLIPSTREAM_TEST_DEVICE=cuda.
DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")
TOL = 1e-5 if DEVICE == "sim" else 1e-3


def random_planset(eng, rng: random.Random, n_slots: int) -> PlanSet:
    names = [s.name for s in eng.spec.sublayers]
    placement = {n: rng.choice(list(Placement)) for n in names}
    return PlanSet(eng.budget, [Plan(t, "manual", dict(placement), n_slots) for t in eng.tiers])



@pytest.fixture(autouse=True)
def no_planner(monkeypatch):
    """Open every engine here on an all-CPU plan; each test then forces its own placements."""
    from engine.backends.torch_engine import TorchEngine

    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu_planset)


@pytest.fixture(scope="module")
def reference_logits(tiny_model):
    out = {}
    for arch in ARCHS:
        cpu = engine.open_model(tiny_model(arch), device="cpu", backend="torch")
        out[arch] = cpu.score(list(range(5, 70)))
        cpu.close()
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_placements_match_cpu(tiny_model, reference_logits, arch, seed):
    eng = engine.open_model(tiny_model(arch), device=DEVICE, backend="torch",
                            **plain_on_gpu(DEVICE), vram_budget="1GiB")
    rng = random.Random(seed)
    force_planset(eng, random_planset(eng, rng, n_slots=1 + seed % 3))
    got = eng.score(list(range(5, 70)))
    ref = reference_logits[arch]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < TOL
    assert eng.accel.total_used <= eng.budget
    eng.close()
    assert eng.accel.total_used == 0


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_placement_changes_mid_generation_keep_tokens(tiny_model, arch):
    path = tiny_model(arch)
    cpu = engine.open_model(path, device="cpu", backend="torch")
    want = [e.token_id for e in cpu.generate("the quick brown fox", max_new_tokens=24)]
    eng = engine.open_model(path, device=DEVICE, backend="torch", **plain_on_gpu(DEVICE), vram_budget="1GiB")
    rng = random.Random(7)
    force_planset(eng, random_planset(eng, rng, 2))
    got = []
    for i, ev in enumerate(eng.generate("the quick brown fox", max_new_tokens=24)):
        got.append(ev.token_id)
        if i % 5 == 2:
            force_planset(eng, random_planset(eng, rng, 1 + i % 3))
    assert got == want
    assert eng.accel.total_used <= eng.budget


def test_streamed_weights_cross_the_copy_engine(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device=DEVICE, backend="torch",
                            **plain_on_gpu(DEVICE), vram_budget="1GiB")
    names = [s.name for s in eng.spec.sublayers]
    plan = {n: Placement.STREAMED for n in names}
    force_planset(eng, PlanSet(eng.budget, [Plan(t, "manual", dict(plan), 2) for t in eng.tiers]))
    before = eng.executor.copied_bytes
    eng.score([1, 2, 3])
    assert eng.executor.copied_bytes - before >= sum(eng.executor.store.nbytes(n) for n in names) - \
        2 * max(eng.executor.store.nbytes(n) for n in names)
    assert eng.accel.used["slots"] == 2 * max(eng.executor.store.nbytes(n) for n in names)
    assert eng.accel.used["weights"] == 0


def test_kv_follows_attention(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device=DEVICE, backend="torch",
                            **plain_on_gpu(DEVICE), vram_budget="1GiB")
    names = [s.name for s in eng.spec.sublayers]
    gpu_attn = {n: (Placement.RESIDENT if n.endswith(".attn") else Placement.CPU) for n in names}
    force_planset(eng, PlanSet(eng.budget, [Plan(t, "manual", dict(gpu_attn), 2) for t in eng.tiers]))
    eng.score(list(range(40)))
    assert all(p.on_gpu for p in eng.executor.kv.pools)
    assert eng.accel.used["kv"] == eng.executor.kv.gpu_bytes() > 0
    cpu_all = {n: Placement.CPU for n in names}
    force_planset(eng, PlanSet(eng.budget, [Plan(t, "manual", dict(cpu_all), 2) for t in eng.tiers]))
    assert not any(p.on_gpu for p in eng.executor.kv.pools)
    assert eng.accel.total_used == 0
    with torch.no_grad():
        assert eng.score(list(range(40))).shape == (40, eng.config.vocab_size)


def host_kv_planset(eng, rng: random.Random, n_slots: int) -> PlanSet:
    """Random placements where the first kv_layers layers keep their KV in VRAM (attention on the GPU)
    and later layers' attention runs on the CPU or streams to the GPU over their host-resident KV."""
    names = [s.name for s in eng.spec.sublayers]
    n_layers = eng.spec.config.num_layers
    plans = []
    kv_layers = rng.randrange(n_layers)            # at least one layer's KV stays in host memory
    for t in eng.tiers:
        placement = {n: rng.choice(list(Placement)) for n in names}
        for i in range(n_layers):
            if i < kv_layers and placement[f"layers.{i}.attn"] is Placement.CPU:
                placement[f"layers.{i}.attn"] = Placement.STREAMED
            if i >= kv_layers:                      # some of the host-KV layers attend on the GPU
                placement[f"layers.{i}.attn"] = rng.choice([Placement.CPU, Placement.STREAMED])
        plans.append(Plan(t, "manual", placement, n_slots, kv_layers=kv_layers))
    return PlanSet(eng.budget, plans)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_over_host_kv_matches_cpu(tiny_model, reference_logits, arch, seed):
    """A GPU attention whose layer's KV cache stays in host memory computes what the CPU does, every
    tier may place those attentions differently, and the host-resident pools never count as VRAM."""
    eng = engine.open_model(tiny_model(arch), device=DEVICE, backend="torch",
                            **plain_on_gpu(DEVICE), vram_budget="1GiB")
    rng = random.Random(100 + seed)
    ps = host_kv_planset(eng, rng, n_slots=1 + seed % 3)
    force_planset(eng, ps)
    got = eng.score(list(range(5, 70)))
    ref = reference_logits[arch]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < TOL
    kv_layers = ps.plans[0].kv_layers
    assert [p.on_gpu for p in eng.executor.kv.pools] == [i < kv_layers for i in range(eng.spec.config.num_layers)]
    assert eng.accel.total_used <= eng.budget
    eng.close()
    assert eng.accel.total_used == 0


def test_generation_over_host_kv_keeps_tokens(tiny_model):
    path = tiny_model("llama3")
    cpu = engine.open_model(path, device="cpu", backend="torch")
    want = [e.token_id for e in cpu.generate("the quick brown fox", max_new_tokens=24)]
    eng = engine.open_model(path, device=DEVICE, backend="torch", **plain_on_gpu(DEVICE), vram_budget="1GiB")
    force_planset(eng, host_kv_planset(eng, random.Random(5), 2))
    got = [e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=24)]
    assert got == want
    eng.close()


def test_host_kv_attention_over_blocks_out_of_order_gives_the_tokens_of_each_alone(tiny_model, monkeypatch):
    """Attention streamed over the host-resident pool reads a sequence's cached positions through its
    block table: where two sequences grew side by side their blocks interleave, and the read gathers them
    (into pinned memory beside a GPU, so the copy does not wait for the GPU's queue). Each gives the
    tokens it gives alone."""
    path = tiny_model("llama3")
    eng = engine.open_model(path, device=DEVICE, backend="torch", **plain_on_gpu(DEVICE), vram_budget="1GiB")
    names = [s.name for s in eng.spec.sublayers]
    gpu_attn = {n: (Placement.STREAMED if n.endswith(".attn") else Placement.CPU) for n in names}
    force_planset(eng, PlanSet(eng.budget, [Plan(t, "manual", dict(gpu_attn), 2, kv_layers=0) for t in eng.tiers],
                               step_tokens=16))       # (prompts in steps of 16 tokens: one block each)
    prompts = ["the quick brown fox jumps over the lazy dog " * 3, "a lazy dog sleeps all day long in the sun " * 3]
    alone = [[e.token_id for e in eng.generate(p, max_new_tokens=12) if e.token_id is not None] for p in prompts]
    kv = eng.executor.kv
    gathered = []

    def out_of_order(seq, length):
        blocks = seq.block_table[:-(-length // 16)]
        return blocks != list(range(blocks[0], blocks[0] + len(blocks)))

    # (a host pool is read by one of three paths, by where the tensors are and what the CPU has: a gathered
    # copy, the native kernel through a block table, or a padded batch's rows)
    real_parts, real_table, real_padded = kv._block_parts, kv.decode_table, kv._padded_rows

    def spy_parts(pool, seq, length, pin=False):
        gathered.append(out_of_order(seq, length))
        return real_parts(pool, seq, length, pin)

    def spy_table(seq, length):
        gathered.append(out_of_order(seq, length))
        return real_table(seq, length)

    def spy_padded(seqs, *args, **kwargs):
        gathered.extend(out_of_order(seq, length) for seq, length in seqs)
        return real_padded(seqs, *args, **kwargs)

    monkeypatch.setattr(kv, "_block_parts", spy_parts)
    monkeypatch.setattr(kv, "decode_table", spy_table)
    monkeypatch.setattr(kv, "_padded_rows", spy_padded)
    handles = [eng.submit(p, max_new_tokens=12) for p in prompts]
    together = [[e.token_id for e in h if e.token_id is not None] for h in handles]
    assert any(gathered)
    assert together == alone
    eng.close()


def test_fp8_cache_over_host_kv_matches_cpu(tiny_model):
    """With an FP8 KV cache, attention streamed over the host-resident pool sees this step's keys and
    values rounded as the pool stores them, as the CPU's attention (which reads them back) does: the
    same scores, and the same tokens over chunked prompts and decode (cached positions copied in)."""
    path = tiny_model("llama3")
    cpu = engine.open_model(path, device="cpu", backend="torch", kv_dtype="fp8")
    ids = list(range(5, 70))
    want_scores = cpu.score(ids)
    want = [e.token_id for e in cpu.generate("the quick brown fox", max_new_tokens=24)]
    eng = engine.open_model(path, device=DEVICE, backend="torch",
                            **plain_on_gpu(DEVICE), vram_budget="1GiB", kv_dtype="fp8")
    names = [s.name for s in eng.spec.sublayers]
    gpu_attn = {n: (Placement.STREAMED if n.endswith(".attn") else Placement.CPU) for n in names}
    force_planset(eng, PlanSet(eng.budget, [Plan(t, "manual", dict(gpu_attn), 2, kv_layers=0) for t in eng.tiers]))
    got_scores = eng.score(ids)
    assert not any(p.on_gpu for p in eng.executor.kv.pools)
    assert ((got_scores - want_scores).abs().max() / want_scores.abs().max()).item() < TOL
    assert [e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=24)] == want
    eng.close()


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_tiers_streaming_through_their_own_slot_counts_keep_the_tokens(tiny_model, monkeypatch, arch):
    """The decode tier streams through one slot and the prompts' tiers through two, with another FFN
    resident in the decode tier (as the planner's one-slot decode plans do): each switch between them
    re-makes the slots, and the tokens are the CPU's (on "sim"; on CUDA, where a sub-layer's move between
    the CPU and the GPU rounds bf16 its own way, those of the same plans with two slots everywhere)."""
    path = tiny_model(arch)
    prompts = ["the quick brown fox jumps over the lazy dog " * 4, "a lazy dog sleeps all day long " * 5]

    def run(one_slot: bool):
        eng = engine.open_model(path, device=DEVICE, backend="torch", vram_budget="1GiB", speculative=False)
        names = [s.name for s in eng.spec.sublayers]
        kinds = {s.name: s.kind for s in eng.spec.sublayers}

        def plan(tier: int) -> Plan:
            place = {n: (Placement.STREAMED if kinds[n] in ("ffn", "experts") else
                         Placement.RESIDENT if kinds[n] in ("attn", "head") else Placement.CPU) for n in names}
            if tier == 1:
                place["layers.0.ffn"] = Placement.RESIDENT
            return Plan(tier, "manual", place, 1 if tier == 1 and one_slot else 2)
        force_planset(eng, PlanSet(eng.budget, [plan(t) for t in eng.tiers], step_tokens=eng.tiers[-1]))
        seen = []
        activate = eng.executor.activate

        def record(p, kv_blocks=None):
            activate(p, kv_blocks)
            seen.append((p.tier, len(eng.executor.store.slots)))
            assert eng.accel.total_used <= eng.budget
        monkeypatch.setattr(eng.executor, "activate", record)
        got = [[e.token_id for e in eng.generate(p, max_new_tokens=10)] for p in prompts]
        eng.close()
        assert eng.accel.total_used == 0
        return got, seen

    got, seen = run(True)
    assert (1, 1) in seen and any(tier > 1 and n == 2 for tier, n in seen), seen
    if DEVICE == "sim":
        cpu = engine.open_model(path, device="cpu", backend="torch", speculative=False)
        assert got == [[e.token_id for e in cpu.generate(p, max_new_tokens=10)] for p in prompts]
    else:
        assert got == run(False)[0]
