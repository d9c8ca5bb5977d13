"""Replace some rows of a suite part file with a later call's rows of the same part.

    python -m engine.bench.part_replace --into docs/benchmarks/gpu/issue6/part-slipstream.json \\
        --source docs/benchmarks/gpu/session15/callkk/part-slipstream.json --models qwen3-30b-a3b \\
        --archive session14 --note "call KK: the CPU MoE layer call"

A device call often runs one shape or a few budgets of a part again, while the merged results
(`--part merge`) read one file per part. This writes the file named by `--into` with the rows it held, less
those that match the selection (`--models`, `--budgets`: every row of the source file that matches
replaces a row of the same system, model and budget, and adds it where there was none), plus a note per new
row (`call`). The result keeps the target's meta and extends its lists of commands and lease probes with the
source's. The meta's `weights` stays where every row ran the same weights; else each row names its own
(none where the target's rows predate the record).
`--archive TAG` first copies the target beside itself as part-<name>-TAG.json (the merge reads only the
newest file of a part, so archived copies stay out of the results).
A row whose decode runs saw more CPU steal than `--max-steal` (their mean share; 2% by default) is left out
and named: on a lease where neighbours take the CPU, a decode that computes on it measures them (session 29:
the MoE shape's rows at 2-15% steal read 19-24 t/s where quiet leases had read 32). `--max-steal 1` takes
every row.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from engine.bench.partials import decode_steal, row_key

MAX_STEAL = 0.02


def quiet_rows(source: dict, max_steal: float) -> tuple[dict, list[tuple[dict, float]]]:
    """(the source with only rows whose decode runs saw at most `max_steal` steal, the rows left out and
    their steal)."""
    kept, loud = [], []
    for r in source.get("rows", []):
        s = decode_steal(r)
        if s is not None and s > max_steal:
            loud.append((r, s))
        else:
            kept.append(r)
    return dict(source, rows=kept), loud


def replace_rows(target: dict, source: dict, models: set[str] | None, budgets: set[str] | None,
                 note: str = "") -> tuple[dict, int, int]:
    """(the combined part, rows replaced, rows added)."""
    if target.get("part") != source.get("part"):
        raise ValueError(f"parts differ: {target.get('part')!r} and {source.get('part')!r}")

    def chosen(r: dict) -> bool:
        return (models is None or r.get("model") in models) and (budgets is None or r.get("budget") in budgets)

    meta = dict(target.get("meta", {}))
    smeta = source.get("meta", {})
    new = [dict(r, call=note) if note else dict(r) for r in source.get("rows", []) if chosen(r) and not r.get("pending")]
    keys = {row_key(r) for r in new}
    kept = [dict(r) for r in target.get("rows", []) if row_key(r) not in keys]
    replaced = len(target.get("rows", [])) - len(kept)
    # The weights each row ran (a part's meta names them for all its rows): where the kept and the new rows
    # ran different ones (or the target's are not recorded), each row names its own and the meta none
    for rows, w in ((kept, meta.get("weights")), (new, smeta.get("weights"))):
        for r in rows:
            if w is not None and "weights" not in r:
                r["weights"] = w
    ran = {r.get("weights") for r in kept + new}
    if len(ran) == 1 and None not in ran:
        meta["weights"] = ran.pop()
        for r in kept + new:
            r.pop("weights", None)
    else:
        meta.pop("weights", None)
    out = dict(target)
    out["rows"] = kept + new
    for key in ("commands", "lease_probes"):
        meta[key] = list(meta.get(key, [])) + [x for x in smeta.get(key, []) if x not in meta.get(key, [])]
    meta.setdefault("assembled", [])
    if isinstance(meta["assembled"], str):
        meta["assembled"] = [meta["assembled"]]
    meta["assembled"] = meta["assembled"] + [f"engine.bench.part_replace: {len(new)} rows" + (f" ({note})" if note else "")]
    out["meta"] = meta
    out["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    return out, replaced, len(new) - replaced


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.part_replace", description=__doc__.split("\n")[0])
    ap.add_argument("--into", type=Path, required=True, help="the part file to update (e.g. gpu/issue6/part-slipstream.json)")
    ap.add_argument("--source", type=Path, required=True, help="a later call's file of the same part")
    ap.add_argument("--models", default="", help="comma-separated models to take (default: all)")
    ap.add_argument("--budgets", default="", help="comma-separated budgets to take (default: all)")
    ap.add_argument("--note", default="", help="recorded on each new row as `call`")
    ap.add_argument("--archive", default="", help="copy the target to part-<name>-TAG.json first")
    ap.add_argument("--max-steal", type=float, default=MAX_STEAL,
                    help="leave out rows whose decode runs saw more CPU steal than this share (default 0.02)")
    args = ap.parse_args(argv)
    target = json.loads(args.into.read_text())
    split = lambda s: {x for x in s.split(",") if x} or None
    source, loud = quiet_rows(json.loads(args.source.read_text()), args.max_steal)
    models, budgets = split(args.models), split(args.budgets)
    for r, s in loud:
        if (models is None or r.get("model") in models) and (budgets is None or r.get("budget") in budgets):
            print(f"part_replace: {r.get('system')} {r.get('model')} {r.get('budget')} left out: its decode runs "
                  f"saw {s:.1%} CPU steal (more than --max-steal {args.max_steal:g})", file=sys.stderr)
    try:
        out, replaced, added = replace_rows(target, source, models, budgets, args.note)
    except ValueError as exc:
        print(f"part_replace: {exc}", file=sys.stderr)
        return 2
    if args.archive:
        dest = args.into.with_name(f"{args.into.stem}-{args.archive}{args.into.suffix}")
        shutil.copyfile(args.into, dest)
        print(f"archived {args.into} as {dest}")
    args.into.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.into}: {replaced} rows replaced, {added} added, {len(out['rows'])} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
