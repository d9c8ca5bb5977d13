"""Where the CPU's one-token attention and FFN layer calls spend their time, phase by phase, beside plain
matmuls of the same weights: for a CPU attention that ran slower than its bytes at the FFN's rate.

    python -m engine.bench.cpu_call_phases --shape llama3-8b --ctx 100 --reps 100 --out DIR
    python -m engine.bench.cpu_call_phases --shape tiny --reps 5 --out DIR        (a quick dry run)

Session 15's call PP traced Llama-3-8B at 4 GiB on the H200 host: a CPU attention call took 1.57 ms for 84 MB
of weights (53 GB/s) while a CPU FFN call took 4.53 ms for 352 MB (78 GB/s), both beside PCIe copies. One
layer's weights at full width (random bf16, several copies cycled so that no call finds its weights in the
caches), one token at context `--ctx`: the attention call (`kernels.attention_decode`) and the FFN call
(`kernels.ffn_layer`) with their phase timers on (`kernels.set_phase_timing`), then the same matmuls alone
(`kernels.linear`: the stacked q/k/v, the output, gate/up, down). Prints a table of milliseconds and GB/s
and writes cpu_call_phases.json (command, machine, date).

Session 16 (call SS) found both calls at their matmuls' rate alone (108 GB/s) on the H200 host, while
beside the decode's weight copies the attention call took 1.8x and the FFN call 1.4x. Two options take the
engine's conditions apart: `--pinned` keeps the weights in page-locked memory as the executor does beside a
GPU, and `--beside-copies` keeps pinned host -> GPU copies running on a side stream through every timed call
(as a decode streams weights), reporting their rate too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import kernels
from engine.bench.gpu_common import write_report
from engine.bench.shapes import get_shape

TINY = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "intermediate_size": 512}


def _dims(shape: str) -> dict:
    if shape == "tiny":
        return dict(TINY)
    cfg = get_shape(shape)
    return {"hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size}


def layer_weights(dims: dict, copies: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`copies` sets of one layer's attention and FFN weights (bf16, in the layout the executor hands the
    layer calls: q/k/v stacked, gate and up stacked)."""
    g = torch.Generator().manual_seed(seed)
    H, h, kvh, d, inter = (dims[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                             "intermediate_size"))

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    return [{"attn_norm.weight": torch.ones(H, dtype=torch.bfloat16), "qkv.weight": rnd((h + 2 * kvh) * d, H),
             "o.weight": rnd(H, h * d), "ffn_norm.weight": torch.ones(H, dtype=torch.bfloat16),
             "gate_up.weight": rnd(2 * inter, H), "down.weight": rnd(H, inter)} for _ in range(copies)]


class Copier:
    """Pinned host -> GPU copies kept running on a side stream (`top_up` before each timed call keeps two
    batches queued): the decode's weight streaming, without its compute. `gbps()`: their rate so far."""

    BATCH = 4

    def __init__(self, mib: int = 256):
        self.host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
        self.host.fill_(1)
        self.dev = torch.empty_like(self.host, device="cuda")
        self.stream = torch.cuda.Stream()
        self.batches: list = []
        self.copied, self.t0 = 0, None

    def top_up(self) -> None:
        self.batches = [e for e in self.batches if not e.query()]
        while len(self.batches) < 2:
            with torch.cuda.stream(self.stream):
                for _ in range(self.BATCH):
                    self.dev.copy_(self.host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self.batches.append(ev)
            self.copied += self.BATCH * self.host.numel()
            if self.t0 is None:
                self.t0 = time.perf_counter()

    def gbps(self) -> float | None:
        """Bytes done over the time since the first batch (the queued ones are waited for)."""
        if self.t0 is None:
            return None
        self.stream.synchronize()
        return self.copied / (time.perf_counter() - self.t0) / 1e9


def _mean_ms(f, reps: int, copier: Copier | None = None) -> tuple[float, list[float]]:
    times = []
    for _ in range(reps):
        if copier is not None:
            copier.top_up()
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.mean(times), times


def _pinned(sets: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The weight sets moved into page-locked host memory (each set one buffer, as the executor packs a
    sub-layer's tensors)."""
    out = []
    for ws in sets:
        total = sum(t.numel() * 2 for t in ws.values())
        buf = torch.empty(total // 2, dtype=torch.bfloat16, pin_memory=True)
        at, one = 0, {}
        for k, t in ws.items():
            one[k] = buf[at:at + t.numel()].view(t.shape)
            one[k].copy_(t)
            at += t.numel()
        out.append(one)
    return out


def measure(dims: dict, ctx: int, reps: int, copies: int, pinned: bool = False, beside_copies: bool = False) -> dict:
    H, h, kvh, d = (dims[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"))
    sets = layer_weights(dims, copies)
    if pinned:
        sets = _pinned(sets)
    copier = Copier() if beside_copies else None
    blocks = -(-(ctx + 1) // kernels.KV_BLOCK)
    k_pool = (torch.randn(blocks, kernels.KV_BLOCK, kvh, d) * 0.5).to(torch.bfloat16)
    v_pool = (torch.randn(blocks, kernels.KV_BLOCK, kvh, d) * 0.5).to(torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int64)
    cos, sin = torch.ones(d, dtype=torch.bfloat16), torch.zeros(d, dtype=torch.bfloat16)
    x = torch.randn(1, H).to(torch.bfloat16)
    turn = iter(range(1 << 30))

    def w() -> dict[str, torch.Tensor]:
        return sets[next(turn) % len(sets)]

    def attention():
        if kernels.attention_decode(x, w(), 1e-5, h, kvh, cos, sin, k_pool, v_pool, table, ctx) is None:
            raise RuntimeError("the attention call does not apply here (no native library or vector kernel)")

    def ffn():
        if kernels.ffn_layer(x, w(), 1e-5) is None:
            raise RuntimeError("the FFN call does not apply here")

    hx = x.clone()
    inter_x = torch.randn(1, dims["intermediate_size"]).to(torch.bfloat16)
    att_x = torch.randn(1, h * d).to(torch.bfloat16)
    plain = (("q/k/v matmul", "qkv.weight", hx), ("output matmul", "o.weight", att_x),
             ("gate/up matmul", "gate_up.weight", hx), ("down matmul", "down.weight", inter_x))
    # A warm-up round of everything first: here the first few dozen calls of a fresh process ran up to 1.6x
    # slower than the rest (new weight pages, the pool's first jobs), whatever came first.
    for _ in range(max(10, reps // 2)):
        attention()
        ffn()
        for _, wname, inp in plain:
            kernels.linear(inp, w()[wname])
    out: dict = {}
    kernels.set_phase_timing(True)
    try:
        for name, f, key in (("attention call", attention, "attention"), ("FFN call", ffn, "ffn")):
            kernels.read_phases()
            ms, _ = _mean_ms(f, reps, copier)
            ph = kernels.read_phases()
            calls = max(ph[f"{key}_calls"], 1)
            out[name] = {"ms": ms, "phases_ms": {p: s * 1e3 / calls for p, s in ph[key].items()}}
    finally:
        kernels.set_phase_timing(False)
    for name, wname, inp in plain:
        ms, _ = _mean_ms(lambda wname=wname, inp=inp: kernels.linear(inp, w()[wname]), reps, copier)
        out[name] = {"ms": ms, "bytes": sets[0][wname].numel() * 2}
    if copier is not None:
        out["copies beside"] = {"gbps_copy": copier.gbps()}
    att_bytes = sum(sets[0][k].numel() * 2 for k in ("attn_norm.weight", "qkv.weight", "o.weight"))
    ffn_bytes = sum(sets[0][k].numel() * 2 for k in ("ffn_norm.weight", "gate_up.weight", "down.weight"))
    out["attention call"]["bytes"], out["FFN call"]["bytes"] = att_bytes, ffn_bytes
    for r in out.values():
        if "ms" in r:
            r["gbps"] = r["bytes"] / r["ms"] / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.cpu_call_phases", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", help="a shape of engine.bench.shapes, or tiny (a dry run)")
    ap.add_argument("--ctx", type=int, default=100, help="the token's position (context before it)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--copies", type=int, default=0,
                    help="weight sets cycled through (0: enough for 2 GB, at most 24, so the caches hold none)")
    ap.add_argument("--pinned", action="store_true", help="weights in page-locked memory, as beside a GPU")
    ap.add_argument("--beside-copies", action="store_true",
                    help="pinned host -> GPU copies running through every timed call (needs CUDA)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    if (args.pinned or args.beside_copies) and not torch.cuda.is_available():
        print("--pinned and --beside-copies need CUDA", file=sys.stderr)
        return 1
    if not kernels.set_phase_timing(False):
        print("the native CPU library is not available here", file=sys.stderr)
        return 1
    dims = _dims(args.shape)
    one = sum(t.numel() * 2 for t in layer_weights(dims, 1)[0].values())
    copies = args.copies or max(2, min(24, (2 << 30) // one))
    res = measure(dims, args.ctx, args.reps, copies, args.pinned, args.beside_copies)
    print(f"{args.shape}, one token at position {args.ctx}, {copies} weight sets cycled"
          f"{', pinned' if args.pinned else ''}{', beside copies' if args.beside_copies else ''}; "
          f"{kernels.status(wait=True)}")
    print("\n| what | ms | MB | GB/s |\n|---|---|---|---|")
    for name, r in res.items():
        if "ms" not in r:
            print(f"| {name} | | | {r['gbps_copy']:.1f} (host -> GPU) |")
            continue
        print(f"| {name} | {r['ms']:.3f} | {r['bytes'] / 1e6:.1f} | {r['gbps']:.1f} |")
        for p, ms in r.get("phases_ms", {}).items():
            print(f"| - {p} | {ms:.3f} | | |")
    path = write_report(args.out, "cpu_call_phases", {"shape": args.shape, "dims": dims, "ctx": args.ctx,
                                                       "pinned": args.pinned, "beside_copies": args.beside_copies,
                                                       "cpu_matmul": kernels.status(wait=True),
                                                       "reps": args.reps, "copies": copies, "results": res},
                        "python -m engine.bench.cpu_call_phases " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
