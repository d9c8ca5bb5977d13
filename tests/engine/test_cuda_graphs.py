"""One-token decode work replayed from CUDA graphs (attention up to its cache, FFNs) gives the eager path's
numbers bit for bit, follows the contents of a slot's buffers and RoPE's buffers, stays out of the plans'
budget, and steps aside where its reserve cannot be booked. The CUDA tests run on the GPU machine; the
accounting ones run everywhere."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import engine
from engine.config import ModelConfig
from engine.errors import OutOfBudgetError
from engine.models import dense, moe
from engine.sharding import graphs
from engine.sharding.plan import Placement, Plan, PlanSet

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Books:
    def __init__(self, room: int):
        self.room, self.used = room, 0

    def book(self, n, tag, what=""):
        if self.used + n > self.room:
            raise OutOfBudgetError(f"{what}: over")
        self.used += n

    def unbook(self, n, tag):
        self.used -= n


def _open_on_the_cpu_plan(monkeypatch) -> None:
    """Engines open with every sub-layer on the CPU; each test then forces its own plan (`_force`)."""
    from engine.backends.torch_engine import TorchEngine

    def all_cpu(self, budget, kv_tokens=None):
        return PlanSet(budget, [Plan(t, "manual", {s.name: Placement.CPU for s in self.spec.sublayers}, 0)
                                for t in self.tiers])

    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu)


def _force(eng, placement: dict, n_slots: int) -> None:
    """Every tier of `eng` runs `placement` from now on (re-planned at its budget)."""
    planset = PlanSet(eng.budget, [Plan(t, "manual", dict(placement), n_slots) for t in eng.tiers])
    eng._make_planset = lambda budget, kv_tokens=None, ps=planset: ps
    eng.set_vram_budget(eng.budget)


def test_no_graphs_off_cuda(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="sim", backend="torch")
    try:
        assert eng.executor.graphs is None
        assert graphs.reserve_for(1 << 40, eng.executor.accel) == 0
    finally:
        eng.close()
    assert not graphs.OneTokenGraphs.applies(torch.zeros(1, 4))


def test_the_reserve_is_kept_from_budgets_that_can_spare_it(monkeypatch):
    gpu = SimpleNamespace(kind="cuda")
    monkeypatch.delenv("SLIPSTREAM_CUDA_GRAPHS", raising=False)
    assert graphs.reserve_for(graphs.MIN_ROOM, gpu) == graphs.RESERVE   # on by default
    assert graphs.reserve_for(graphs.MIN_ROOM - 1, gpu) == 0          # a small budget keeps its weights
    assert graphs.reserve_for(1 << 40, None) == 0
    monkeypatch.setenv("SLIPSTREAM_CUDA_GRAPHS", "0")
    assert graphs.reserve_for(1 << 40, gpu) == 0


def _cfg(qk_norm=False, **kw):
    return ModelConfig(arch="qwen3" if qk_norm else "llama", vocab_size=64, hidden_size=512,
                       intermediate_size=1536, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=64,
                       qk_norm=qk_norm, dtype="bfloat16", **kw)


def _attn_weights(cfg, gen, dev):
    h, d = cfg.hidden_size, cfg.head_dim
    rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    w = {"attn_norm.weight": 1 + 0.1 * torch.randn(h, generator=gen), "qkv.weight": torch.randn(rows, h, generator=gen) / 16,
         "o.weight": torch.randn(h, cfg.num_heads * d, generator=gen) / 16}
    if cfg.qk_norm:
        w.update({"q_norm.weight": 1 + 0.1 * torch.randn(d, generator=gen), "k_norm.weight": 1 + 0.1 * torch.randn(d, generator=gen)})
    return {n: t.to(dev, torch.bfloat16) for n, t in w.items()}


def _ffn_weights(cfg, gen, dev):
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"ffn_norm.weight": torch.randn(h, generator=gen).to(dev, torch.bfloat16),
            "gate_up.weight": (torch.randn(2 * i, h, generator=gen) / 16).to(dev, torch.bfloat16),
            "down.weight": (torch.randn(h, i, generator=gen) / 16).to(dev, torch.bfloat16)}


@cuda
@pytest.mark.parametrize("qk_norm", [False, True])
def test_replays_match_eager_and_follow_the_slot_and_rope(qk_norm):
    cfg, dev = _cfg(qk_norm), torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    slot_a, slot_f = _attn_weights(cfg, gen, dev), _ffn_weights(cfg, gen, dev)   # refilled per "layer"
    books = Books(1 << 30)
    g = graphs.OneTokenGraphs(books)
    for layer in range(6):
        fresh_a, fresh_f = _attn_weights(cfg, gen, dev), _ffn_weights(cfg, gen, dev)
        for slot, fresh in ((slot_a, fresh_a), (slot_f, fresh_f)):
            for n, t in fresh.items():
                slot[n].copy_(t)
        x = torch.randn(1, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
        ang = torch.rand(1, cfg.head_dim // 2, generator=gen) * (layer + 1)
        cos, sin = (torch.cat([f(ang)] * 2, -1).to(dev, torch.bfloat16) for f in (torch.cos, torch.sin))
        cs = g.rope(cos, sin)
        got = g.run("attn", lambda w_, x_, cs=cs: dense.attention_qkv(cfg, w_, x_, *cs), slot_a, x)
        want = dense.attention_qkv(cfg, fresh_a, x, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), layer
        got_f = g.run("ffn", lambda w_, x_: dense.ffn_block(cfg, w_, x_), slot_f, x).clone()
        assert torch.equal(got_f, dense.ffn_block(cfg, fresh_f, x)), layer
    assert g.captures == 2 and g.replays == 2 * 5          # captured at the second sighting, then replayed
    assert books.used == graphs.RESERVE
    g.clear()
    assert books.used == 0 and g.stats()["cuda_graphs"] == 0


@cuda
def test_no_room_for_the_reserve_runs_eagerly():
    cfg = _cfg()
    gen = torch.Generator().manual_seed(1)
    w = _ffn_weights(cfg, gen, "cuda")
    g = graphs.OneTokenGraphs(Books(graphs.RESERVE - 1))
    x = torch.randn(1, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    for _ in range(3):
        assert torch.equal(g.run("ffn", lambda w_, x_: dense.ffn_block(cfg, w_, x_), w, x),
                           dense.ffn_block(cfg, w, x))
    assert g.captures == 0 and g.replays == 0


@cuda
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen3_moe"])
def test_generation_with_graphs_matches_without(tiny_model, monkeypatch, seed, arch):
    _open_on_the_cpu_plan(monkeypatch)
    path = tiny_model(arch)
    tokens, replays = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SLIPSTREAM_CUDA_GRAPHS", flag)
        eng = engine.open_model(path, device="cuda", backend="torch", vram_budget="3GiB", speculative=False)
        rng = random.Random(seed)
        names = [s.name for s in eng.spec.sublayers]
        placement = {n: (rng.choice([Placement.RESIDENT, Placement.STREAMED]) if n.endswith((".ffn", ".attn"))
                         else rng.choice(list(Placement))) for n in names}
        _force(eng, placement, 2)
        tokens[flag] = [e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=24)]
        g = eng.executor.graphs
        replays[flag] = None if g is None else g.replays
        eng.close()
    assert tokens["1"] == tokens["0"]
    assert replays["1"] > 0 and replays["0"] is None


@cuda
def test_an_engine_keeps_the_reserve_out_of_its_plans(tiny_model, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CUDA_GRAPHS", "1")
    eng = engine.open_model(tiny_model("llama3"), device="cuda", backend="torch", vram_budget="3GiB",
                            speculative=False)
    try:
        room = eng.executor.accel.budget
        assert eng.planset.budget == room
        assert eng.planset.for_tokens(1).vram.total <= room - graphs.RESERVE
        list(eng.generate("the quick brown fox", max_new_tokens=8))
        assert eng.executor.accel.total_used <= room
    finally:
        eng.close()


@cuda
def test_graphs_that_outgrow_their_reserve_give_it_back_and_run_eagerly(monkeypatch):
    monkeypatch.setattr(graphs, "RESERVE", 1)
    torch.cuda.empty_cache()
    cfg = _cfg()
    gen = torch.Generator().manual_seed(2)
    w = _ffn_weights(cfg, gen, "cuda")
    books = Books(1 << 30)
    g = graphs.OneTokenGraphs(books)
    x = torch.randn(1, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    for _ in range(4):
        assert torch.equal(g.run("ffn", lambda w_, x_: dense.ffn_block(cfg, w_, x_), w, x),
                           dense.ffn_block(cfg, w, x))
    assert g.replays == 0 and "over their" in g.stats()["cuda_graph_error"] and books.used == 0


def _layer_0_whole(path, device: str, whole: bool):
    """An engine on `device` with every sub-layer resident but one expert group of layer 1 (which then
    takes the general path), the one-call MoE layer on or off; and the list of (router, tokens) of each
    one-call layer run."""
    eng = engine.open_model(path, device=device, backend="torch", vram_budget="3GiB", speculative=False)
    placement = {s.name: Placement.RESIDENT for s in eng.spec.sublayers}
    placement["layers.1.experts.0"] = Placement.STREAMED
    _force(eng, placement, 1)
    ex = eng.executor
    ex.fused_moe = whole
    seen: list[tuple[str, int]] = []
    real = ex._moe_layer_on_gpu
    ex._moe_layer_on_gpu = lambda name, w, g, x, f: seen.append((name, x.shape[0])) or real(name, w, g, x, f)
    return eng, seen


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_batched_steps_run_moe_layers_held_in_vram_whole(tiny_model, monkeypatch, arch):
    """Steps of a few tokens (a batch of decoding streams) run a MoE layer whose router and groups are all
    resident as one call too (sim device): the same tokens per stream as the router and groups one by
    one; steps of more tokens (the prompts) and a layer with a group elsewhere take the general path."""
    _open_on_the_cpu_plan(monkeypatch)
    path = tiny_model(arch)
    prompts = ["the quick brown fox", "one two three", "a b c d e f", " ".join(["hello there"] * 20)]
    tokens, sizes = {}, {}
    for whole in (True, False):
        eng, seen = _layer_0_whole(path, "sim", whole)
        handles = [eng.submit(p, max_new_tokens=12) for p in prompts]
        tokens[whole] = [h.result().token_ids for h in handles]
        sizes[whole] = seen
        eng.close()
    assert tokens[True] == tokens[False]
    assert {name for name, _ in sizes[True]} == {"layers.0.ffn"} and not sizes[False]
    counts = {n for _, n in sizes[True]}
    assert len(prompts) in counts and max(counts) <= moe.FEW_TOKENS


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_long_steps_run_gpu_expert_groups_in_padded_runs(tiny_model, monkeypatch, arch):
    """A step of more than moe.FEW_TOKENS tokens (a prompt) runs each GPU expert group, resident or
    streamed, in padded runs (`moe.experts_padded`; sim device): the same tokens as one expert at a time."""
    _open_on_the_cpu_plan(monkeypatch)
    path = tiny_model(arch)
    prompt = " ".join(["the quick brown fox jumps"] * 8)
    tokens, calls = {}, {}
    real = moe.experts_padded
    for padded in (True, False):
        seen = []

        def run(cfg, w, s, experts, padded=padded, seen=seen):
            seen.append(s.h.shape[0])
            return real(cfg, w, s, experts) if padded else moe.experts_block(cfg, w, s, experts)
        monkeypatch.setattr(moe, "experts_padded", run)
        eng, _ = _layer_0_whole(path, "sim", True)
        tokens[padded] = [e.token_id for e in eng.generate(prompt, max_new_tokens=8)]
        calls[padded] = seen
        eng.close()
    assert tokens[True] == tokens[False]
    assert calls[True] and min(calls[True]) > moe.FEW_TOKENS


@cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_layers_held_in_vram_run_whole_without_host_waits(tiny_model, monkeypatch, arch):
    """A one-token step runs a MoE layer whose router and groups are all resident as one GPU call (from a
    graph where graphs are on): the same greedy tokens as the router and groups one by one; a layer with
    a group elsewhere takes the general path."""
    _open_on_the_cpu_plan(monkeypatch)
    path = tiny_model(arch)
    tokens, calls = {}, {}
    for flag, whole in (("1", True), ("1", False), ("0", True)):
        monkeypatch.setenv("SLIPSTREAM_CUDA_GRAPHS", flag)
        eng, seen = _layer_0_whole(path, "cuda", whole)
        tokens[(flag, whole)] = [e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=20)]
        calls[(flag, whole)] = {name for name, _ in seen}
        if flag == "1" and whole:
            assert any(k[0] == "moe" for k in eng.executor.graphs._graphs)
        eng.close()
    assert tokens[("1", True)] == tokens[("1", False)] == tokens[("0", True)]
    assert calls[("1", True)] == calls[("0", True)] == {"layers.0.ffn"} and not calls[("1", False)]


class _EagerGraphs(graphs.OneTokenGraphs):
    """The graphs' bookkeeping with every "replay" run eagerly: what a captured graph computes, on any
    device (a replay runs the captured kernels, so it computes the same)."""

    def __init__(self):
        super().__init__(None)
        self.kinds: list[str] = []

    @staticmethod
    def applies(x):
        return x.shape[0] == 1

    def run(self, kind, fn, w, x):
        self.kinds.append(kind)
        return fn(w, x)


@pytest.mark.parametrize("arch,options", [("llama3", {}), ("qwen3", {}), ("mistral", {"sliding_window": 24}), ("mistral", {})])
def test_a_decode_attention_over_a_padded_context_matches_the_paged_path(tiny_model, monkeypatch, arch, options):
    """The whole one-token attention as a graph captures it (the new key and value written at a row from a
    device index, the context gathered through a padded block table, the token's positions masked) gives
    the tokens of the paged path, across growing padded contexts, a sliding window and blocks handed out
    in any order; sim device, float32, greedy and sampled. Memory comes from the allocator NaN-filled, as
    reused memory can be: the padding must gather no leftover bytes."""
    monkeypatch.setattr(graphs, "MIN_CONTEXT", 16)
    real_empty = torch.empty

    def dirty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", dirty)
    path = tiny_model(arch, **options)
    runs = {}
    for captured in (False, True):
        eng = engine.open_model(path, device="sim", backend="torch", vram_budget="1GiB", speculative=False)
        placement = {s.name: (Placement.RESIDENT if s.name.endswith(".attn") else Placement.CPU)
                     for s in eng.spec.sublayers}
        _force(eng, placement, 0)
        ex = eng.executor
        ex.graphs, ex.graph_attention = _EagerGraphs(), captured
        # blocks handed out of order: a first request leaves holes in the pool
        list(eng.generate("one two three four five six seven eight nine ten", max_new_tokens=30))
        out = [[e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=40, **kw)]
               for kw in ({}, {"temperature": 0.9, "seed": 3})]
        runs[captured] = (out, list(ex.graphs.kinds))
        eng.close()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].count("attnkv") >= 2 * 40 and "attnkv" not in runs[False][1]


def test_the_padded_context_grows_by_powers_of_two_and_each_keeps_its_buffers():
    """Each padded context has buffers of its own, kept until the plan changes (so are the graphs that
    read them: dropping a private pool's last graph would break the next capture into it); a new
    conversation that starts small again finds them, refreshed."""
    g = _EagerGraphs()
    assert [graphs.padded_context(n) for n in (1, 256, 257, 600, 4096)] == [256, 256, 512, 1024, 4096]
    g._graphs[("attnkv", 0)] = g._graphs[("attn", 0)] = object()
    rows, table, valid = g.decode_index(list(range(40, 0, -1)), 300, None, "cpu")
    assert ("attnkv", 0) in g._graphs and ("attn", 0) in g._graphs
    assert table.shape == (512 // 16,) and valid.shape == (512,)
    assert rows.item() == (40 - 300 // 16) * 16 + 300 % 16        # block 300 // 16 of the table, row 300 % 16
    assert valid.sum().item() == 301 and valid[:301].all()
    assert table[:19].tolist() == list(range(40, 21, -1)) and set(table[19:].tolist()) == {40}
    g.decode_index(list(range(40, 0, -1)), 300, 100, "cpu")
    assert valid.sum().item() == 100 and valid[201:301].all()
    small = g.decode_index([7, 3], 20, None, "cpu")
    assert small[1].shape == (256 // 16,) and small[0].item() == 3 * 16 + 4 and small[2].sum().item() == 21
    again = g.decode_index(list(range(40, 0, -1)), 299, None, "cpu")
    assert again[1].data_ptr() == table.data_ptr() and valid.sum().item() == 300     # the same buffers, refreshed
    assert g.decode_index([5], 1, None, "cpu")[1].data_ptr() == small[1].data_ptr()
    g.clear()
    assert g._kv_index == {}


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_token_kernel_gives_the_same_bits_over_an_exact_and_a_padded_context(dtype):
    """What lets a plan capture its attention or not and give the same tokens: `attend_one_token` over
    the exact context (the eager path) and over the padded one (the graph) agree bit for bit."""
    torch.manual_seed(0)
    for heads, kvh, d, n, pad in ((4, 2, 16, 37, 256), (32, 8, 128, 300, 512), (32, 4, 128, 1000, 1024)):
        q = torch.randn(heads, 1, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(pad, kvh, d, device="cuda", dtype=dtype).transpose(0, 1) for _ in range(2))
        valid = graphs.visible(pad, n - 1, None, "cuda")
        exact = dense.attend_one_token(q, k[:, :n], v[:, :n], valid[:n])
        assert torch.equal(exact, dense.attend_one_token(q, k, v, valid))
        windowed = graphs.visible(pad, n - 1, 24, "cuda")
        assert torch.equal(dense.attend_one_token(q, k[:, :n], v[:, :n], windowed[:n]),
                           dense.attend_one_token(q, k, v, windowed))


@cuda
@pytest.mark.parametrize("arch,dtype", [("llama3", "float32"), ("qwen3", "float32"), ("qwen3_moe", "float32"),
                                        ("llama3", "bfloat16")])
def test_captured_decode_attention_gives_the_tokens_of_the_eager_path_on_cuda(tiny_model, monkeypatch, arch, dtype):
    """SLIPSTREAM_GRAPH_ATTENTION=1 on the GPU: each one-token attention replays whole from a graph (cache
    write and padded context included), across the padded context's growth and back (a second
    conversation); the same tokens as without, in bfloat16 too."""
    _open_on_the_cpu_plan(monkeypatch)
    monkeypatch.setattr(graphs, "MIN_CONTEXT", 16)
    path = tiny_model(arch, dtype=dtype)
    tokens, kinds = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SLIPSTREAM_GRAPH_ATTENTION", flag)
        eng = engine.open_model(path, device="cuda", backend="torch", vram_budget="3GiB", speculative=False)
        rng = random.Random(5)
        placement = {s.name: (rng.choice([Placement.RESIDENT, Placement.STREAMED]) if s.name.endswith(".attn")
                              else rng.choice(list(Placement))) for s in eng.spec.sublayers}
        _force(eng, placement, 2)
        tokens[flag] = [[e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=40, **kw)]
                        for kw in ({}, {"temperature": 0.9, "seed": 3})]
        kinds[flag] = {k[0] for k in eng.executor.graphs._graphs}
        stats = eng.executor.graphs.stats()
        eng.close()
        assert stats["cuda_graph_replays"] > 0 and stats["cuda_graph_error"] is None, stats
    assert "attnkv" in kinds["1"] and "attnkv" not in kinds["0"], kinds
    for a, b in zip(tokens["1"], tokens["0"]):
        assert a == b, f"first differing token at {next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}: {a} {b}"


@cuda
@pytest.mark.parametrize("arch,dtype", [("llama3", "bfloat16"), ("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16")])
def test_attention_between_host_sub_layers_crosses_through_the_graphs_pinned_twins_on_cuda(tiny_model, monkeypatch,
                                                                                            arch, dtype):
    """Attention resident with the rest on the CPU (a MoE decode's shape at small budgets): each captured
    one-token attention runs from the host (`OneTokenGraphs.run_host`), with the tokens of the usual way
    (SLIPSTREAM_GRAPH_HOST_IO=0), greedy and sampled, across a second conversation."""
    _open_on_the_cpu_plan(monkeypatch)
    monkeypatch.setattr(graphs, "MIN_CONTEXT", 16)
    path = tiny_model(arch, dtype=dtype)
    tokens, host = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SLIPSTREAM_GRAPH_HOST_IO", flag)
        eng = engine.open_model(path, device="cuda", backend="torch", vram_budget="3GiB", speculative=False)
        placement = {s.name: Placement.RESIDENT if s.name.endswith((".attn", "head")) else Placement.CPU
                     for s in eng.spec.sublayers}
        _force(eng, placement, 2)
        tokens[flag] = [[e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=40, **kw)]
                        for kw in ({}, {"temperature": 0.9, "seed": 3})]
        host[flag] = eng.executor.graphs.stats()["cuda_graph_host_replays"]
        eng.close()
    assert host["1"] > 0 and host["0"] == 0, host
    assert tokens["1"] == tokens["0"]


def test_long_contexts_take_the_paged_path():
    """A padded context whose gather would take more than a quarter of the graphs' reserve is not captured
    (Llama-3-8B's layer holds 4 KiB of keys and values per token: up to 4096 positions)."""
    per_token = 2 * 8 * 128 * 2
    assert graphs.fits_padded_context(4096, per_token) and not graphs.fits_padded_context(4097, per_token)
    assert graphs.fits_padded_context(8192, per_token // 2)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_token_kernel_gives_each_sequence_its_own_bits_in_a_batch(dtype):
    """A batch's decode tokens attend together (`attend_one_token_batch`, every context padded to the
    longest, KV in a strided [B, L, kv_heads, d] gather as the padded reads give it): each row the bits
    of `attend_one_token` over that sequence's exact context alone."""
    torch.manual_seed(1)
    for heads, kvh, d, lengths in ((4, 2, 16, (5, 37, 1)), (32, 8, 128, (300, 17, 129, 64)), (32, 4, 128, (1000, 999))):
        b, pad = len(lengths), max(lengths)
        q = torch.randn(b, heads, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, pad, kvh, d, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2))
        valid = torch.arange(pad, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
        got = dense.attend_one_token_batch(q, k, v, valid)
        for i, n in enumerate(lengths):
            alone = dense.attend_one_token(q[i][:, None], k[i, :, :n].contiguous(), v[i, :, :n].contiguous(),
                                           graphs.visible(n, n - 1, None, "cuda"))
            assert torch.equal(got[i], alone[:, 0]), (heads, lengths, i)


@cuda
@pytest.mark.parametrize("kv_layers", [0, 2])
def test_batched_decode_over_vram_and_host_kv_gives_each_stream_its_solo_tokens_on_cuda(tiny_model, monkeypatch,
                                                                                          kv_layers):
    """Several streams decoding together on the GPU, their caches in VRAM (kv_layers 2) or in host memory
    (0: one padded gather and copy per layer for the batch's decode tokens): each stream's tokens are
    those it gets alone."""
    _open_on_the_cpu_plan(monkeypatch)
    path = tiny_model("llama3")
    prompts = ["the quick brown fox", "one two three", "a b c d e f", " ".join(["hello there"] * 20)]
    eng = engine.open_model(path, device="cuda", backend="torch", vram_budget="3GiB", speculative=False)
    placement = {s.name: (Placement.STREAMED if s.name.endswith(".attn") else Placement.CPU)
                 for s in eng.spec.sublayers}
    planset = PlanSet(eng.budget, [Plan(t, "manual", dict(placement), 2, kv_layers=kv_layers) for t in eng.tiers])
    eng._make_planset = lambda budget, kv_tokens=None, ps=planset: ps
    eng.set_vram_budget(eng.budget)
    together = []
    real = eng.executor._one_token_kernel
    eng.executor._one_token_kernel = lambda layer, segs, q: together.append(len(segs)) or real(layer, segs, q)
    solo = [[e.token_id for e in eng.generate(p, max_new_tokens=16) if e.token_id is not None] for p in prompts]
    handles = [eng.submit(p, max_new_tokens=16) for p in prompts]
    batched = [h.result().token_ids for h in handles]
    assert [p.on_gpu for p in eng.executor.kv.pools] == [i < kv_layers for i in range(len(eng.executor.kv.pools))]
    eng.close()
    assert max(together) >= 2
    assert batched == solo
