"""PCIe measurements for the profile: pinned copies alone, copies and CPU compute at the same time, and
the cost of moving a small activation between CPU and GPU, all as the executor does them.

Copies run on a side stream from pinned host memory; the host never spins while waiting (it polls a CUDA
event with a short sleep), because a spinning waiter steals a core from every OpenMP region of the CPU's
matmuls (measured: 4x slower CPU GEMV beside a spinning `synchronize()`).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from engine.sharding.measure import Sizes, _Steps, _wait, ffn_block_pass, gemv_pass, time_host


def copy_gbps(dst: torch.Tensor, src: torch.Tensor, stream, reps: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        stop.record(stream)
    _wait(stop)
    return reps * src.numel() * src.element_size() / (start.elapsed_time(stop) / 1e3) / 1e9


def _move_latency_us(device, hidden: int) -> float:
    """One activation move each way (16 tokens of bf16 hidden state), as the executor moves them:
    host -> device, then device -> host after polling the compute stream's event."""
    x = torch.randn(16, hidden, dtype=torch.bfloat16)

    def roundtrip(_i: int) -> None:
        xd = x.to(device)
        ev = torch.cuda.Event()
        ev.record()
        _wait(ev)
        xd.to("cpu")

    return time_host(roundtrip, 0.1, min_reps=10) / 2 * 1e6


def link_section(sizes: Sizes, device, step: _Steps) -> dict:
    """h2d/d2h GB/s alone, h2d GB/s while the CPU runs GEMVs, the CPU's GEMV rate while copies run."""
    nbytes = sizes.copy_bytes
    step("pinned host-to-device bandwidth")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    copy_gbps(dev, host, stream, 1)
    h2d = statistics.median(copy_gbps(dev, host, stream, 2) for _ in range(3))
    step("pinned device-to-host bandwidth")
    d2h = statistics.median(copy_gbps(host, dev, stream, 2) for _ in range(3))
    step("activation move latency")
    latency = _move_latency_us(device, sizes.hidden)

    step("cpu GEMV and copies at the same time")
    gemv, gemv_bytes = gemv_pass(sizes)
    cpu_alone = gemv_bytes / time_host(gemv, sizes.min_time_s) / 1e9
    cpu_with, copy_rates = beside_copies(gemv, gemv_bytes, cpu_alone, dev, host, stream, h2d)
    extra = {}
    block = ffn_block_pass(sizes)        # (the GPU sizes with pinned weights, as the executor keeps them)
    if block is not None:
        # The rate the estimator needs: a CPU FFN block (what decode runs on the CPU) while copies run.
        step("cpu FFN blocks and copies at the same time")
        fn, block_bytes = block
        alone = block_bytes / time_host(fn, sizes.min_time_s) / 1e9
        extra["cpu_block_with_copy_gbps"] = round(
            beside_copies(fn, block_bytes, alone, dev, host, stream, h2d)[0], 3)
    del host, dev
    return {"h2d_gbps": round(h2d, 3), "d2h_gbps": round(d2h, 3),
            "h2d_with_cpu_gbps": round(statistics.median(copy_rates), 3),
            "cpu_gemv_gbps": round(cpu_alone, 3), "cpu_gemv_with_copy_gbps": round(cpu_with, 3),
            "cpu_with_copy_factor": round(min(1.0, max(0.05, cpu_with / cpu_alone)), 4),
            "latency_us": round(latency, 2), **extra}


def beside_copies(fn, nbytes: int, alone_gbps: float, dev, host, stream, h2d: float) -> tuple[float, list[float]]:
    """(CPU GB/s of `fn` while back-to-back copies run, the copies' GB/s): copies enough to cover about ten
    CPU passes (and at least 0.2 s), CPU work until they end, three times, medians."""
    target_s = max(0.2, 10 * nbytes / (alone_gbps * 1e9))
    reps = max(2, math.ceil(target_s * h2d * 1e9 / host.numel()))
    cpu_rates, copy_rates = [], []
    for _ in range(3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(reps):
                dev.copy_(host, non_blocking=True)
            stop.record(stream)
        t0, done, i = time.perf_counter(), 0, 0
        while not stop.query():      # CPU work until the copies end; query() never blocks
            fn(i)
            done += nbytes
            i += 1
        t_cpu = time.perf_counter() - t0
        _wait(stop)
        if done:
            cpu_rates.append(done / t_cpu / 1e9)
        copy_rates.append(reps * host.numel() / (start.elapsed_time(stop) / 1e3) / 1e9)
    return (statistics.median(cpu_rates) if cpu_rates else alone_gbps), copy_rates


def probe_rates(weight_mib: int = 1024, copy_mib: int = 256, min_s: float = 0.3, device=None) -> dict:
    """The four rates a plan is balanced on, measured now as `link_section` measures them (a few seconds):
    the CPU's one-token GEMV over `weight_mib` of FFN-shaped pinned weights alone and while back-to-back
    pinned host -> GPU copies of `copy_mib` run, and those copies alone and beside it. Without CUDA only
    the CPU rate (the others None). `ProfileDatabase.at_rates` moves a profile to them."""
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    sizes = Sizes(hidden=4096, ffn=14336, vocab=0, heads=32, head_dim=128, ctx=0, tokens=(1,), min_time_s=min_s,
                  rotate_bytes=weight_mib << 20, copy_bytes=copy_mib << 20, dtypes=("bfloat16",), pinned=cuda)
    fn, nbytes = gemv_pass(sizes)
    alone = nbytes / time_host(fn, min_s) / 1e9
    out = {"cpu_gemv_gbps": round(alone, 2), "cpu_gemv_with_copy_gbps": None, "h2d_gbps": None,
           "h2d_with_cpu_gbps": None}
    if cuda:
        where = torch.device(device if device is not None else "cuda")
        host = torch.empty(copy_mib << 20, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        dev, stream = torch.empty_like(host, device=where), torch.cuda.Stream(where)
        copy_gbps(dev, host, stream, 1)
        h2d = statistics.median(copy_gbps(dev, host, stream, 2) for _ in range(3))
        with_copy, copies = beside_copies(fn, nbytes, alone, dev, host, stream, h2d)
        out.update(cpu_gemv_with_copy_gbps=round(with_copy, 2), h2d_gbps=round(h2d, 2),
                   h2d_with_cpu_gbps=round(statistics.median(copies), 2))
        del host, dev
    del fn
    return out
