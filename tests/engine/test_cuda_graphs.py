"""One-token FFNs replayed from CUDA graphs give the eager path's numbers bit for bit, follow the contents
of a slot's buffers, and step aside where their pool does not fit the budget. CUDA only (the GPU machine
runs them; on the sim device the executor has no graphs)."""

from __future__ import annotations

import random

import pytest
import torch

import engine
from engine.config import ModelConfig
from engine.errors import OutOfBudgetError
from engine.models import dense
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


def ffn_weights(cfg, gen, dev) -> dict[str, torch.Tensor]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"ffn_norm.weight": torch.randn(h, generator=gen).to(dev, torch.bfloat16),
            "gate_up.weight": (torch.randn(2 * i, h, generator=gen) / 16).to(dev, torch.bfloat16),
            "down.weight": (torch.randn(h, i, generator=gen) / 16).to(dev, torch.bfloat16)}


def test_no_graphs_off_cuda(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="sim", backend="torch")
    assert eng.executor.ffn_graphs is None
    assert not graphs.FFNGraphs.applies(torch.zeros(1, 4))
    eng.close()


@cuda
def test_graph_replays_match_eager_and_follow_the_slot():
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=512, intermediate_size=1536, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    slot = ffn_weights(cfg, gen, dev)                 # one buffer set, refilled per "layer"
    books = Books(1 << 30)
    g = graphs.FFNGraphs(cfg, books)
    for layer in range(6):
        fresh = ffn_weights(cfg, gen, dev)
        for n, t in fresh.items():
            slot[n].copy_(t)
        x = torch.randn(1, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
        want = dense.ffn_block(cfg, fresh, x)
        got = g.run(slot, x)
        assert torch.equal(got, want), layer
    assert g.captures == 1 and g.replays == 5         # captured at the second sighting, then replayed
    assert books.used == graphs.POOL_BOOKING
    g.clear()
    assert books.used == 0


@cuda
def test_no_room_for_the_pool_runs_eagerly():
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)
    w = ffn_weights(cfg, gen, "cuda")
    g = graphs.FFNGraphs(cfg, Books(graphs.POOL_BOOKING - 1))
    x = torch.randn(1, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    for _ in range(3):
        assert torch.equal(g.run(w, x), dense.ffn_block(cfg, w, x))
    assert g.captures == 0 and g.replays == 0


@cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_generation_with_graphs_matches_without(tiny_model, monkeypatch, seed):
    from engine.backends.torch_engine import TorchEngine

    def all_cpu(self, budget, kv_tokens=None):          # opened on the CPU; the test forces its plan
        return PlanSet(budget, [Plan(t, "manual", {s.name: Placement.CPU for s in self.spec.sublayers}, 0)
                                for t in self.tiers])

    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu)
    path = tiny_model("llama3")
    tokens, replays = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SLIPSTREAM_CUDA_GRAPHS", flag)
        eng = engine.open_model(path, device="cuda", backend="torch", vram_budget="1GiB", speculative=False)
        rng = random.Random(seed)
        names = [s.name for s in eng.spec.sublayers]
        placement = {n: (rng.choice([Placement.RESIDENT, Placement.STREAMED]) if n.endswith(".ffn")
                         else rng.choice(list(Placement))) for n in names}
        planset = PlanSet(eng.budget, [Plan(t, "manual", dict(placement), 2) for t in eng.tiers])
        eng._make_planset = lambda budget, kv_tokens=None, ps=planset: ps
        eng.set_vram_budget(eng.budget)
        tokens[flag] = [e.token_id for e in eng.generate("the quick brown fox", max_new_tokens=24)]
        fg = eng.executor.ffn_graphs
        replays[flag] = None if fg is None else fg.replays
        eng.close()
    assert tokens["1"] == tokens["0"]
    assert replays["1"] > 0 and replays["0"] is None
