"""Prefix caching on the paged KV cache: reused blocks give the same results as recomputing them."""

from __future__ import annotations

import pytest

import engine
from engine.sharding.kvcache import BLOCK_SIZE, Sequence, block_hashes


def greedy(eng, prompt, n=12):
    return [e.token_id for e in eng.generate(prompt, max_new_tokens=n)]


def test_block_hashes_chain():
    a = block_hashes(list(range(40)))
    b = block_hashes(list(range(32)) + [99] * 8)
    assert len(a) == 40 // BLOCK_SIZE and a[:2] == b[:2]
    assert block_hashes([5] + list(range(1, 32)))[1] != block_hashes(list(range(32)))[1]


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_new_turn_reuses_blocks_and_matches_recompute(tiny_model, device):
    path = tiny_model("qwen3")
    cached = engine.open_model(path, device=device, backend="torch", speculative=False)
    fresh = engine.open_model(path, device=device, backend="torch", speculative=False)
    convo = [{"role": "user", "content": "tell me about the blue river and the old mill by the hill"}]
    answer = "".join(e.text for e in cached.generate(convo, max_new_tokens=24))
    convo += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then what?"}]
    before = cached.stats()["prefix_hit_tokens"]
    got = greedy(cached, convo)
    assert cached.stats()["prefix_hit_tokens"] - before >= BLOCK_SIZE
    fresh.executor.kv.forget_cached()
    assert got == greedy(fresh, convo)
    # score() never takes cached blocks: identical logits before and after caching
    ids = cached.encode_prompt(convo)
    assert (cached.score(ids) - fresh.score(ids)).abs().max().item() < 1e-5


def test_switching_conversations_and_eviction(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="sim", backend="torch", n_ctx=256)
    ref = engine.open_model(tiny_model("llama"), device="sim", backend="torch", n_ctx=256)
    a = "alpha " * 30
    b = "bravo " * 30
    want_a, want_b = greedy(ref, a), greedy(ref, b)
    assert greedy(eng, a) == want_a
    assert greedy(eng, b) == want_b
    hits = eng.stats()["prefix_hit_tokens"]
    assert greedy(eng, a) == want_a           # back to the first conversation: its blocks are reused
    assert eng.stats()["prefix_hit_tokens"] > hits
    # Fill the cache with other prompts so old blocks are evicted (least recently used first).
    for i in range(12):
        greedy(eng, f"{i} " * 60, n=2)
    assert greedy(eng, b) == want_b
    kv = eng.executor.kv
    assert set(kv.refs) == set()                # nothing is left referenced between requests
    assert len(kv.free_blocks) + len(kv.evictable) == kv.n_blocks


def test_match_prefix_leaves_a_token_to_compute(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="cpu", backend="torch")
    ids = eng.tokenizer.encode("x " * 40)[: 2 * BLOCK_SIZE]
    eng.score(ids)                              # leaves both blocks cached
    seq = Sequence()
    reused = eng.executor.kv.match_prefix(seq, ids)
    assert reused == BLOCK_SIZE                 # the last block would leave nothing to compute
    eng.executor.kv.release(seq)
