"""Which host memory serves both paths best: CPU GEMV speed and pinned host-to-device copy speed for
(a) `pin_memory` buffers, (b) ordinary buffers, (c) ordinary buffers advised to huge pages and then
registered with CUDA (page-locked in place).

    python -m engine.bench.host_memory_probe
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from engine.bench.gpu_common import h2d_gbps

ROWS, COLS = 14336, 4096
MADV_HUGEPAGE = 14


def gemv_gbps(w: torch.Tensor, reps: int = 30) -> float:
    x = torch.randn(1, w.shape[1], dtype=w.dtype)
    for _ in range(3):
        F.linear(x, w)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            F.linear(x, w)
        runs.append(w.numel() * w.element_size() * reps / (time.perf_counter() - t0) / 1e9)
    return statistics.median(runs)



def registered(nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes + (2 << 20), dtype=torch.uint8)
    addr = buf.data_ptr()
    aligned = (addr + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    view = buf[aligned - addr:aligned - addr + nbytes]
    libc = ctypes.CDLL("libc.so.6")
    libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    view.fill_(0)
    rc = torch.cuda.cudart().cudaHostRegister(aligned, nbytes, 0)
    assert int(rc) == 0, rc
    view._keepalive = buf
    return view


def main() -> int:
    nbytes = ROWS * COLS * 2
    src = torch.randn(ROWS, COLS, dtype=torch.bfloat16)
    kinds = {"ordinary": src.clone()}
    if torch.cuda.is_available():
        kinds["pin_memory"] = src.pin_memory()
        r = registered(nbytes)
        r.copy_(src.view(-1).view(torch.uint8))
        kinds["hugepage+cudaHostRegister"] = r.view(torch.bfloat16).view(ROWS, COLS)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    print(f"threads {torch.get_num_threads()}; THP {thp}")
    print("| host memory | CPU GEMV GB/s | H2D GB/s |\n|---|---|---|")
    for name, w in kinds.items():
        h2d = h2d_gbps(w) if torch.cuda.is_available() and name != "ordinary" else float("nan")
        print(f"| {name} | {gemv_gbps(w):.1f} | {h2d:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
