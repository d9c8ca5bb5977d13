"""A one-token attention on the CPU as one native call (`kernels.attention_decode`, `sl_attn_decode`): the
norm, the stacked q/k/v projection (with qwen2's bias), qwen3's q/k norms, RoPE (llama3's scaled
frequencies too), the paged cache write, attention and the output projection with the residual add give
the tensor path's bits. A generation with the call gives the logits of one without it at every step, bf16
and fp16, and the cache it leaves holds the same keys and values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import kernels
from tests.engine.cpu_decode import decode_logged

needs_kernel = pytest.mark.skipif(kernels._load() is None or not kernels.attention_ready(),
                                  reason=f"no native kernel: {kernels.status()}")


def _generate(path, dtype: str, monkeypatch, call: str):
    monkeypatch.setenv("SLIPSTREAM_CPU_ATTENTION_CALL", call)
    tokens, steps, layers, pools = decode_logged(path, dtype, "a b c d e f g h i j k l m n o p q r s", 24)
    return tokens, steps, pools, layers


@needs_kernel
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generation_through_the_attention_call_matches_the_tensor_path(tiny_model, arch, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "MIN_WEIGHTS_16BIT", 0)       # (tiny matrices through the kernel both ways)
    calls = []
    real = kernels.attention_decode
    monkeypatch.setattr(kernels, "attention_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = tiny_model(arch)
    tokens, steps, pools, layers = _generate(path, dtype, monkeypatch, "1")
    assert len(calls) == layers * (len(steps) - 1)             # every decode step's layers (not the prompt's)
    calls.clear()
    tokens_off, steps_off, pools_off, _ = _generate(path, dtype, monkeypatch, "0")
    assert not calls
    assert tokens == tokens_off
    assert len(steps) == len(steps_off) and all(torch.equal(a, b) for a, b in zip(steps, steps_off))
    assert all(torch.equal(a, b) for la, lb in zip(pools, pools_off) for a, b in zip(la, lb))


@needs_kernel
def test_the_attention_call_declines_what_it_does_not_cover(tiny_model, monkeypatch):
    """Float32 activations, a matmul below the kernel's threshold (the tensor path would take PyTorch's, so
    the bits would differ): None, nothing written."""
    from engine.backends.torch_engine import TorchEngine
    from engine.loading import load_model

    results = []
    real = kernels.attention_decode
    monkeypatch.setattr(kernels, "attention_decode", lambda *a, **k: results.append(real(*a, **k)) or results[-1])
    loaded = load_model(tiny_model("llama3"))
    loaded.config = dataclasses.replace(loaded.config, dtype="bfloat16")
    loaded.weights = {k: v.to(torch.bfloat16) for k, v in loaded.weights.items()}
    eng = TorchEngine(loaded, device="cpu", speculative=False)     # tiny matrices: below MIN_WEIGHTS_16BIT
    list(eng.generate("a b c", max_new_tokens=4))
    eng.close()
    assert results and all(r is None for r in results)
    x = torch.zeros(1, 8)
    assert real(x, {}, 1e-6, 1, 1, x[0], x[0], torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8),
                torch.zeros(1, dtype=torch.int64), 0) is None                       # float32


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generation_through_the_ffn_call_matches_the_tensor_path(tiny_model, dtype, monkeypatch):
    """The dense FFN as one native call (`kernels.ffn_layer`: norm, gate and up, silu times up, down, the
    residual add) gives the tensor path's logits at every step, the prompt's rows included."""
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "MIN_WEIGHTS_16BIT", 0)
    monkeypatch.setenv("SLIPSTREAM_CPU_ATTENTION_CALL", "0")      # (the FFN call alone)
    calls = []
    real = kernels.ffn_layer
    monkeypatch.setattr(kernels, "ffn_layer", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    path = tiny_model("llama3")
    tokens, steps, layers, _ = decode_logged(path, dtype, "a b c", 12)
    assert sum(c is not None for c in calls) == layers * len(steps)       # every step's FFNs, the prompt's too
    old = kernels.set_ffn_call(False)
    try:
        calls.clear()
        tokens_off, steps_off, _, _ = decode_logged(path, dtype, "a b c", 12)
    finally:
        kernels.set_ffn_call(old)
    assert not any(c is not None for c in calls)
    assert tokens == tokens_off and all(torch.equal(a, b) for a, b in zip(steps, steps_off))


def test_the_attention_call_runs_its_jobs_at_torchs_thread_count(monkeypatch):
    """The call's matmul jobs run on the library's pool; like every other call it sets the pool to torch's
    thread count first. Without that, a process whose first native call was this one ran it on one thread
    (the H200 host's profile measured the one-token attention block at 7.7 ms against 0.6-0.8 for the call
    on 16 threads, session 17)."""
    from engine.sharding import measure

    if not kernels.attention_ready():
        pytest.skip("no native attention kernel here")
    synced = []
    real = kernels._sync_threads
    monkeypatch.setattr(kernels, "_sync_threads", lambda lib: synced.append(1) or real(lib))
    sizes = measure.Sizes(hidden=256, ffn=512, vocab=256, heads=4, head_dim=64, ctx=32, tokens=(1,), min_time_s=0.01,
                          rotate_bytes=1 << 20, dtypes=("bfloat16",), kv_heads=2)
    ab = measure._attention_blocks(sizes, ctx=32, n_max=1)
    pool = ab.kv.pools[0]
    cos, sin, _ = ab.steps[1]
    synced.clear()                       # (setting the cache up may make native calls of its own: its copies)
    y = kernels.attention_decode(torch.randn(1, 256, dtype=torch.bfloat16), ab.blocks[0], 1e-5, 4, 2, cos[0], sin[0],
                                 pool.parts[0], pool.parts[1], ab.kv.decode_table(ab.seq, 33), 32)
    assert y is not None and synced == [1]


def _batched(path, dtype: str, monkeypatch, call: str, batch: str = "1"):
    """Four prompts of different lengths generated together on the CPU (steps run here, one by one):
    (each request's tokens, the logits of every step that decoded several sequences, the calls of
    attention_decode_many that returned a result, the KV pools at the end)."""
    from engine.backends.torch_engine import TorchEngine
    from engine.loading import load_model

    monkeypatch.setenv("SLIPSTREAM_CPU_ATTENTION_CALL", call)
    monkeypatch.setenv("SLIPSTREAM_CPU_ATTENTION_BATCH", batch)
    loaded = load_model(path)
    loaded.config = dataclasses.replace(loaded.config, dtype=dtype)
    loaded.weights = {k: v.to(getattr(torch, dtype)) for k, v in loaded.weights.items()}
    eng = TorchEngine(loaded, device="cpu", speculative=False)
    steps, many = [], []
    fb = eng.executor.forward_batch

    def forward_batch(items):
        out = fb(items)
        if len(items) > 1 and all(len(it.ids) == 1 for it in items):
            steps.append(torch.cat(out).clone())
        return out

    real = kernels.attention_decode_many
    monkeypatch.setattr(kernels, "attention_decode_many",
                        lambda *a, **k: (y := real(*a, **k)) is not None and many.append(a[0].shape[0]) or y)
    eng.executor.forward_batch = forward_batch
    prompts = ["a b c", "d e f g h i j k l m n o p q r s t", "u v", "w x y z a b c d e f g"]
    handles = [eng.submit(p, max_new_tokens=10, background=False) for p in prompts]
    while eng.step_batch():
        pass
    tokens = [h.result().token_ids for h in handles]
    pools = [[p.clone() for p in pool.parts] for pool in eng.executor.kv.pools if pool.parts is not None]
    eng.close()
    return tokens, steps, many, pools


@needs_kernel
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_batch_of_decode_tokens_in_one_call_matches_the_tensor_path(tiny_model, arch, dtype, monkeypatch):
    """A continuous batch's decode tokens (several sequences at different positions) through one native call
    (`kernels.attention_decode_many`) give the tensor path's logits at every step and leave the same cache."""
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "MIN_WEIGHTS_16BIT", 0)
    path = tiny_model(arch)
    tokens, steps, many, pools = _batched(path, dtype, monkeypatch, "1")
    assert steps and many and max(many) == 4                # the batch's decode steps went through the call
    tokens_off, steps_off, many_off, pools_off = _batched(path, dtype, monkeypatch, "0")
    assert not many_off
    assert not _batched(path, dtype, monkeypatch, "1", batch="0")[2]     # (the A/B switch of the batched call)
    assert tokens == tokens_off
    assert len(steps) == len(steps_off) and all(torch.equal(a, b) for a, b in zip(steps, steps_off))
    assert all(torch.equal(a, b) for la, lb in zip(pools, pools_off) for a, b in zip(la, lb))


@needs_kernel
def test_the_batched_call_refuses_two_tokens_on_one_cache_row():
    """Two tokens whose tables and positions name one pool row would race on it: None, nothing written."""
    from engine.sharding import measure

    sizes = measure.Sizes(hidden=256, ffn=512, vocab=256, heads=4, head_dim=64, ctx=32, tokens=(1,), min_time_s=0.01,
                          rotate_bytes=1 << 20, dtypes=("bfloat16",), kv_heads=2)
    ab = measure._attention_blocks(sizes, ctx=32, n_max=1)
    pool = ab.kv.pools[0]
    cos, sin, _ = ab.steps[1]
    table = ab.kv.decode_table(ab.seq, 33)
    before = [p.clone() for p in pool.parts]
    two = torch.cat([cos[:1], cos[:1]]), torch.cat([sin[:1], sin[:1]])
    y = kernels.attention_decode_many(torch.randn(2, 256, dtype=torch.bfloat16), ab.blocks[0], 1e-5, 4, 2, *two,
                                      pool.parts[0], pool.parts[1], [table, table], [32, 32])
    assert y is None and all(torch.equal(a, b) for a, b in zip(pool.parts, before))
    one = kernels.attention_decode_many(torch.randn(2, 256, dtype=torch.bfloat16), ab.blocks[0], 1e-5, 4, 2, *two,
                                        pool.parts[0], pool.parts[1], [table, table], [32, 31])
    assert one is not None and one.shape == (2, 256)
