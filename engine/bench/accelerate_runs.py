"""`accelerate` rows: Hugging Face transformers with accelerate's `device_map` offload, `max_memory` at the budget.

The model is built from its config on the CPU in bf16 with random weights (no checkpoint exists on the
GPU machine; `from_pretrained(device_map="auto", max_memory=...)` does the same two steps: infer the
device map, dispatch). Per budget: `infer_auto_device_map(max_memory={0: budget, "cpu": ...})` and
`dispatch_model`; prefill 512 and 4096 once each after a 16-token warm-up; decode of a few tokens (it
runs at about half a token per second: every offloaded weight crosses PCIe from pageable memory each
step) timed per token with a streamer; batches of 4 and 16 for two steps. Peak NVML of this process.
"""

from __future__ import annotations

import os
import time

from engine.bench.scenarios import BATCHES, PROMPTS
from engine.bench.vram_poll import VramPoller

DECODE_TOKENS = 4
BATCH_TOKENS = 2


def hf_config(scenario):
    """A transformers config of the scenario's shape (bf16)."""
    from engine.bench.gguf_shapes import gguf_shape

    s = gguf_shape(scenario.gguf_shape, scenario.layers)
    common = {"vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers,
                  "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
                  "max_position_embeddings": 8192, "tie_word_embeddings": False}
    if s.is_moe:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(intermediate_size=s.ffn, moe_intermediate_size=s.expert_ffn,
                              num_experts=s.experts, num_local_experts=s.experts,
                              num_experts_per_tok=s.experts_used, **common)
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=s.ffn, **common)


def build_model(cfg):
    """The model on the CPU in bf16 with random weights (init skipped): norms at one, the rest normal with the
    engine's benchmark deviations (`random_std`: values do not change speed, but a MoE model's routing must
    spread as a trained model's does)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.loading.random_init import random_std

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                p.fill_(1.0)
            else:
                _fill_normal(p, random_std(name))
        for name, b in model.named_buffers():
            if "inv_freq" in name:            # to_empty left it uninitialised: recompute as the model would
                dim = b.numel() * 2
                b.copy_(1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)))
    return model.eval()


FILL_CHUNK = 1 << 27        # elements drawn at once on the GPU (256 MiB of bf16)


def _fill_normal(p, std: float) -> None:
    """p ~ N(0, std), drawn on the GPU where there is one and copied in pieces: PyTorch draws 16-bit normals on
    the CPU at about 30 M values/s (session 14: 533 s for the Qwen3-30B-A3B shape's 15.6 G parameters on the
    H200 host, most of a device call)."""
    import torch

    if not torch.cuda.is_available():
        p.normal_(0.0, std)
        return
    flat = p.view(-1)
    for at in range(0, flat.numel(), FILL_CHUNK):
        part = flat[at:at + FILL_CHUNK]
        part.copy_(torch.empty(part.numel(), dtype=p.dtype, device="cuda").normal_(0.0, std))


class TokenClock:
    """A `generate` streamer that stamps each step (the first put is the prompt)."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def rate(self, batch: int = 1) -> float | None:
        s = self.stamps[2:]                    # skip the prompt and the first new token
        return batch * (len(s) - 1) / (s[-1] - s[0]) if len(s) > 1 else None


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model, device, vocab: int, batches=BATCHES) -> dict:
    import torch

    out: dict = {}
    with torch.no_grad():
        model(torch.randint(0, vocab, (1, 16), device=device))
        for n in PROMPTS:
            ids = torch.randint(0, vocab, (1, n), device=device)
            _sync(device)
            t = time.perf_counter()
            model(ids, use_cache=False)
            _sync(device)
            out[f"prefill{n}_tps"] = n / (time.perf_counter() - t)
        ids = torch.randint(0, vocab, (1, 16), device=device)
        clock = TokenClock()
        model.generate(ids, max_new_tokens=DECODE_TOKENS + 1, min_new_tokens=DECODE_TOKENS + 1, do_sample=False,
                       streamer=clock, pad_token_id=0)
        out["decode_tps"] = clock.rate()
        for b in batches:
            clock = TokenClock()
            ids = torch.randint(0, vocab, (b, 16), device=device)
            model.generate(ids, max_new_tokens=BATCH_TOKENS + 1, min_new_tokens=BATCH_TOKENS + 1,
                           do_sample=False, streamer=_BatchClock(clock), pad_token_id=0)
            out[f"decode_batch{b}_tps"] = clock.rate(b)
    return out


class _BatchClock:
    """Streamers take batch 1 only in some versions: stamp without looking at the values."""

    def __init__(self, clock: TokenClock):
        self.clock = clock

    def put(self, value) -> None:
        self.clock.put(None)

    def end(self) -> None:
        pass


def run_scenario(scenario, budgets, part, allowance: int, command: str, deadline, cpu_memory: str = "100GiB",
                 say=print) -> None:
    import torch

    todo = [(n, b) for n, b in budgets if not part.has(f"accelerate|{scenario.model}|{n}||")]
    if not todo:
        return
    cfg = hf_config(scenario)
    t0 = time.perf_counter()
    model = build_model(cfg)
    say(f"accelerate {scenario.model}: built on the CPU in {time.perf_counter() - t0:.0f} s")
    gpu = torch.cuda.is_available()
    from_accel = None
    if gpu:
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.hooks import remove_hook_from_module
        from_accel = (dispatch_model, infer_auto_device_map, remove_hook_from_module)
    for name, b in todo:
        if not deadline.allows(120):
            say(f"  deadline: accelerate {scenario.model} at {name} left for a later call")
            break
        row = {"system": "accelerate", "model": scenario.model, "budget": name, "budget_bytes": b,
               "allowance_bytes": allowance, "command": command,
               "note": (scenario.note + "; " if scenario.note else "")
                       + f"from_config + infer_auto_device_map/dispatch_model, bf16; decode over {DECODE_TOKENS} "
                         f"tokens, batches over {BATCH_TOKENS} steps"}
        with VramPoller([os.getpid()], 0.02) as poll:
            if from_accel is not None:
                dispatch_model, infer_auto_device_map, _remove_hook = from_accel
                dm = infer_auto_device_map(model, max_memory={0: b, "cpu": cpu_memory},
                                           no_split_module_classes=model._no_split_modules)
                on_gpu = sum(1 for v in dm.values() if v == 0)
                dispatch_model(model, device_map=dm, main_device=0)
                row["plan"] = {"modules_on_gpu": on_gpu, "modules": len(dm),
                               "device_map": {k: str(v) for k, v in dm.items()}}
                device = torch.device("cuda", 0)
            else:
                device = torch.device("cpu")
                row["plan"] = {"note": "dry run: no GPU, everything on the CPU"}
            t1 = time.perf_counter()
            row.update(measure(model, device, cfg.vocab_size))
            row["seconds"] = round(time.perf_counter() - t1, 1)
            if from_accel is not None:
                from_accel[2](model, recurse=True)      # detaching restores offloaded weights from the map
                model.to("cpu")
                torch.cuda.empty_cache()
                if any(p.device.type == "meta" for p in model.parameters()):
                    say(f"accelerate {scenario.model}: weights left on meta after undispatching; rebuilding")
                    model = build_model(cfg)
        peak = poll.peak(os.getpid()) if poll.available else None
        row.update(peak_vram_bytes=peak, fits=None if peak is None else peak <= b + allowance)
        part.add(row)
        say(f"  accelerate {scenario.model} {name}: prefill {row['prefill512_tps']:.0f}/{row['prefill4096_tps']:.0f}"
            f" t/s, decode {row['decode_tps'] or 0:.2f} t/s, peak NVML {(peak or 0) / 2**30:.2f} GiB")
    del model
