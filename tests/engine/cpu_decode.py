"""A logged greedy generation of a tiny model on the CPU (the tests of the native CPU calls compare two)."""

from __future__ import annotations

import dataclasses

import torch


def decode_logged(path, dtype: str, prompt: str = "a b c d e", max_new_tokens: int = 10):
    """Generate from the tiny model at `path` cast to `dtype` (the tiny models are float32) on the CPU:
    (tokens, each step's logits, layers, the KV pools' parts at the end)."""
    from engine.backends.torch_engine import TorchEngine
    from engine.loading import load_model

    loaded = load_model(path)
    loaded.config = dataclasses.replace(loaded.config, dtype=dtype)
    loaded.weights = {k: v.to(getattr(torch, dtype)) for k, v in loaded.weights.items()}
    eng = TorchEngine(loaded, device="cpu", speculative=False)
    steps = []
    fb = eng.executor.forward_batch

    def forward_batch(items):
        out = fb(items)
        steps.append(torch.cat(out).clone())      # (the sampler may change the logits it is given)
        return out

    eng.executor.forward_batch = forward_batch
    tokens = [e.token_id for e in eng.generate(prompt, max_new_tokens=max_new_tokens) if e.token_id is not None]
    pools = [[p.clone() for p in pool.parts] for pool in eng.executor.kv.pools if pool.parts is not None]
    layers = eng.config.num_layers
    eng.close()
    return tokens, steps, layers, pools
