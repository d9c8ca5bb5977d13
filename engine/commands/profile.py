"""`python -m engine profile`: measure this machine and write the profile database (or show it).

Runs the install-stage benchmarks for the device (cuda when a GPU is present, else cpu), prints what it
measured and where the database lives. `--quick` finishes in under a minute on a small CPU; `--show`
prints the stored profile without measuring; `--device sim` prints the synthetic profile.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (default: cuda if present, else cpu), cuda, cuda:N, cpu or sim")
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer points (under a minute)")
    p.add_argument("--show", action="store_true", help="print the stored profile, measuring only if none")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--db", default=None, help="profile database file (default: the user data folder)")


def progress_printer(stream) -> Callable[[float, str], None]:
    """Progress on one rewritten line on a terminal, one line per step elsewhere (logs, pipes)."""
    tty = stream.isatty()

    def show(frac: float, msg: str) -> None:
        if tty:
            end = "\n" if frac >= 1.0 else ""
            print(f"\r[{frac:4.0%}] {msg:<60}", end=end, file=stream, flush=True)
        else:
            print(f"[{frac:4.0%}] {msg}", file=stream, flush=True)

    return show


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.sharding import profile_store
    from engine.sharding.profile import ProfileDatabase, normalize_device

    device = normalize_device(args.device)
    path = Path(args.db) if args.db else profile_store.db_path()
    t0 = time.perf_counter()

    progress = progress_printer(sys.stderr)

    prof = ProfileDatabase.for_device(device, quick=args.quick or args.show, progress=progress, path=path,
                                      remeasure=not args.show)
    if device != "sim" and not args.show:
        print(f"measured in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(prof.to_dict(), indent=1))
    else:
        print("\n".join(prof.describe()))
        if device != "sim":
            print(f"database: {path}")
    return 0
