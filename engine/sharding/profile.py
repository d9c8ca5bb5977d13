"""The profile database: what this machine's CPU, GPU and PCIe link achieve, as the estimator asks for it.

`ProfileDatabase.for_device(device)` returns the profile of "cuda[:N]" or "cpu" from the database file
(see `profile_store`), measuring it first when there is none for this hardware fingerprint (or when asked
to re-measure); "sim" returns `ProfileDatabase.sim()`, a synthetic, deterministic profile: a notional client
GPU (20 TFLOP/s bf16 and fp16, 10 TFLOP/s fp32, 400 GB/s memory, 25 GB/s PCIe, 20 us per activation move)
beside a default CPU (30 GB/s weight streaming, 0.4 TFLOP/s bf16, 0.2 fp16, 0.6 fp32; CPU work runs at
0.85x while copies run), so plans on "sim" are the same on every machine.

Queries price work in milliseconds: `gemm_ms` (tables of achieved GFLOP/s by dtype, shape class and
token count, interpolated log-log between measured token counts and flat past the last; on load, a
section's tables are scaled by its `block_factor` (the engine's own CPU FFN block timed against the
tables' prediction; the "attn" class by `attn_block_factor` instead where the profile has it: the scale
that makes the estimator's attention sub-layer match the engine's own CPU attention block) and made
monotone, so that more tokens never take less time), `attention_ms`
(roofline of KV bytes read and FLOPs), `op_ms` (per-kernel overhead), `copy_ms` (weights over PCIe,
alone or beside CPU work) and `move_ms` (an activation crossing between CPU and GPU).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from engine.sharding import profile_store

Progress = Callable[[float, str], None]   # (fraction done, what runs now)
SIM_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
CLASSES = ("attn", "ffn", "head")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_FALLBACK = {"bfloat16": ("bfloat16", "float16", "float32"),
                   "float16": ("float16", "bfloat16", "float32"),
                   "float32": ("float32", "bfloat16", "float16")}


def _roofline_section(name: str, gbps: float, peak: dict[str, float], attn_gbps: float,
                      attn_gflops: dict[str, float], overhead_us: float) -> dict:
    """A synthetic device: GEMM rate(n) = min(peak FLOP/s, n x 2 x bandwidth / dtype bytes)."""
    gemm = {dt: {c: [[n, round(min(p, n * 2 * gbps / _DTYPE_BYTES[dt]), 4)] for n in SIM_TOKENS]
                 for c in CLASSES} for dt, p in peak.items()}
    attn = {dt: {"gbps": attn_gbps, "gflops": attn_gflops[dt]} for dt in peak}
    return {"name": name, "gemm": gemm, "attention": attn, "op_overhead_us": overhead_us, "mem_gbps": gbps}


def sim_profile_dict() -> dict:
    gpu = _roofline_section("sim: notional client GPU (20 TFLOP/s bf16, 400 GB/s, 25 GB/s PCIe)", 400.0,
                            {"bfloat16": 20000.0, "float16": 20000.0, "float32": 10000.0}, 320.0,
                            {"bfloat16": 10000.0, "float16": 10000.0, "float32": 5000.0}, 6.0)
    cpu = _roofline_section("sim: default CPU (30 GB/s, 0.4 TFLOP/s bf16)", 30.0,
                            {"bfloat16": 400.0, "float16": 200.0, "float32": 600.0}, 20.0,
                            {"bfloat16": 100.0, "float16": 60.0, "float32": 150.0}, 4.0)
    cpu.update(threads=8, threads_gbps={"1": 6.0, "2": 12.0, "4": 22.0, "8": 30.0})
    link = {"h2d_gbps": 25.0, "d2h_gbps": 25.0, "h2d_with_cpu_gbps": 24.0, "cpu_gemv_gbps": 30.0,
            "cpu_gemv_with_copy_gbps": 25.5, "cpu_with_copy_factor": 0.85, "latency_us": 20.0}
    return {"schema": profile_store.SCHEMA, "device": "sim", "quick": False, "created": "synthetic",
            "fingerprint": {"schema": profile_store.SCHEMA, "device": "sim"},
            "cpu": cpu, "gpu": gpu, "link": link}


def _factor_curve(points: dict) -> Callable[[int], float]:
    """n -> calibration factor, log-linear between the measured token counts, flat outside."""
    pts = sorted((math.log(int(n)), float(f)) for n, f in points.items() if int(n) >= 1 and float(f) > 0)
    if not pts:
        return lambda n: 1.0

    def at(n: int) -> float:
        x = math.log(max(n, 1))
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, f0), (x1, f1) in itertools.pairwise(pts):
            if x <= x1:
                return f0 + (f1 - f0) * (x - x0) / (x1 - x0)
        return pts[-1][1]

    return at


def _monotone_table(rows: list) -> tuple[list[float], list[float]]:
    """(log n, log rate) with time per step n / rate(n) made non-decreasing in n."""
    pts = sorted((int(n), float(r)) for n, r in rows if int(n) >= 1 and float(r) > 0)
    if not pts:
        raise ValueError("empty GEMM table")
    ns, rates = [pts[0][0]], [pts[0][1]]
    for n, r in pts[1:]:
        if n == ns[-1]:
            continue
        rates.append(min(r, rates[-1] * n / ns[-1]))
        ns.append(n)
    return [math.log(n) for n in ns], [math.log(r) for r in rates]


class ProfileDatabase:
    """One machine's measured (or synthetic) rates; see the module docstring."""

    def __init__(self, data: dict):
        self.data = data
        self.device: str = data["device"]
        self.cpu: dict = data["cpu"]
        self.gpu: dict | None = data.get("gpu")
        self.link: dict | None = data.get("link")
        self._tables: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
        for where, sec in (("cpu", self.cpu), ("gpu", self.gpu)):
            if sec is None:
                continue
            factor = _factor_curve(sec.get("block_factor") or {})
            # The attention projections' table has its own factor where the attention block was measured
            # (at a few tokens; past them it joins the FFN factor's points, where the matmuls dominate).
            attn, points = factor, sec.get("attn_block_factor")
            if points:
                top = max(int(n) for n in points)
                attn = _factor_curve({**{n: f for n, f in (sec.get("block_factor") or {}).items()
                                         if int(n) > top}, **points})
            for dtype, classes in sec["gemm"].items():
                for cls, rows in classes.items():
                    f = attn if cls == "attn" else factor
                    scaled = [[n, r / f(int(n))] for n, r in rows]
                    self._tables[(where, dtype, cls)] = _monotone_table(scaled)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> ProfileDatabase:
        return cls(data)

    def to_dict(self) -> dict:
        return self.data

    def at_rates(self, rates: dict, limits: tuple[float, float] = (0.5, 2.0)) -> ProfileDatabase:
        """This profile with its CPU and PCIe rates moved to `rates`, measured now
        (`measure_link.probe_rates`: cpu_gemv_gbps, cpu_gemv_with_copy_gbps, h2d_gbps, h2d_with_cpu_gbps).

        The same kind of machine differs from one hour to the next (the H200 leases' one-token CPU matmuls
        read 88-128 GB/s, the profile 109), and a desktop's free memory bandwidth moves with what else runs,
        so a plan balanced on the stored rates can leave one side idle. Each CPU table (matmuls, experts,
        attention over the KV, memory) is scaled by the CPU factor, the CPU-beside-copies rates by theirs,
        the copies by theirs; each factor is held within `limits` (a probe disturbed by something else must
        not plan a machine twice as fast or slow). The result records the factors under "rates_scaled"."""
        link = self.link or {}
        base = {k: link.get(k) for k in ("cpu_gemv_gbps", "cpu_gemv_with_copy_gbps", "h2d_gbps", "h2d_with_cpu_gbps")}

        def factor(key: str) -> float:
            got, had = rates.get(key), base.get(key)
            if not got or not had:
                return 1.0
            return min(limits[1], max(limits[0], float(got) / float(had)))

        f_cpu, f_cc, f_h2d, f_hc = (factor(k) for k in base)
        data = copy.deepcopy(self.data)
        cpu = data["cpu"]
        for classes in cpu["gemm"].values():
            for cls_name, rows in classes.items():
                classes[cls_name] = [[n, r * f_cpu] for n, r in rows]
        for dtype, rows in (cpu.get("experts") or {}).items():
            cpu["experts"][dtype] = [[n, r * f_cpu] for n, r in rows]
        for r in cpu["attention"].values():
            r["gbps"] *= f_cpu
        cpu["mem_gbps"] *= f_cpu
        idle = cpu.get("ffn_block_idle")
        if idle and "hot_ms" in idle and "after_idle_ms" in idle:
            idle["hot_ms"] /= f_cpu
            idle["after_idle_ms"] /= f_cpu
        if data.get("link"):
            lk = data["link"]
            lk["cpu_gemv_gbps"] *= f_cpu
            lk["cpu_gemv_with_copy_gbps"] *= f_cc
            if lk.get("cpu_block_with_copy_gbps"):
                lk["cpu_block_with_copy_gbps"] *= f_cc
            lk["cpu_with_copy_factor"] = min(1.0, max(0.05, lk["cpu_with_copy_factor"] * f_cc / f_cpu))
            lk["h2d_gbps"] *= f_h2d
            lk["d2h_gbps"] = lk.get("d2h_gbps", base["h2d_gbps"]) * f_h2d
            lk["h2d_with_cpu_gbps"] *= f_hc
        data["rates_scaled"] = {"cpu": round(f_cpu, 4), "cpu_with_copy": round(f_cc, 4), "h2d": round(f_h2d, 4),
                                "h2d_with_cpu": round(f_hc, 4), "rates": dict(rates)}
        return type(self)(data)

    @classmethod
    def sim(cls, cpu: ProfileDatabase | None = None) -> ProfileDatabase:
        """The synthetic "sim" profile; with `cpu`, that profile's measured CPU section replaces the
        default CPU (plans then depend on this machine's CPU, so tests use the default)."""
        data = sim_profile_dict()
        if cpu is not None:
            data["cpu"] = cpu.cpu
            data["created"] = f"synthetic GPU, CPU measured {cpu.data.get('created', '?')}"
        return cls(data)

    @classmethod
    def for_device(cls, device: str = "sim", quick: bool = True, progress: Progress | None = None,
                   path: Path | None = None, remeasure: bool = False) -> ProfileDatabase:
        """The profile of `device` ("sim" | "cpu" | "cuda" | "cuda:N" | "auto"): cached, else measured."""
        device = normalize_device(device)
        if device == "sim":
            return cls.sim()
        _require_cuda(device)
        fp = profile_store.fingerprint(device)
        key = profile_store.fingerprint_key(fp)
        path = Path(path) if path is not None else profile_store.db_path()
        if not remeasure:
            entry = profile_store.load_db(path)["profiles"].get(key)
            if entry and entry.get("fingerprint") == fp and (quick or not entry.get("quick", True)):
                try:
                    return cls(entry)
                except (KeyError, TypeError, ValueError) as exc:
                    logging.getLogger(__name__).warning("profile entry %s unusable (%s); measuring", key, exc)
        data = measure_profile(device, quick=quick, progress=progress)
        data["fingerprint"] = fp
        prof = cls(data)
        try:
            profile_store.save_profile(path, key, data)
        except OSError as exc:
            logging.getLogger(__name__).warning("could not write the profile database %s: %s", path, exc)
        return prof

    # ---- queries -------------------------------------------------------------------------------
    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.link is not None

    def _section(self, where: str) -> dict:
        sec = self.cpu if where == "cpu" else self.gpu
        if sec is None:
            raise ValueError(f"profile of {self.device!r} has no {where} section")
        return sec

    def gemm_gflops(self, where: str, dtype: str, cls: str, n_tokens: int) -> float:
        """Achieved GFLOP/s of a `cls`-shaped matmul with `n_tokens` rows on `where` ("cpu" | "gpu")."""
        for dt in _DTYPE_FALLBACK.get(dtype, (dtype, "float32")):
            table = self._tables.get((where, dt, cls)) or self._tables.get((where, dt, "ffn"))
            if table is not None:
                break
        else:
            raise ValueError(f"profile of {self.device!r} has no {where} matmul table for {dtype}")
        xs, ys = table
        x = math.log(max(n_tokens, 1))
        if x <= xs[0]:
            return math.exp(ys[0])
        if x >= xs[-1]:
            return math.exp(ys[-1])
        i = bisect_right(xs, x) - 1
        f = (x - xs[i]) / (xs[i + 1] - xs[i])
        return math.exp(ys[i] + f * (ys[i + 1] - ys[i]))

    def experts_gflops(self, dtype: str, rows: float) -> float | None:
        """Achieved GFLOP/s of the CPU's native expert jobs (a step's routed experts in one job, `rows`
        each on average), or None where the profile has no such table for `dtype` or `rows` is past the
        rows it measured (the kernel does not take them: the engine runs those experts one by one)."""
        table = ((self.cpu or {}).get("experts") or {}).get(dtype)
        if not table or rows > table[-1][0]:
            return None
        xs, ys = _monotone_table(table)
        x = math.log(max(rows, 1.0))
        if x <= xs[0] or len(xs) == 1:
            return math.exp(ys[0])
        i = min(bisect_right(xs, x) - 1, len(xs) - 2)
        f = (x - xs[i]) / (xs[i + 1] - xs[i])
        return math.exp(ys[i] + f * (ys[i + 1] - ys[i]))

    def gemm_ms(self, where: str, dtype: str, cls: str, flops_per_token: float, n_tokens: int) -> float:
        if flops_per_token <= 0 or n_tokens <= 0:
            return 0.0
        return n_tokens * flops_per_token / (self.gemm_gflops(where, dtype, cls, n_tokens) * 1e6)

    def attention_ms(self, where: str, dtype: str, kv_bytes: float, flops: float) -> float:
        sec = self._section(where)["attention"]
        rates = next((sec[d] for d in _DTYPE_FALLBACK.get(dtype, (dtype,)) if d in sec), None)
        if rates is None:
            rates = next(iter(sec.values()))
        return max(kv_bytes / (rates["gbps"] * 1e6), flops / (rates["gflops"] * 1e6))

    def op_ms(self, where: str, n_ops: int) -> float:
        return n_ops * self._section(where)["op_overhead_us"] / 1e3

    @property
    def native_call_ms(self) -> float:
        """Host milliseconds of one native CPU kernel call beyond its arithmetic (waking the matmul pool and
        its barrier), from a call on a tiny matrix; 0 where the profile did not measure it."""
        return float((self.cpu or {}).get("native_call_us") or 0.0) / 1e3

    def mem_ms(self, where: str, nbytes: float) -> float:
        return nbytes / (self._section(where)["mem_gbps"] * 1e6)

    def copy_ms(self, nbytes: float, busy: bool = False) -> float:
        """Weights host -> GPU on the copy engine (`busy`: while the CPU computes)."""
        gbps = self.link["h2d_with_cpu_gbps"] if busy else self.link["h2d_gbps"]
        return nbytes / (gbps * 1e6)

    def move_ms(self, nbytes: float, to_gpu: bool = True) -> float:
        """An activation crossing between CPU and GPU: fixed latency plus bytes over PCIe."""
        gbps = self.link["h2d_gbps"] if to_gpu else self.link.get("d2h_gbps", self.link["h2d_gbps"])
        return self.link["latency_us"] / 1e3 + nbytes / (gbps * 1e6)

    @property
    def cpu_with_copy_factor(self) -> float:
        """How fast a CPU sub-layer runs while copies run, as a fraction of the rate it is priced at.

        The CPU and the copy engine read the same DRAM. Profiles that measured a CPU FFN block beside
        copies (`cpu_block_with_copy_gbps`, absolute) give it against the FFN rate the estimator prices
        one-token CPU sub-layers at; older ones only have the GEMV's ratio with and without copies, which
        misses that the priced block rate is higher than the GEMV's (on the H200 host: 113 GB/s priced,
        68.6 GB/s GEMV beside copies, ratio 1.0; decode traces showed CPU FFNs at 48-52 GB/s there)."""
        if not self.link:
            return 1.0
        block = self.link.get("cpu_block_with_copy_gbps")
        if block:
            try:
                gflops = self.gemm_gflops("cpu", "bfloat16", "ffn", 1)
            except ValueError:
                gflops = 0.0
            if gflops > 0:     # a one-token 16-bit matmul does 2 FLOPs per 2-byte weight: GFLOP/s = GB/s
                return min(1.0, max(0.05, float(block) / gflops))
        return float(self.link["cpu_with_copy_factor"])

    @property
    def cpu_wake_ms(self) -> float:
        """Extra milliseconds of a CPU sub-layer that follows GPU work (its matmul threads asleep), from
        the FFN block timed back to back and after an idle gap; 0 where the profile did not measure it."""
        idle = (self.cpu or {}).get("ffn_block_idle") or {}
        if "after_idle_ms" not in idle or "hot_ms" not in idle:
            return 0.0
        return max(0.0, float(idle["after_idle_ms"]) - float(idle["hot_ms"]))

    def describe(self) -> list[str]:
        """Human-readable summary lines (for `python -m engine profile`)."""
        mode = "quick" if self.data.get("quick") else "full"
        lines = [f"profile of {self.device} ({mode}, {self.data.get('created', '?')})"]
        for where, sec in (("cpu", self.cpu), ("gpu", self.gpu)):
            if sec is None:
                continue
            name = sec.get("name") or self.data.get("fingerprint", {}).get("gpu" if where == "gpu" else "cpu")
            lines.append(f"  {where}: {name}; op overhead {sec['op_overhead_us']:.1f} us; "
                         f"memory {sec['mem_gbps']:.1f} GB/s")
            for dtype, classes in sec["gemm"].items():
                cells = []
                for cls_name, rows in classes.items():
                    pts = ", ".join(f"{int(n)}:{r:.3g}" for n, r in rows)
                    cells.append(f"{cls_name} [{pts}]")
                lines.append(f"    matmul GFLOP/s {dtype}: " + "; ".join(cells))
            for dtype, r in sec["attention"].items():
                lines.append(f"    attention {dtype}: {r['gbps']:.3g} GB/s of KV at decode, "
                             f"{r['gflops']:.3g} GFLOP/s at prefill")
            if sec.get("block_factor"):
                lines.append("    engine FFN block vs tables (applied): "
                             + ", ".join(f"x{n} tokens {f:.2f}" for n, f in sec["block_factor"].items()))
            if sec.get("attn_block_factor"):
                lines.append("    engine attention block: attention projections' table scaled by "
                             + ", ".join(f"x{n} tokens {f:.2f}" for n, f in sec["attn_block_factor"].items()))
            idle = sec.get("ffn_block_idle")
            if idle:
                lines.append(f"    one-token FFN block {idle['hot_ms']:.2f} ms back to back, "
                             f"{idle['after_idle_ms']:.2f} ms after {idle['idle_s'] * 1e3:.0f} ms idle "
                             f"(charged at GPU->CPU crossings: {self.cpu_wake_ms:.2f} ms)")
            if "threads_gbps" in sec:
                lines.append("    bf16 GEMV GB/s by threads: "
                             + ", ".join(f"{t}: {g:.1f}" for t, g in sec["threads_gbps"].items()))
        if self.link:
            lk = self.link
            block = (f" (FFN block {lk['cpu_block_with_copy_gbps']:.1f} GB/s beside copies)"
                     if lk.get("cpu_block_with_copy_gbps") else "")
            lines.append(f"  PCIe: host->GPU {lk['h2d_gbps']:.1f} GB/s alone, {lk['h2d_with_cpu_gbps']:.1f} "
                         f"beside CPU work; CPU sub-layers priced at {self.cpu_with_copy_factor:.0%} of their "
                         f"rate while copies run{block}; activation move {lk['latency_us']:.0f} us")
        return lines


def normalize_device(device: str) -> str:
    """'auto' -> 'cuda:0' or 'cpu'; 'cuda' -> 'cuda:0'."""
    if device == "auto":
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return "cuda:0"
    if device in ("sim", "cpu") or device.startswith("cuda:"):
        return device
    from engine.errors import BadInputError

    raise BadInputError(f"device={device!r}: expected 'sim', 'cpu', 'cuda', 'cuda:N' or 'auto'")


def _require_cuda(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    from engine.errors import BadInputError

    if not torch.cuda.is_available():
        raise BadInputError(f"device={device!r}: no CUDA GPU is available to PyTorch here")
    index = int(device.split(":")[1])
    if index >= torch.cuda.device_count():
        raise BadInputError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) here")


def measure_profile(device: str, quick: bool = True, progress: Progress | None = None) -> dict:
    """Measure this machine for `device` ("cpu" or "cuda:N"); a profile dict (without fingerprint)."""
    import torch

    from engine.sharding import measure
    from engine.sharding.measure_link import link_section

    device = normalize_device(device)
    cpu_sizes = measure.beyond_caches(measure.CPU_QUICK if quick else measure.CPU_FULL)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    data: dict = {"schema": profile_store.SCHEMA, "device": device, "quick": quick, "created": created,
                  "gpu": None, "link": None}
    if not device.startswith("cuda"):
        data["cpu"] = measure.cpu_section(cpu_sizes, progress)
        if progress:
            progress(1.0, "done")
        return data
    _require_cuda(device)
    gpu_sizes = measure.GPU_QUICK if quick else measure.GPU_FULL
    with torch.cuda.device(torch.device(device)):
        # The executor keeps weights in pinned memory beside a GPU: the CPU computes from there.
        data["cpu"] = measure.cpu_section(replace(cpu_sizes, pinned=True), progress, 0.0, 0.5)
        n_steps = len(gpu_sizes.dtypes) * (3 * len(gpu_sizes.tokens) + 1) + 1
        step = measure._Steps(n_steps + 5, progress, 0.5, 0.5)
        data["gpu"] = measure.device_section(gpu_sizes, device, step)
        data["gpu"]["name"] = torch.cuda.get_device_name(torch.device(device))
        data["link"] = link_section(replace(gpu_sizes, pinned=True), device, step)
        torch.cuda.empty_cache()
    if progress:
        progress(1.0, "done")
    return data
