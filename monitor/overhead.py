"""Measures what the monitor costs: CPU time of this process while a Monitor samples at its interval.

CPU percent is of one core (100 = one core fully busy). Run with nothing else busy in the process.
"""

from __future__ import annotations

import time

from monitor.sampling import Monitor


def measure_overhead(monitor: Monitor, seconds: float = 10.0) -> dict:
    """Start `monitor`, let it sample for `seconds`, stop it; the process's CPU time over that window."""
    before = monitor.stats()["samples"]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    monitor.start()
    time.sleep(seconds)
    monitor.stop()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    stats = monitor.stats()
    samples = stats["samples"] - before
    return {
        "interval_s": monitor.interval_s,
        "seconds": round(wall, 3),
        "samples": samples,
        "rate_hz": round(samples / wall, 2) if wall else 0.0,
        "cpu_percent_of_one_core": round(100.0 * cpu / wall, 3) if wall else 0.0,
        "cpu_ms_per_sample": round(1000.0 * cpu / samples, 4) if samples else None,
        "mean_sample_ms": round(stats["mean_sample_ms"], 4),
        "max_sample_ms": round(stats["max_sample_ms"], 4),
    }
