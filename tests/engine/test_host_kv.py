"""The host-RAM KV tier: blocks leaving VRAM are kept in host memory and come back by copy, bit for bit.

Unit tests drive `PagedKVCache` directly (offload/restore, the cap and its LRU order, fp8 parts, layers
whose pool is in host memory); engine tests switch back to a conversation whose blocks were moved out of
VRAM (by a capacity cut or a budget drop) and check the logits are exactly those computed from the same
blocks still in VRAM, and the greedy tokens those of an engine that recomputes everything.
"""

from __future__ import annotations

import pytest
import torch

import engine
from engine.config import ModelConfig
from engine.errors import BadInputError
from engine.sharding.device import Accelerator
from engine.sharding.kvcache import BLOCK_SIZE, PagedKVCache, Sequence, block_hashes
from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def make_cache(fp8=False, host_blocks=64, gpu_layers=(0, 1, 2), accel=True) -> PagedKVCache:
    acc = None
    if accel:
        acc = Accelerator("sim")
        acc.budget = 1 << 30
    kv = PagedKVCache(CFG, torch.float32, acc, fp8=fp8, host_bytes=0)
    kv.set_host_capacity(host_blocks * kv.host.slot_bytes)
    kv._grow(8)
    for layer in gpu_layers if accel else ():
        kv.place_layer(layer, True)
    return kv


def fill(kv: PagedKVCache, seq: Sequence, ids: list[int], seed: int) -> None:
    """Append `ids` to `seq` with random keys and values in every layer (as a forward step would)."""
    g = torch.Generator().manual_seed(seed)
    kv.reserve(seq, len(ids))
    for layer in range(CFG.num_layers):
        k, v = (torch.randn(CFG.num_kv_heads, len(ids), CFG.head_dim, generator=g) for _ in range(2))
        with torch.inference_mode():
            kv.write(layer, seq, seq.length, k, v)
    seq.length += len(ids)
    seq.token_ids.extend(ids)


def contents(kv: PagedKVCache, seq: Sequence) -> list[torch.Tensor]:
    return [t.clone() for layer in range(CFG.num_layers) for t in kv.read(layer, seq, seq.length)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-like", "fp8"])
@pytest.mark.parametrize("gpu_layers", [(0, 1, 2), (1,), ()], ids=["all-gpu", "mixed", "all-host"])
def test_offload_restore_is_bit_identical(fp8, gpu_layers):
    kv = make_cache(fp8=fp8, gpu_layers=gpu_layers)
    seq, seq_ids = Sequence(), list(range(3 * BLOCK_SIZE + 5))
    fill(kv, seq, seq_ids, seed=1)                              # three full blocks and a partial one
    want = contents(kv, seq)
    assert kv.offload(seq)
    assert seq.offloaded and not seq.block_table and not kv.refs
    assert len(kv.free_blocks) == kv.n_blocks                   # every pool block is free again
    assert kv.host_report()["host_kv_bytes"] == 4 * kv.host.slot_bytes
    other = Sequence()                                          # reuses (overwrites) the freed blocks
    fill(kv, other, [60] * (kv.n_blocks * BLOCK_SIZE), seed=2)
    kv.release(other)
    kv.restore(seq)
    assert not seq.offloaded and len(seq.block_table) == 4 and seq.length == 3 * BLOCK_SIZE + 5
    assert same(contents(kv, seq), want)
    assert kv.host_report()["host_kv_restores"] >= 4 - 3        # cached full blocks may be taken as they are
    # The sequence goes on growing after its restore; the full blocks' host copies stay cached.
    fill(kv, seq, [1, 2, 3], seed=3)
    assert seq.length == 3 * BLOCK_SIZE + 8
    kv.release(seq)
    assert set(kv.host_hash) == set(kv.host_lru) and not kv.host_refs
    assert set(block_hashes(seq_ids)) <= set(kv.host_block_of)


def test_reserve_restores_an_offloaded_sequence_and_release_frees_its_slots():
    kv = make_cache()
    seq = Sequence(cacheable=False)                             # no hashes: every slot is private
    fill(kv, seq, list(range(2 * BLOCK_SIZE)), seed=4)
    want = contents(kv, seq)
    assert kv.offload(seq) and len(kv.host_hash) == 2 and not kv.host_lru
    fill(kv, seq, [9], seed=5)                                  # the next step brings it back first
    assert not seq.offloaded and same([t[:, :2 * BLOCK_SIZE] for t in contents(kv, seq)], want)
    assert kv.offload(seq)
    kv.release(seq)                                             # never restored: its slots are freed
    assert not kv.host_hash and not seq.offloaded and kv.host.room() == kv.host.cap_slots


def test_match_prefix_finds_blocks_in_the_host_tier():
    kv = make_cache()
    ids = list(range(4 * BLOCK_SIZE))
    a = Sequence()
    fill(kv, a, ids, seed=6)
    want = contents(kv, a)
    kv.release(a)                               # four cached blocks in the pools
    kv.shrink(0)                                # a capacity cut: all of them go to the host tier
    assert kv.n_blocks == 0 and len(kv.host_block_of) == 4 and not kv.block_of
    b = Sequence()
    assert kv.match_prefix(b, ids + [7]) == 4 * BLOCK_SIZE
    assert kv.host_report()["host_kv_hits"] == 4 and kv.host_report()["host_kv_restores"] == 4
    assert same(contents(kv, b), want)
    kv.release(b)
    # Part in the pools, part on the host: the chain is followed across both tiers.
    c = Sequence()
    kv.match_prefix(c, ids[:2 * BLOCK_SIZE] + [1])
    kv.release(c)
    assert kv.match_prefix(Sequence(), ids + [7]) == 4 * BLOCK_SIZE


def test_the_cap_is_kept_and_the_least_recently_used_go_first():
    kv = make_cache(host_blocks=3)
    prompts = [[p] * (2 * BLOCK_SIZE) for p in range(4)]        # 4 prompts of 2 full blocks each
    name = {h: f"p{p}.{i}" for p, ids in enumerate(prompts) for i, h in enumerate(block_hashes(ids))}
    name[block_hashes([50] * BLOCK_SIZE)[0]] = "f.0"

    def lru():
        return [name[kv.host_hash[s]] for s in kv.host_lru]

    for p, ids in enumerate(prompts):
        seq = Sequence()
        fill(kv, seq, ids, seed=10 + p)
        kv.release(seq)          # a released sequence's blocks are cached tail first, so heads last longer
    kv.shrink(0)                 # spills the 8 cached blocks, oldest first, through a 3-slot tier
    assert lru() == ["p2.0", "p3.1", "p3.0"]
    assert kv.host.allocated_bytes <= kv.host.cap_bytes and kv.host_report()["host_kv_dropped"] == 5
    # Hits make slots the most recently used; the next spill drops the least recently used one.
    for ids, hit in ((prompts[3], 2), (prompts[2], 1)):
        seq = Sequence()
        assert kv.match_prefix(seq, ids + [0]) == hit * BLOCK_SIZE
        kv.release(seq)
    assert lru() == ["p3.0", "p3.1", "p2.0"]
    kv.shrink(0)                 # the pools' copies were cached tail first: the tier's LRU follows
    assert lru() == ["p3.1", "p3.0", "p2.0"]
    fresh = Sequence()
    fill(kv, fresh, [50] * BLOCK_SIZE, seed=20)
    kv.release(fresh)
    kv.shrink(0)
    assert lru() == ["p3.0", "p2.0", "f.0"]
    assert len(kv.host_hash) == 3 and kv.host.allocated_bytes <= kv.host.cap_bytes


def test_a_spilled_sequence_goes_out_in_one_run_per_layer_and_comes_back(monkeypatch):
    """A released sequence's blocks are cached tail first; spilled together they still take consecutive
    slots in block order, so each layer copies them as one run, and a later prompt finds them intact."""
    from engine.sharding import kvcache

    kv = make_cache(host_blocks=64)
    ids = list(range(6 * BLOCK_SIZE))
    seq = Sequence()
    fill(kv, seq, ids, seed=3)
    want = contents(kv, seq)
    kv.release(seq)
    runs = []
    real = kvcache._runs
    monkeypatch.setattr(kvcache, "_runs", lambda pairs, chunk: runs.append(real(pairs, chunk)) or runs[-1])
    kv.shrink(0)
    assert [len(r) for r in runs] == [1] and runs[0][0][2] == 6
    again = Sequence()
    assert kv.match_prefix(again, ids + [0]) == len(ids)
    assert same(contents(kv, again), want)


def test_a_spill_pins_the_next_spills_room_on_a_thread(monkeypatch):
    """After a spill from pinned pools the tier allocates as many free slots again on a thread (within
    its cap), while slots taken meanwhile stay distinct."""
    from engine.sharding import kvcache

    slot_bytes = make_cache(host_blocks=1).host.slot_bytes
    monkeypatch.setattr(kvcache, "HOST_CHUNK_BYTES", 4 * slot_bytes)      # chunks of 4 slots
    kv = make_cache(host_blocks=40)
    kv._pinned = True                      # (as beside a GPU; the sim tier's chunks are not pinned)
    ids = list(range(6 * BLOCK_SIZE))
    seq = Sequence()
    fill(kv, seq, ids, seed=4)
    kv.release(seq)
    kv.shrink(0)
    kv.host.wait_grown()
    assert len(kv.host.free) >= 6 and kv.host.allocated_slots <= kv.host.cap_slots
    tier = kv.host
    tier.grow_ahead(tier.cap_slots)        # grows to the cap while this thread takes slots
    taken = [tier.take() for _ in range(20)]
    tier.wait_grown()
    assert None not in taken and len(set(taken)) == 20
    assert tier.allocated_slots == tier.cap_slots and len(tier.free) == tier.cap_slots - len(kv.host_lru) - 20
    assert tier.allocated_bytes <= tier.cap_bytes


def test_a_spill_beside_a_gpu_takes_only_pinned_room_and_pins_more_on_a_thread(monkeypatch):
    """Pinning is slow and a spill runs in front of a prompt's first token: beside a GPU a spill takes
    only slots allocated already, drops the cached blocks that do not fit, and the tier pins room on its
    thread, so the next spill keeps its blocks (they come back bit for bit)."""
    import threading

    kv = make_cache(host_blocks=40)
    kv._pinned = True                      # (as beside a GPU; the sim tier's chunks are not pinned)
    threads = []
    add = kv.host._add_chunk
    monkeypatch.setattr(kv.host, "_add_chunk",
                        lambda **kw: (threads.append(threading.current_thread().name), add(**kw))[1])
    first = list(range(6 * BLOCK_SIZE))
    seq = Sequence()
    fill(kv, seq, first, seed=5)
    kv.release(seq)
    kv.shrink(0)                           # spills 6 cached blocks into a tier with nothing pinned
    assert kv.host_stats["dropped_blocks"] == 6 and not kv.host_lru
    kv.host.wait_grown()
    assert threads and set(threads) == {"slipstream-host-kv-pin"}
    assert len(kv.host.free) >= 6
    second = [i + 1 for i in first]
    seq = Sequence()
    fill(kv, seq, second, seed=6)
    want = contents(kv, seq)
    kv.release(seq)
    kv.shrink(0)
    kv.host.wait_grown()
    assert kv.host_stats["dropped_blocks"] == 6 and len(kv.host_lru) == 6
    assert set(threads) == {"slipstream-host-kv-pin"}
    again = Sequence()
    assert kv.match_prefix(again, second + [0]) == len(second)
    assert same(contents(kv, again), want)


def test_the_tier_pins_only_while_no_sequence_runs():
    """Pinning holds the process's memory map (other threads' page faults wait): room wanted while a
    sequence runs is pinned once the last one is released."""
    kv = make_cache(host_blocks=40)
    kv._pinned = True
    seq = Sequence()
    fill(kv, seq, list(range(2 * BLOCK_SIZE)), seed=7)
    kv.host.grow_ahead(8)
    kv.host.wait_grown()
    assert kv.host.allocated_slots == 0
    other = Sequence()
    fill(kv, other, list(range(100, 100 + BLOCK_SIZE)), seed=8)
    kv.release(seq)                        # one still runs
    kv.host.wait_grown()
    assert kv.host.allocated_slots == 0
    kv.release(other)
    kv.host.wait_grown()
    assert len(kv.host.free) >= 8


def test_offload_refuses_when_the_tier_is_full_of_held_blocks():
    kv = make_cache(host_blocks=2)
    a, b = Sequence(cacheable=False), Sequence(cacheable=False)
    fill(kv, a, list(range(2 * BLOCK_SIZE)), seed=30)
    fill(kv, b, list(range(BLOCK_SIZE)), seed=31)
    assert kv.offload(a)
    want = contents(kv, b)
    assert not kv.offload(b)                                    # nothing changes
    assert not b.offloaded and same(contents(kv, b), want)
    kv.restore(a)
    assert kv.offload(b)


def test_shrink_moves_blocks_in_use_below_the_cut():
    kv = make_cache()
    filler, seq = Sequence(), Sequence()
    fill(kv, filler, [1] * (5 * BLOCK_SIZE), seed=40)
    fill(kv, seq, list(range(2 * BLOCK_SIZE + 3)), seed=41)     # blocks 5, 6, 7
    want = contents(kv, seq)
    kv.release(filler)
    kv.shrink(3)
    assert kv.n_blocks == 3 and sorted(seq.block_table) == [0, 1, 2]
    assert same(contents(kv, seq), want)
    assert all(p.capacity == 3 for p in kv.pools)


def test_a_cut_keeps_the_host_pools_room_and_a_regrowth_reuses_it():
    """A capacity cut gives the GPU pools' VRAM back but leaves host pools their room, so growing again
    re-makes only the GPU pools; the blocks written before the cut, the cut and the regrowth read back the
    same, and so does a layer moved to the GPU and back (at the cache's capacity, not the host pool's)."""
    kv = make_cache(gpu_layers=(0,))
    filler, seq = Sequence(), Sequence()
    fill(kv, filler, [1] * (5 * BLOCK_SIZE), seed=42)
    fill(kv, seq, list(range(2 * BLOCK_SIZE + 3)), seed=43)
    want = contents(kv, seq)
    kv.release(filler)
    host_ptrs = [p.k.data_ptr() for p in kv.pools[1:]]
    kv.shrink(3)
    assert kv.n_blocks == 3 and kv.pools[0].capacity == 3
    assert all(p.capacity == 8 for p in kv.pools[1:]) and [p.k.data_ptr() for p in kv.pools[1:]] == host_ptrs
    assert same(contents(kv, seq), want)
    kv._grow(6)                                           # within the host pools' room: none re-made
    assert [p.k.data_ptr() for p in kv.pools[1:]] == host_ptrs and kv.pools[0].capacity == 6
    other = Sequence()
    fill(kv, other, list(range(3 * BLOCK_SIZE)), seed=44)     # new blocks past the cut, in every layer
    want_other = contents(kv, other)
    kv.place_layer(1, True)
    assert kv.pools[1].capacity == 6 and kv.gpu_bytes() == 2 * 6 * kv.pools[0].block_bytes()
    kv.place_layer(1, False)
    assert same(contents(kv, seq), want) and same(contents(kv, other), want_other)
    kv._grow(12)                                          # past them: re-made, contents kept
    assert all(p.capacity == 12 for p in kv.pools)
    assert same(contents(kv, seq), want) and same(contents(kv, other), want_other)


def test_host_tier_without_an_accelerator():
    kv = make_cache(accel=False)
    seq = Sequence()
    fill(kv, seq, list(range(BLOCK_SIZE + 1)), seed=50)
    want = contents(kv, seq)
    assert kv.offload(seq)
    kv.restore(seq)
    assert same(contents(kv, seq), want)


# ---- the engine ---------------------------------------------------------------------------------
CONVO_A = "tell me about the blue river and the old mill by the hill " * 2
LONG_A = CONVO_A * 2
CONVO_B = "a completely different story about seven red foxes in winter " * 2


def prefix_logits(eng, ids: list[int]) -> tuple[int, torch.Tensor]:
    """Logits of the tokens of `ids` past its cached prefix, computed as a chat turn is."""
    kv = eng.executor.kv
    seq = Sequence()
    with torch.inference_mode(), eng._lock:
        eng._ensure_kv_capacity(len(ids))
        common = kv.match_prefix(seq, ids)
        try:
            return common, eng._run(seq, ids[common:], True)
        finally:
            kv.release(seq)


def greedy(eng, prompt, n=10) -> list[int]:
    return [e.token_id for e in eng.generate(prompt, max_new_tokens=n)]


def open_gpu_side(path, kind, **kw):
    eng = engine.open_model(path, device="sim", backend="torch", tiers=TIERS, profile=slow_cpu_profile(),
                            speculative=False, **kw)
    eng.set_vram_budget(third_of_weights(eng) * 2)
    eng.force_plan(kind)
    attn = [p for t in eng.plan_report()["tiers"] for n, p in t["placement"].items() if n.endswith(".attn")]
    assert any(p != "cpu" for p in attn), kind
    return eng


@pytest.mark.parametrize("setup", ["cpu", "sim-gpu_only", "sim-static", "sim-dynamic", "sim-fp8"])
def test_switching_back_restores_from_host_with_identical_logits(tiny_model, setup):
    path = tiny_model("qwen3")
    if setup == "cpu":
        eng = engine.open_model(path, device="cpu", backend="torch", speculative=False)
    else:
        kind = "gpu_only" if setup == "sim-fp8" else setup.split("-")[1]
        eng = open_gpu_side(path, kind, kv_dtype="fp8" if setup == "sim-fp8" else None)
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False,
                            kv_dtype="fp8" if setup == "sim-fp8" else None, host_kv_gib=0)
    ids_a = eng.encode_prompt(CONVO_A)
    ids_b = eng.encode_prompt(CONVO_B)
    turn = ids_a + ids_b[:5]
    want = greedy(ref, CONVO_A)
    assert greedy(eng, CONVO_A) == want                         # conversation A's blocks are cached
    common, in_vram = prefix_logits(eng, turn)                  # its next turn, from blocks in VRAM
    assert common >= BLOCK_SIZE
    greedy(eng, CONVO_B)
    kv = eng.executor.kv
    kv.shrink(0)                                                # everything unused leaves the pools
    assert kv.n_blocks == 0 and eng.stats()["host_kv_blocks"] > 0
    hits = eng.stats()["host_kv_hits"]
    again, from_host = prefix_logits(eng, turn)                 # back to A: copied, not recomputed
    assert again == common and eng.stats()["host_kv_hits"] - hits == common // BLOCK_SIZE
    assert torch.equal(in_vram, from_host)
    kv.shrink(0)
    assert greedy(eng, CONVO_A) == want
    assert eng.stats()["host_kv_restores"] > 0
    eng.close()


def test_budget_drop_moves_cached_blocks_to_host_and_they_come_back(tiny_model):
    path = tiny_model("llama")
    eng = open_gpu_side(path, "gpu_only")
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False, host_kv_gib=0)
    high = eng.budget
    want = greedy(ref, LONG_A, n=20)
    assert greedy(eng, LONG_A, n=20) == want
    ids = eng.encode_prompt(LONG_A)
    _, in_vram = prefix_logits(eng, ids)
    kv_before = eng.accel.used["kv"]
    blocks_before = eng.executor.kv.n_blocks
    cached = [h for h in block_hashes(ids) if h in eng.executor.kv.block_of]
    eng.set_vram_budget(high * 3 // 4)                          # the game starts: the idle chat's KV moves out
    st = eng.stats()
    assert eng.executor.kv.n_blocks < blocks_before and eng.accel.used["kv"] < kv_before
    kv = eng.executor.kv
    assert all((h in kv.block_of) != (h in kv.host_block_of) for h in cached)  # in the pools or on the host
    assert st["host_kv_blocks"] >= len(cached) - kv.n_blocks and st["host_kv_bytes"] > 0
    _, from_host = prefix_logits(eng, ids)
    assert torch.equal(in_vram, from_host)
    assert eng.stats()["host_kv_hits"] > 0
    assert greedy(eng, LONG_A, n=20) == want
    eng.close()


def test_budget_drop_mid_generation_moves_the_running_sequence_below_the_cut(tiny_model):
    path = tiny_model("llama")
    eng = open_gpu_side(path, "gpu_only")
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False, host_kv_gib=0)
    want_a, want_b = greedy(ref, LONG_A, n=4), greedy(ref, "x y z", n=30)
    assert greedy(eng, LONG_A, n=4) == want_a       # A's blocks take the low ids, cached
    kv, high = eng.executor.kv, eng.budget
    blocks_before = kv.n_blocks
    got, cut_to = [], None
    for i, ev in enumerate(eng.generate("x y z", max_new_tokens=30)):
        got.append(ev.token_id)
        if i == 3:
            assert min(kv.refs) >= 4                # the running sequence sits above the coming cut
            eng.set_vram_budget(high * 3 // 4)      # this thread holds the (reentrant) lock: applied now
            cut_to = kv.n_blocks
            assert max(kv.refs) < cut_to
        if i == 17:
            eng.set_vram_budget(high)
    assert cut_to < blocks_before and got == want_b
    assert eng.stats()["host_kv_blocks"] > 0
    assert greedy(eng, LONG_A, n=4) == want_a and eng.stats()["host_kv_hits"] > 0


def test_host_kv_option(tiny_model):
    path = tiny_model("llama")
    eng = engine.open_model(path, device="sim", backend="torch", host_kv_gib=0.5)
    assert eng.stats()["host_kv_cap_bytes"] == 1 << 29
    assert eng.stats()["host_kv_bytes"] == 0
    eng.close()
    with pytest.raises(BadInputError, match="host_kv_gib"):
        engine.open_model(path, device="sim", backend="torch", host_kv_gib=-1)


def test_budget_drop_does_not_wait_for_new_plan_tables(tiny_model, monkeypatch):
    """A drop that cuts the KV capacity to one never priced plans at once from the nearest larger priced
    capacity (whose plans book more KV, so they fit) and prices the exact one on another thread, then
    re-plans: the caller's thread never builds a member table for the cut capacity."""
    import threading
    import time

    from engine.sharding.planner import Planner

    built: list[tuple[int, str]] = []
    real = Planner._table

    def spy(self, kv_tokens, pause=None):
        if kv_tokens not in self._tables:
            built.append((kv_tokens, threading.current_thread().name))
        return real(self, kv_tokens, pause)

    monkeypatch.setattr(Planner, "_table", spy)
    gate = threading.Event()                        # the refining thread prices once the test has looked
    real_warm = Planner.warm

    def gated_warm(self, kv_tokens, pause=None):
        gate.wait(60)
        real_warm(self, kv_tokens, pause)

    monkeypatch.setattr(Planner, "warm", gated_warm)
    path = tiny_model("llama")
    eng = open_gpu_side(path, "auto")
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False, host_kv_gib=0)
    want = greedy(ref, LONG_A, n=12)
    assert greedy(eng, LONG_A, n=12) == want
    high, before = eng.budget, eng.kv_tokens
    planner = eng.planner()                         # as after open: only the capacity in use is priced
    real_warm(planner, before)
    planner._tables = {k: v for k, v in planner._tables.items() if k == before}
    planner._fronts = {k: v for k, v in planner._fronts.items() if k[0] == before}
    built.clear()
    eng.set_vram_budget(high * 3 // 4)
    cut = eng.kv_tokens
    assert cut < before and cut & (cut - 1) == 0
    assert (cut, threading.current_thread().name) not in built
    planned = {p.kv_tokens for p in eng.planset.plans}
    assert planned == {before}                      # planned with the priced, larger capacity
    assert eng.accel.total_used <= eng.accel.usable(eng.budget)
    gate.set()
    deadline = time.monotonic() + 60
    while {p.kv_tokens for p in eng.planset.plans} != {cut} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {p.kv_tokens for p in eng.planset.plans} == {cut}
    assert (cut, "slipstream-plan-refine") in built
    assert eng.replans[-1]["reason"] == f"plans for {cut} KV tokens priced"
    planner.warm(eng.max_kv_tokens)                 # growing: only a larger capacity is priced
    planner._tables.pop(before)
    planner._fronts = {k: v for k, v in planner._fronts.items() if k[0] != before}
    built.clear()
    assert greedy(eng, LONG_A, n=12) == want        # the conversation grows the capacity past the cut
    grown = eng.kv_tokens
    assert cut < grown < eng.max_kv_tokens
    assert (grown, threading.current_thread().name) not in built
    eng.close()


def test_budget_drops_land_on_power_of_two_kv_capacities():
    """Drops with different numbers of blocks in use cut the KV capacity to the same power of two, so a
    long game session prices few capacities."""
    from engine.backends.torch_engine import KV_CUT_FLOOR_TOKENS, cut_kv_tokens

    assert [cut_kv_tokens(n) for n in (5, 7, 8)] == [256, 256, 256]
    assert cut_kv_tokens(9) == 512
    assert cut_kv_tokens(0) == KV_CUT_FLOOR_TOKENS == 64


@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit", "fp8"])
def test_rows_no_token_wrote_are_zeros_after_every_growth_and_move(fp8, monkeypatch):
    """A pool's rows are zeros until a token writes them: freshly made, grown and moved between the GPU
    and the host. Padded reads gather such rows under a mask, where leftover bytes read as NaN would
    poison the weighted sum (0 x NaN). The allocator is made to hand out NaN-filled memory here."""
    real_empty = torch.empty

    def dirty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(255)

    monkeypatch.setattr(torch, "empty", dirty)
    kv = make_cache(fp8=fp8)
    seq = Sequence()
    fill(kv, seq, list(range(20)), seed=1)           # 20 of 8 blocks' 128 rows written
    written = contents(kv, seq)
    for step in (lambda: kv._grow(24), lambda: kv.place_layer(1, False), lambda: kv.place_layer(1, True)):
        step()
        for pool in kv.pools:
            for part in pool.parts:
                rows = part.reshape(part.shape[0] * part.shape[1], -1)
                used = set(seq.block_table)
                free = [b for b in range(part.shape[0]) if b not in used]
                assert not rows.isnan().any()
                assert (part[free] == 0).all()
        assert same(contents(kv, seq), written)


def test_a_short_request_after_a_long_prompt_cuts_the_kv_capacity_back(tiny_model):
    """A long prompt grows the KV capacity past INITIAL_KV_TOKENS and its blocks stay cached; the next
    request that needs less than half of it cuts the capacity back (its plan books less KV), with the
    tokens a fresh engine gives; the long prompt's blocks wait in host RAM and serve it again. A growing
    conversation keeps its capacity."""
    from engine.backends.torch_engine import INITIAL_KV_TOKENS

    path = tiny_model("llama", max_position_embeddings=4096)
    eng = open_gpu_side(path, "gpu_only")
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False, host_kv_gib=0)
    long_prompt = " ".join(f"w{i % 97} z{i % 13}" for i in range(400))
    assert len(eng.encode_prompt(long_prompt)) > INITIAL_KV_TOKENS
    want_long = greedy(ref, long_prompt, n=3)
    assert greedy(eng, long_prompt, n=3) == want_long
    grown, kv_grown = eng.kv_tokens, eng.accel.used["kv"]
    assert grown > INITIAL_KV_TOKENS
    # the conversation goes on (the long prompt, extended): no cut
    assert greedy(eng, long_prompt + " and more", n=3) == greedy(ref, long_prompt + " and more", n=3)
    assert eng.kv_tokens == grown
    # a short request: the capacity and the KV booking fall back, the tokens stay a fresh engine's
    replans = len(eng.replans)
    assert greedy(eng, "x y z", n=12) == greedy(ref, "x y z", n=12)
    assert eng.kv_tokens == INITIAL_KV_TOKENS and eng.accel.used["kv"] < kv_grown
    assert len(eng.replans) > replans and "KV capacity cut" in eng.replans[-1]["reason"]
    assert eng.stats()["host_kv_blocks"] > 0
    # the long prompt again: its blocks come back from host RAM, the same tokens
    hits = eng.stats()["host_kv_hits"]
    assert greedy(eng, long_prompt, n=3) == want_long
    assert eng.stats()["host_kv_hits"] > hits
    eng.close()
    ref.close()


def test_a_plan_refinement_finishing_during_a_drop_does_not_bring_the_old_budget_back(tiny_model, monkeypatch):
    """A budget drop cuts the KV capacity and a thread prices that capacity's plans, then queues a re-plan
    for the budget in force. Where that thread finishes while the drop is still being applied, the re-plan
    must run at the dropped budget (it had queued the budget from before the drop, which then came back
    at the next step: the game's memory taken again)."""
    import threading

    path = tiny_model("llama")
    eng = open_gpu_side(path, "gpu_only")
    high = eng.budget
    low = high * 3 // 4
    greedy(eng, LONG_A, n=4)
    posted = threading.Event()
    planner = eng.planner()
    real_has_table, real_activate = planner.has_table, eng.executor.activate

    def refine():                    # (once: the thread finishes at once)
        monkeypatch.setattr(eng, "_refine_in_background", lambda: None)
        monkeypatch.setattr(planner, "has_table", real_has_table)

        def run():
            eng._post_budget(None, "plans priced (a thread finishing early)")
            posted.set()
        threading.Thread(target=run).start()

    def activate(*args, **kw):       # the drop is being applied: the thread's re-plan lands meanwhile
        posted.wait(5)
        return real_activate(*args, **kw)

    monkeypatch.setattr(eng, "_refine_in_background", refine)
    monkeypatch.setattr(eng.executor, "activate", activate)
    monkeypatch.setattr(planner, "has_table", lambda kv_tokens: False)   # (the cut capacity: not priced yet)
    eng.set_vram_budget(low)
    assert posted.is_set() and eng.budget == low
    since = len(eng.replans) - 1
    greedy(eng, "x y z", n=4)
    assert eng.budget == low
    after = eng.replans[since:]
    assert any(r["reason"].startswith("plans priced") for r in after)
    assert all(r["budget"] == low for r in after), after
    eng.close()


def test_a_drop_queued_before_a_request_goes_first_when_its_kv_capacity_changes(tiny_model):
    """A budget drop queued while the engine is busy is applied before a request's KV capacity change
    re-plans: the cut after a long prompt (and a growth) must not re-plan at the old budget first."""
    import threading

    path = tiny_model("llama", max_position_embeddings=4096)
    eng = open_gpu_side(path, "gpu_only")
    long_prompt = " ".join(f"w{i % 97} z{i % 13}" for i in range(400))
    greedy(eng, long_prompt, n=2)                 # the capacity grows past INITIAL_KV_TOKENS
    high = eng.budget
    low = high * 3 // 4
    with eng._lock:                               # busy: another thread's drop is queued, not applied
        t = threading.Thread(target=eng.set_vram_budget, args=(low,))
        t.start()
        t.join()
        assert eng.budget == high and eng._pending_budget == low
        since = len(eng.replans)
        greedy(eng, "x y z", n=4)                 # (this thread holds the reentrant lock)
    after = eng.replans[since:]
    assert after[0]["budget"] == low and after[0]["reason"] == "set_vram_budget", after
    assert all(r["budget"] == low for r in after), after
    eng.close()


def test_a_plan_refinement_prices_only_while_no_step_runs(tiny_model, monkeypatch):
    """The thread pricing a new KV capacity's plans holds the interpreter lock while it works, which slowed
    a decode beside it several times over; it prices a block only where no step runs and none has run for
    REFINE_IDLE_S, and finishes once the engine is idle. A step that runs meanwhile still gives the tokens
    a fresh engine gives."""
    import threading
    import time

    from engine.backends import torch_engine

    monkeypatch.setattr(torch_engine, "REFINE_MAX_WAIT_S", 60.0)
    path = tiny_model("llama")
    eng = open_gpu_side(path, "auto")
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False, host_kv_gib=0)
    want = greedy(ref, LONG_A, n=24)
    assert greedy(eng, LONG_A, n=24) == want
    planner, kv = eng.planner(), eng.kv_tokens
    real_pause = eng._refine_pause
    blocks, busy = [], []

    def pause():                      # each block priced: was a step running, or one just ended?
        real_pause()
        with eng._activity:
            busy.append(eng._steps_running > 0 or time.monotonic() < eng._last_step_end + torch_engine.REFINE_IDLE_S)
        blocks.append(threading.current_thread().name)
        time.sleep(0.02)              # (a block takes a while: the tiny model's would race the steps)

    monkeypatch.setattr(eng, "_refine_pause", pause)
    planner._tables = {k: v for k, v in planner._tables.items() if k != kv}
    planner._fronts = {k: v for k, v in planner._fronts.items() if k[0] != kv}
    eng._refine_in_background()
    assert greedy(eng, LONG_A, n=24) == want            # steps run while the thread waits
    assert not any(busy), busy
    for _ in range(500):
        if planner.has_table(kv) and not eng._refining:
            break
        time.sleep(0.02)
    assert planner.has_table(kv) and blocks and not any(busy)
    assert eng.refines["count"] >= 1
    eng.close()
    ref.close()


def test_a_plan_refinement_still_finishes_beside_steps_that_never_stop(tiny_model, monkeypatch):
    """With steps running all the time, the refinement prices one block per REFINE_MAX_WAIT_S."""
    import threading
    import time

    from engine.backends import torch_engine

    monkeypatch.setattr(torch_engine, "REFINE_MAX_WAIT_S", 0.2)
    eng = open_gpu_side(tiny_model("llama"), "auto")
    eng._step_activity(1)                               # a step that does not end
    done = threading.Event()
    t0 = time.monotonic()
    threading.Thread(target=lambda: (eng._refine_pause(), done.set()), daemon=True).start()
    assert not done.wait(0.1)
    assert done.wait(5) and time.monotonic() - t0 >= 0.2
    eng._step_activity(-1)
    eng.close()


@pytest.mark.parametrize("switch_ms, stays", [(1e9, True), (-1e9, False)], ids=["switch-dear", "switch-free"])
def test_a_one_step_prompt_stays_on_the_decode_plan_where_switching_costs_more(tiny_model, monkeypatch,
                                                                               switch_ms, stays):
    """A prompt of one step after a decode runs on the decode plan in place where its own tier's plan
    saves less than the switch there and back costs (PLAN_SWITCH_MS and the weights moved), and on its
    tier's plan otherwise; the tokens are a fresh engine's either way."""
    from engine.backends import torch_engine

    monkeypatch.setattr(torch_engine, "PLAN_SWITCH_MS", switch_ms)
    path = tiny_model("llama")
    eng = open_gpu_side(path, "auto")
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False, host_kv_gib=0)
    prompt = "q" + " w" * 30                           # one step of more than SMALL_STEP tokens
    n = len(eng.encode_prompt(prompt))
    assert torch_engine.SMALL_STEP < n <= TIERS[-1]
    assert greedy(eng, "x y", n=6) == greedy(ref, "x y", n=6)       # the decode plan is in place
    decode_plan = eng.executor.plan
    assert decode_plan.tier <= torch_engine.SMALL_STEP
    prompt_plan = eng.planset.for_tokens(n)
    assert prompt_plan is not decode_plan
    activated = []
    real = eng.executor.activate
    monkeypatch.setattr(eng.executor, "activate", lambda plan, *a, **k: (activated.append(plan), real(plan, *a, **k)))
    assert greedy(eng, prompt, n=6) == greedy(ref, prompt, n=6)
    assert (prompt_plan not in activated) == stays, [p.tier for p in activated]
    eng.close()
    ref.close()


def test_a_run_of_larger_steps_switches_at_the_second(tiny_model, monkeypatch):
    """Staying on the decode plan is for one larger step (a prompt before its decode): the second larger
    step in a row (a batch of more than SMALL_STEP streams, step after step) takes its tier's plan, whose
    switch pays once for the whole run; a small step in between starts the count again."""
    from engine.backends import torch_engine

    monkeypatch.setattr(torch_engine, "PLAN_SWITCH_MS", 1e9)
    eng = open_gpu_side(tiny_model("llama"), "auto")
    greedy(eng, "x y", n=4)
    decode_plan, n = eng.executor.plan, torch_engine.SMALL_STEP + 8
    big = eng.planset.for_tokens(n)
    assert big is not decode_plan
    assert eng._plan_for_step(n) is decode_plan
    assert eng._plan_for_step(n) is big
    assert eng._plan_for_step(1) is decode_plan            # (the plan in place is still the decode plan)
    assert eng._plan_for_step(n) is decode_plan
    eng.close()


def test_many_copies_in_one_native_call_land_as_pytorch_copies_do():
    """`kernels.copy_many`: pairs of every size (empty, under, at and over its 1 MiB piece), all in one call."""
    from engine import kernels

    g = torch.Generator().manual_seed(5)
    sizes = [0, 1, 4095, 1 << 20, (1 << 20) + 3, 3 * (1 << 20) - 7, 77]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    if not kernels.copy_many(list(zip(dsts, srcs))):
        pytest.skip(f"no native library here: {kernels.status()}")
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert not kernels.copy_many([(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))])


@pytest.mark.parametrize("native", [True, False], ids=["native-copies", "pytorch-copies"])
def test_spill_and_restore_keep_the_bits_with_either_copy_path(native):
    from engine import kernels

    was = kernels.set_enabled(native)
    try:
        kv = make_cache(gpu_layers=(1,))
        seqs = [Sequence() for _ in range(3)]
        for i, seq in enumerate(seqs):
            fill(kv, seq, list(range(i * 100, i * 100 + 2 * BLOCK_SIZE + i)), seed=60 + i)
        want = [contents(kv, s) for s in seqs]
        for seq in seqs[:2]:
            assert kv.offload(seq)
        for seq in seqs[:2]:
            kv.restore(seq)
        assert all(same(contents(kv, s), w) for s, w in zip(seqs, want))
    finally:
        kernels.set_enabled(was)


def test_a_slot_from_room_already_there_never_waits_for_a_chunk_being_pinned(monkeypatch):
    """The grower pins a chunk (slow beside a GPU) while a spill takes slots pinned already: the spill's
    takes return at once, and the chunk joins the tier when its pinning ends."""
    import threading

    kv = make_cache(host_blocks=40)
    tier = kv.host
    assert not tier.chunks
    tier.chunk_slots = 8                   # (chunks of 8 slots: the tiny model's blocks are small)
    tier.prewarm(1)                        # one chunk there
    room = len(tier.free)
    assert 0 < room < tier.cap_slots
    pinning, release = threading.Event(), threading.Event()
    new_buffer = tier._new_buffer

    def slow_buffer(nbytes):
        pinning.set()
        release.wait(30)
        return new_buffer(nbytes)

    monkeypatch.setattr(tier, "_new_buffer", slow_buffer)
    tier.grow_ahead(tier.cap_slots)
    assert pinning.wait(30)
    taken = []
    taker = threading.Thread(target=lambda: taken.extend(tier.take(allocate=False) for _ in range(room + 1)))
    taker.start()
    taker.join(10)
    stuck = taker.is_alive()
    release.set()
    taker.join()
    tier.wait_grown()
    assert not stuck
    assert taken[:room] == list(range(room)) and taken[room] is None     # the room there, then none
    assert tier.allocated_slots > room and len(tier.free) == tier.allocated_slots - room


def test_the_grower_gives_a_chunk_up_when_a_request_starts_and_pins_it_later(monkeypatch):
    """A request starting while the tier pins a chunk stops the pinning at the next piece (the request's
    plan activation and first step would run beside it); the chunk is pinned once the request is done."""
    import threading

    kv = make_cache(host_blocks=40)
    kv._pinned = True
    tier = kv.host
    tier.chunk_slots = 8
    pinning, release = threading.Event(), threading.Event()
    calls = []
    new_buffer = tier._new_buffer

    def slow_buffer(nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            pinning.set()
            release.wait(30)
        return new_buffer(nbytes)

    monkeypatch.setattr(tier, "_new_buffer", slow_buffer)
    tier.grow_ahead(8)
    assert pinning.wait(30)
    kv.request_started()                   # mid-chunk: its first piece is being pinned
    release.set()
    tier.wait_grown()
    assert tier.allocated_slots == 0 and len(calls) == 1       # given up after that piece
    seq = Sequence()
    fill(kv, seq, list(range(2 * BLOCK_SIZE)), seed=9)
    kv.release(seq)                        # idle again: the grower pins the chunk whole
    tier.wait_grown()
    assert tier.allocated_slots == 8 and len(tier.free) == 8
    assert len(calls) == 1 + sum(len(parts) for parts in tier.part_bytes)    # a piece per layer and part


def test_a_request_stops_the_pinning_before_its_plan_activation_and_frees_it_at_its_end(tiny_model, monkeypatch):
    """Generate and the batch scheduler both mark the tier busy before the request's first re-plan (the
    plan activation and the first step run without the grower pinning beside them), and idle once done,
    a request refused at admission included."""
    from engine.backends.torch_engine import TorchEngine

    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    tier = eng.executor.kv.host
    seen = []
    real = TorchEngine._ensure_kv_capacity

    def watch(self, tokens, *args):
        seen.append(tier._idle.is_set())
        return real(self, tokens, *args)

    monkeypatch.setattr(TorchEngine, "_ensure_kv_capacity", watch)
    list(eng.generate("a b c " * 40, max_new_tokens=3))
    assert seen and not any(seen) and tier._idle.is_set()
    seen.clear()
    handles = [eng.submit(p, max_new_tokens=3, background=False) for p in ("x y", "p q r")]
    while eng.step_batch():
        pass
    assert all(h.result().text is not None for h in handles)
    assert seen and not any(seen) and tier._idle.is_set()
    eng.close()


@pytest.mark.parametrize("background", [True, False])
def test_a_spill_on_its_thread_is_waited_for_by_the_writes_into_the_blocks_it_frees(monkeypatch, background):
    """A spill's host copies run on the spill thread (slowed here to a crawl): the next sequence's cache
    writes into the freed blocks wait for them, layer by layer, and the spilled blocks come back from the
    tier bit for bit; off (SLIPSTREAM_KV_SPILL_THREAD=0) the same contents, copied in place."""
    import threading
    import time

    from engine.sharding import kvcache

    kv = make_cache(host_blocks=40, gpu_layers=())        # (every pool in host memory: copies on the thread)
    kv.background_spill = background
    real = kvcache._copy_pairs
    threads = set()

    def slow(moves):
        threads.add(threading.current_thread().name)
        time.sleep(0.05)
        real(moves)

    monkeypatch.setattr(kvcache, "_copy_pairs", slow)
    first = list(range(8 * BLOCK_SIZE))                   # every pool block
    seq = Sequence()
    fill(kv, seq, first, seed=21)
    want = contents(kv, seq)
    kv.release(seq)                                       # cached, unused
    other = Sequence()
    fill(kv, other, [i + 1000 for i in range(4 * BLOCK_SIZE)], seed=22)   # spills 4 of them, writes over them
    mine = contents(kv, other)
    assert kv.host_stats["spilled_blocks"] == 4
    assert threads == ({"slipstream-kv-spill_0"} if background else {"MainThread"})
    kv.release(other)
    again = Sequence()
    assert kv.match_prefix(again, first + [0]) == len(first)   # 4 from the pools, 4 back from the tier
    assert same(contents(kv, again), want)
    assert not kv._spilling
    kv.close()
    assert mine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the spill stream")
def test_a_spill_out_of_gpu_pools_on_its_stream_is_waited_for_by_the_writes_after_it():
    """Beside a GPU a spill's copies out of the GPU pools queue on a stream of their own, an event per
    layer: the next sequence's writes into the freed blocks wait for them on the GPU (a long sleep queued
    on the spill stream first makes any missing wait show), and the blocks come back bit for bit."""
    acc = Accelerator("cuda")
    acc.budget = 1 << 30
    kv = PagedKVCache(CFG, torch.float32, acc, host_bytes=0)
    kv.set_host_capacity(40 * kv.host.slot_bytes)
    kv._grow(8)
    kv.host.wait_grown()    # (a spill beside a GPU keeps only what fits in room pinned already)
    for layer in range(CFG.num_layers):
        kv.place_layer(layer, True)

    def fill_cuda(seq, ids, seed):
        g = torch.Generator().manual_seed(seed)
        kv.reserve(seq, len(ids))
        for layer in range(CFG.num_layers):
            k, v = (torch.randn(CFG.num_kv_heads, len(ids), CFG.head_dim, generator=g).cuda() for _ in range(2))
            with torch.inference_mode():
                kv.write(layer, seq, seq.length, k, v)
        seq.length += len(ids)
        seq.token_ids.extend(ids)

    first = list(range(8 * BLOCK_SIZE))
    seq = Sequence()
    fill_cuda(seq, first, 31)
    want = [t.cpu() for t in contents(kv, seq)]
    kv.release(seq)
    kv._spill_stream = torch.cuda.Stream()
    with torch.cuda.stream(kv._spill_stream):
        torch.cuda._sleep(200_000_000)        # (about 0.1 s: the spill's copies start after it)
    other = Sequence()
    fill_cuda(other, [i + 1000 for i in range(4 * BLOCK_SIZE)], 32)
    assert kv.host_stats["spilled_blocks"] == 4
    kv.release(other)
    again = Sequence()
    assert kv.match_prefix(again, first + [0]) == len(first)
    assert same([t.cpu() for t in contents(kv, again)], want)
    kv.close()
