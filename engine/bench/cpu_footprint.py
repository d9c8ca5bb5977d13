"""CPU decode speed of the engine's FFN block against how much weight memory it cycles through, and how
that memory was allocated.

The profile times a one-token FFN block over a rotation of a few hundred MiB; a decode step reads every
CPU block once (about 11 GB for the Llama-3-8B shape). If the caches or the TLB favour the small
rotation, the profile over-rates the CPU. This runs the same block over 1, 2, 4 ... distinct blocks, with
the weights in (a) pinned buffers as the executor packs them, (b) ordinary pageable buffers, (c) ordinary
buffers advised to transparent huge pages and then registered with CUDA (pinned in place), and between
GPU work (a small kernel and a wait before every block, as a mixed decode plan alternates).

    python -m engine.bench.cpu_footprint --blocks 1,2,4,32 --out DIR
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report

H, F = 4096, 14336                  # Llama-3-8B
BLOCK = 3 * H * F * 2               # bf16 bytes of one FFN block
MADV_HUGEPAGE = 14


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unavailable"


def system_info() -> dict:
    import subprocess

    def run(cmd):
        try:
            return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    lscpu = [ln for ln in run(["lscpu"]).splitlines()
             if any(k in ln for k in ("NUMA", "L1d", "L2", "L3", "Model name", "Thread", "Socket"))]
    return {"thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "lscpu": lscpu,
            "hugepages_meminfo": [ln for ln in _read("/proc/meminfo").splitlines() if "Huge" in ln],
            "torch_threads": torch.get_num_threads()}


class Region:
    """`count` FFN blocks' bytes, allocated per mode; `blocks()` gives the weight dicts."""

    def __init__(self, mode: str, count: int):
        self.mode, self.count, self._keep = mode, count, []
        if mode == "thp-registered":
            size = count * BLOCK
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_HUGEPAGE)
            flat = torch.frombuffer(mm, dtype=torch.uint8)
            self._fill(flat)
            if torch.cuda.is_available():
                err = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister failed: {err}")
                self._registered = addr
            self._keep += [mm, flat]
            self.bufs = [flat[i * BLOCK:(i + 1) * BLOCK] for i in range(count)]
        else:
            pin = mode == "pinned" and torch.cuda.is_available()
            self.bufs = []
            for _ in range(count):
                b = torch.empty(BLOCK, dtype=torch.uint8, pin_memory=pin)
                self._fill(b)
                self.bufs.append(b)

    @staticmethod
    def _fill(flat: torch.Tensor) -> None:
        pattern = (torch.randn(1 << 20, dtype=torch.bfloat16) * 0.02).view(torch.uint8)
        n = pattern.numel()
        for off in range(0, flat.numel(), n):
            m = min(n, flat.numel() - off)
            flat[off:off + m].copy_(pattern[:m])

    def blocks(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for b in self.bufs:
            w = b.view(torch.bfloat16)
            out.append({"ffn_norm.weight": torch.ones(H, dtype=torch.bfloat16),
                        "gate_up.weight": w[:2 * F * H].view(2 * F, H),
                        "down.weight": w[2 * F * H:].view(H, F)})
        return out

    def close(self) -> None:
        if getattr(self, "_registered", None) is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
        self.bufs = []
        self._keep = []


def time_blocks(blocks, n: int, min_s: float, gpu_between: bool) -> float:
    """Median ms per block over passes that each run blocks[0..n) once."""
    from engine.config import ModelConfig
    from engine.models.dense import ffn_block

    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=H, intermediate_size=F, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=H, dtype="bfloat16")
    x = torch.randn(1, H, dtype=torch.bfloat16)
    g = torch.randn(1024, 1024, device="cuda") if gpu_between else None
    for i in range(n):
        ffn_block(cfg, blocks[i], x)
    per, t_end = [], time.perf_counter() + min_s
    while time.perf_counter() < t_end or len(per) < 3:
        t = 0.0
        for i in range(n):
            if g is not None:
                (g @ g).sum().item()        # a GPU stretch and a wait, as between CPU sub-layers of a decode
            t0 = time.perf_counter()
            ffn_block(cfg, blocks[i], x)
            t += time.perf_counter() - t0
        per.append(t / n * 1e3)
    return statistics.median(per)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="1,2,4,32")
    ap.add_argument("--modes", default="pinned,plain,thp-registered")
    ap.add_argument("--min-s", type=float, default=1.5)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    from engine import kernels
    kernels.status(wait=True)
    counts = [int(c) for c in args.blocks.split(",")]
    info = system_info()
    print(info, flush=True)
    rows = []
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        region = Region(mode, max(counts))
        made_s = time.perf_counter() - t0
        blocks = region.blocks()
        for n in counts:
            for between in (False, True) if torch.cuda.is_available() else (False,):
                ms = time_blocks(blocks, n, args.min_s, between)
                row = {"mode": mode, "blocks": n, "footprint_gib": n * BLOCK / 2**30, "gpu_between": between,
                       "ms_per_block": round(ms, 3), "gbps": round(BLOCK / ms / 1e6, 1),
                       "alloc_fill_s": round(made_s, 1)}
                rows.append(row)
                print(f"{mode:>15} {n:>3} blocks ({row['footprint_gib']:.2f} GiB){' gpu-between' if between else '':<12}"
                      f" {ms:7.3f} ms/block {row['gbps']:6.1f} GB/s", flush=True)
        region.close()
        del blocks, region
    write_report(args.out, "cpu_footprint", {"system": info, "kernel": kernels.status(), "rows": rows},
                 "python -m engine.bench.cpu_footprint " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
