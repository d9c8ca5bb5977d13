"""Partial results of one harness part, written after every row, resumable, and the call's deadline.

Each part (`llamacpp`, `slipstream`, `accelerate`, `corun`, ...) writes `part-<name>.json` into the output
folder: `{"part", "machine", "started", "updated", "meta": {...}, "state": {...}, "rows": [...]}`.
Rows already in a prior file of the same part (`--prior DIR`, e.g. the files an earlier device call
brought back) are kept and not run again, so a part cut short by the per-call time limit finishes in a
later call. Raw logs go to a work folder and are packed into `<part>-logs.tar.xz` beside the JSON.
"""

from __future__ import annotations

import json
import os
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def row_key(row: dict) -> str:
    return "|".join(str(row.get(k, "")) for k in ("system", "model", "budget", "variant", "scenario"))


def decode_steal(row: dict) -> float | None:
    """The mean CPU steal share over a row's decode runs (None where the row did not record them)."""
    shares = [d["steal_share"] for d in row.get("decode_runs_detail") or [] if d.get("steal_share") is not None]
    return sum(shares) / len(shares) if shares else None


class Partial:
    def __init__(self, out_dir: Path, part: str, prior_dir: Path | None = None, machine: dict | None = None):
        self.path = Path(out_dir) / f"part-{part}.json"
        self.part = part
        data: dict = {}
        for src in (self.path, Path(prior_dir) / self.path.name if prior_dir else None):
            if src is not None and src.is_file():
                try:
                    data = json.loads(src.read_text())
                    break
                except (OSError, json.JSONDecodeError):
                    continue
        self.data = {"part": part, "machine": machine or data.get("machine", {}),
                     "started": data.get("started", now_iso()), "updated": now_iso(),
                     "meta": data.get("meta", {}), "state": data.get("state", {}),
                     "rows": list(data.get("rows", []))}
        if machine:
            self.data.setdefault("machines", [])
            self.data["machines"] = list(data.get("machines", [])) + [machine]
        self.log_dir = Path(os.environ.get("SLIPSTREAM_BENCH_WORK", "/tmp/slipstream-bench")) / "logs" / part
        self.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    @property
    def meta(self) -> dict:
        return self.data["meta"]

    @property
    def state(self) -> dict:
        return self.data["state"]

    def has(self, key: str) -> bool:
        return any(row_key(r) == key and not r.get("pending") for r in self.rows)

    def add(self, row: dict) -> None:
        """Add or replace (same key) a row, then save."""
        key = row_key(row)
        self.data["rows"] = [r for r in self.rows if row_key(r) != key] + [row]
        self.save()

    def save(self) -> None:
        self.data["updated"] = now_iso()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def pack_logs(self) -> Path | None:
        files = [p for p in sorted(self.log_dir.rglob("*")) if p.is_file()]
        if not files:
            return None
        out = self.path.parent / f"{self.part}-logs.tar.xz"
        tmp = out.with_suffix(".tmp")
        with tarfile.open(tmp, "w:xz") as tf:
            for p in files:
                if p.stat().st_size <= 64 << 20:
                    tf.add(p, arcname=str(p.relative_to(self.log_dir)))
        tmp.replace(out)
        return out


class Deadline:
    """Seconds left in this device call: `--deadline-epoch`, else $SLIPSTREAM_BENCH_DEADLINE, else none."""

    def __init__(self, epoch: float | None = None):
        env = os.environ.get("SLIPSTREAM_BENCH_DEADLINE")
        self.epoch = epoch if epoch else float(env) if env else None

    def left(self) -> float:
        return float("inf") if self.epoch is None else self.epoch - time.time()

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds

    def cap(self, seconds: float) -> float:
        """`seconds`, or less when the deadline comes first (never below 1)."""
        return max(1.0, min(seconds, self.left()))
