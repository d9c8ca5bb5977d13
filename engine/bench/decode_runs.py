"""The suite's decode runs one after another, each token timed, with what the engine did in each run: for a
suite row whose runs differ by a third (session 16, call TT: the MoE 4 GiB runs were 31.1, 20.3, 22.0,
29.7 and 22.1 t/s; Llama-3-8B's at 4 GiB 7.4 to 9.0).

    python -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 4GiB --runs 10 --out DIR

The engine is set up as `slipstream_runs.measure_budget` sets it up (the prompts of 512 and 4096 tokens,
warm-up and timed, then the decode runs of 32 sampled tokens after a 64-token prompt). Per run: tokens/s
as the suite reads it, each token's time, the plan in force (tier, kind, predicted ms), the KV capacity,
the re-plans made during the run and their reasons, the weight bytes copied and the engine's host-KV
counters. With `--poll-s`, every other run has an NVML poller of that interval beside it, as the suite's
runs have. With `--profiles A,B`, the runs take turns planning from the profile files given, in this one
engine (`TorchEngine.use_profile`, then one short warm-up run): an A/B of two profiles' plans that no lease or
process difference enters; `lease:FILE` is FILE's profile moved to the CPU and PCIe rates probed before the
engine opens (`ProfileDatabase.at_rates`). `--threads A,B` does the same for the CPU thread counts (torch's, which the native
pool follows), under one plan, `--spins A,B` for the native pool's spin before its workers sleep
(`kernels.set_spin`; with `--cpu-variants`, each spin count runs a whole round of the variants), and `--cpu-variants none,layers.*.attn+head` for the planner's plan against the
same plan with the named sub-layers computed on the CPU (`TorchEngine.move_to_cpu`; patterns joined by "+";
"PATTERN=PLACE" places them instead: `none,head=resident+layers.*.attn=streamed`; "kv_layers=N" sets the
GPU-resident KV prefix, so a variant can be another plan exactly;
`streamed-ffn:N`: N of the FFNs the planner's one-token plan streams, evenly spaced); `--split-variants off,on`
for the small-step tiers planned with the prompts' tiers or apart (`TorchEngine.split_plans`), `--host-io-variants
off,on` for a captured attention between host sub-layers run from the host or not. `--order abba` reverses the
variants' order every other round (a lease's drift over the call then favours none of them; and with
`--poll-s` and two variants, the poller no longer runs beside one variant only, as in session 20's call O).
Prints a table and writes decode_runs.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.units import parse_bytes

COUNTERS = ("streamed_bytes", "host_kv_blocks", "host_kv_hits", "prefix_hit_tokens", "replans")


def one_run(eng, run: int, salt: str, n_new: int) -> dict:
    from engine.bench.slipstream_runs import DECODE_PROMPT, _prompt

    before = {k: eng.stats().get(k) for k in COUNTERS}
    replans0 = len(eng.replans)
    times, last = [], time.perf_counter()
    for ev in eng.generate(_prompt(DECODE_PROMPT, run, salt), max_new_tokens=n_new, temperature=1.0, seed=run):
        if ev.token_id is None:
            continue
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    s = eng.stats()
    plan = eng.executor.plan
    return {"run": run, "tps": s["decode_tokens_per_s"], "ttft_ms": times[0], "token_ms": [round(t, 2) for t in times[1:]],
            "plan": {"tier": plan.tier, "kind": plan.kind, "predicted_ms": plan.predicted_ms, "n_slots": plan.n_slots},
            "kv_tokens": eng.kv_tokens,
            "replans": [{"reason": r["reason"], "budget": r["budget"]} for r in eng.replans[replans0:]],
            "counters": {k: (s.get(k) - before[k]) if isinstance(s.get(k), int | float) and isinstance(before[k], int | float)
                         else s.get(k) for k in COUNTERS}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.decode_runs", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--device", default="cuda", help="cuda, or sim (a dry run)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--poll-s", type=float, default=0.0,
                    help="every other run beside an NVML poller of this interval (the suite's: 0.02)")
    ap.add_argument("--profiles", default="",
                    help="profile database files the runs take turns planning from (comma-separated)")
    ap.add_argument("--threads", default="",
                    help="CPU thread counts the runs take turns at (comma-separated; torch's and the native pool's)")
    ap.add_argument("--spins", default="",
                    help="native pool spin counts the runs take turns at (comma-separated pause instructions)")
    ap.add_argument("--split-variants", default="",
                    help="comma-separated off/on: the runs take turns with the small-step tiers planned with the "
                         "prompts' or apart (TorchEngine.split_plans)")
    ap.add_argument("--host-io-variants", default="",
                    help="comma-separated off/on: the runs take turns with a captured attention between host "
                         "sub-layers run from the host or the usual way (Executor.graph_host_io)")
    ap.add_argument("--issuer-variants", default="",
                    help="comma-separated off/on: the runs take turns with coded copies issued from the step's "
                         "thread or the accelerator's issuer thread (Accelerator.set_issue_thread)")
    ap.add_argument("--ring-ahead-variants", default="",
                    help="comma-separated off/on: the runs take turns with coded copies crossing into the staging "
                         "ring before the compute that frees their slot, or after it (Accelerator.set_ring_ahead)")
    ap.add_argument("--one-slot-variants", default="",
                    help="comma-separated off/on: the runs take turns with the decode tier kept at two streaming "
                         "slots or allowed one where priced faster (TorchEngine.one_slot_decode; re-plans)")
    ap.add_argument("--prefetch-variants", default="",
                    help="comma-separated prefetch distances (elements; 0 off) of the native matmuls' long rows "
                         "that the runs take turns at (kernels.set_prefetch)")
    ap.add_argument("--cpu-variants", default="",
                    help="placements the runs take turns at: comma-separated, each 'none' (the planner's plan) or "
                         "sub-layer name patterns joined by '+' that the plan computes on the CPU")
    ap.add_argument("--order", default="cycle", choices=("cycle", "abba"),
                    help="the variants' turns: in the same order each round, or reversed every other round")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    import torch

    threads = [int(t) for t in args.threads.split(",") if t]
    if any(t < 1 for t in threads):
        ap.error(f"--threads {args.threads}: thread counts must be at least 1")
    from engine.commands.plan import profile_from_file

    names = [p for p in args.profiles.split(",") if p]
    profiles, probed = [], None
    for name in names:              # "lease:FILE": FILE's profile moved to the rates measured now
        if name.startswith("lease:"):
            if probed is None:
                from engine.sharding.measure_link import probe_rates

                probed = probe_rates()
                print(f"rates now: {probed}", flush=True)
            profiles.append(profile_from_file(name[len("lease:"):]).at_rates(probed))
            print(f"{name}: {profiles[-1].data['rates_scaled']}", flush=True)
        else:
            profiles.append(profile_from_file(name))
    args.probed = probed

    def onoff(option: str) -> list[bool]:
        """An --X-variants value: comma-separated off/on -> the turns' flags."""
        value = getattr(args, option.replace("-", "_") + "_variants")
        turns = [v for v in value.split(",") if v]
        if any(v not in ("off", "on") for v in turns):
            ap.error(f"--{option}-variants {value}: expected off and on, comma-separated")
        return [v == "on" for v in turns]
    args.splits, args.host_io, args.issuer = onoff("split"), onoff("host-io"), onoff("issuer")
    args.one_slot, args.ahead = onoff("one-slot"), onoff("ring-ahead")
    args.prefetch = [int(v) for v in args.prefetch_variants.split(",") if v]
    if any(v < 0 for v in args.prefetch):
        ap.error(f"--prefetch-variants {args.prefetch_variants}: distances must be at least 0")
    spins = [int(s) for s in args.spins.split(",") if s]
    if any(s < 0 for s in spins):
        ap.error(f"--spins {args.spins}: spin counts must be at least 0")
    threads0 = torch.get_num_threads()
    if args.prefetch:
        from engine import kernels

        prefetch0 = kernels.prefetch()
    variants = [() if v == "none" else tuple(v.split("+")) for v in args.cpu_variants.split(",") if v]
    try:
        return _runs(args, names, profiles, threads, variants, spins, argv)
    finally:
        torch.set_num_threads(threads0)
        if args.prefetch and prefetch0 is not None:
            kernels.set_prefetch(prefetch0)
        if spins:
            from engine import kernels

            kernels.set_spin(int(os.environ.get("SLIPSTREAM_KERNEL_SPIN", kernels.SPIN)))


def _onoff(flag: bool | None) -> str:
    return "-" if flag is None else "on" if flag else "off"


def _short(profile: str | None) -> str:
    if not profile:
        return "-"
    return ("lease:" if profile.startswith("lease:") else "") + Path(profile.removeprefix("lease:")).name


def turn_of(order: str):
    """Which variant of n run i takes: "cycle" 0, 1, ..., n-1, 0, 1, ...; "abba" reverses every other round
    (0, 1, 1, 0, ...), so that a lease whose speed drifts over the call favours no variant by its place in
    the round (session 20's call S: the lease sped up by about 1 ms a token from one run to the next)."""
    def turn(i: int, n: int) -> int:
        r, pos = divmod(i, n)
        return n - 1 - pos if order == "abba" and r % 2 else pos
    return turn


def _spin_turn(i: int, spins: list, variants: list) -> int:
    """The spin count of run i: with --cpu-variants too, each spin count takes a whole round of the variants
    (the two axes cross instead of moving together)."""
    return (i // max(len(variants), 1)) % len(spins)


def resolve_variant(eng, variant: tuple[str, ...]) -> tuple[str, ...]:
    """A --cpu-variants entry with each `streamed-ffn:N` replaced by the names of N of the FFNs that the
    planner's one-token plan streams, evenly spaced over them (so a variant can set the planner's split
    between CPU and PCIe beside one with N more FFNs on the CPU)."""
    from engine.sharding.plan import Placement

    out: list[str] = []
    for part in variant:
        if not part.startswith("streamed-ffn:"):
            out.append(part)
            continue
        plan = eng.planset.for_tokens(1)
        streamed = [k for k, v in plan.placement.items() if k.endswith(".ffn") and v is Placement.STREAMED]
        n = min(int(part.split(":", 1)[1]), len(streamed))
        out += [streamed[int((j + 0.5) * len(streamed) / n)] for j in range(n)]
    return tuple(out)


def _runs(args, names, profiles, threads, variants, spins, argv) -> int:
    import torch

    from engine.bench.scenarios import DRY_SCENARIOS, PROMPTS, SCENARIOS
    from engine.bench.slipstream_runs import _empty_cache, open_engine, prefill_tps

    budget = parse_bytes(args.budget)
    eng = open_engine({**SCENARIOS, **DRY_SCENARIOS}[args.shape], budget, args.device, max(PROMPTS) + 256)
    eng.set_vram_budget(budget)
    _empty_cache()
    salt = f"b{budget}"
    for n in PROMPTS:                                   # as measure_budget: warm-up and timed prompts
        prefill_tps(eng, n, 25, salt)
    one_run(eng, 24, salt, 4)
    for n in PROMPTS:
        for r in range(3):
            prefill_tps(eng, n, r, salt)
    turn = turn_of(args.order)
    asked = ["+".join(v) or "none" for v in variants]
    variants = [resolve_variant(eng, v) for v in variants]
    rows = []
    for i in range(args.runs):
        if profiles:
            eng.use_profile(profiles[turn(i, len(profiles))])
            one_run(eng, 90 + i, salt, 4)               # (the switch's weight moves out of the timed run)
        if threads:
            torch.set_num_threads(threads[turn(i, len(threads))])
            one_run(eng, 190 + i, salt, 4)              # (the pool restarts at its first call)
        if args.splits:
            eng.split_plans(args.splits[turn(i, len(args.splits))])
            one_run(eng, 490 + i, salt, 4)              # (the switch's weight moves out of the timed run)
        if args.host_io:
            eng.executor.graph_host_io = args.host_io[turn(i, len(args.host_io))]
            one_run(eng, 590 + i, salt, 4)
        if args.issuer:
            eng.accel.set_issue_thread(args.issuer[turn(i, len(args.issuer))])
            one_run(eng, 690 + i, salt, 4)
        if args.ahead:
            eng.accel.set_ring_ahead(args.ahead[turn(i, len(args.ahead))])
            one_run(eng, 790 + i, salt, 4)
        if args.one_slot:
            eng.one_slot_decode(args.one_slot[turn(i, len(args.one_slot))])
            one_run(eng, 890 + i, salt, 4)              # (the re-plan and its weight moves out of the timed run)
        if args.prefetch:
            from engine import kernels

            kernels.set_prefetch(args.prefetch[turn(i, len(args.prefetch))])
            one_run(eng, 990 + i, salt, 4)
        if spins:
            from engine import kernels

            kernels.set_spin(spins[_spin_turn(i, spins, variants)])
            one_run(eng, 390 + i, salt, 4)
        if variants:
            eng.move_to_cpu(variants[turn(i, len(variants))])
            one_run(eng, 290 + i, salt, 4)              # (the switch's weight moves out of the timed run)
        polled = bool(args.poll_s) and i % 2 == 1
        if polled:            # as the suite samples this process's VRAM beside its runs
            from engine.bench.vram_poll import VramPoller

            with VramPoller([os.getpid()], args.poll_s):
                rows.append(one_run(eng, 3 + i, salt, args.tokens))
        else:
            rows.append(one_run(eng, 3 + i, salt, args.tokens))
        rows[-1]["nvml_poll_s"] = args.poll_s if polled else None
        rows[-1]["profile"] = names[turn(i, len(names))] if names else None
        rows[-1]["threads"] = torch.get_num_threads()
        rows[-1]["split_plans"] = args.splits[turn(i, len(args.splits))] if args.splits else None
        rows[-1]["graph_host_io"] = args.host_io[turn(i, len(args.host_io))] if args.host_io else None
        rows[-1]["issue_thread"] = args.issuer[turn(i, len(args.issuer))] if args.issuer else None
        rows[-1]["ring_ahead"] = args.ahead[turn(i, len(args.ahead))] if args.ahead else None
        rows[-1]["one_slot"] = args.one_slot[turn(i, len(args.one_slot))] if args.one_slot else None
        rows[-1]["spin"] = spins[_spin_turn(i, spins, variants)] if spins else None
        rows[-1]["prefetch"] = args.prefetch[turn(i, len(args.prefetch))] if args.prefetch else None
        rows[-1]["moved_to_cpu"] = "+".join(variants[turn(i, len(variants))]) or "none" if variants else None
        rows[-1]["variant"] = asked[turn(i, len(asked))] if variants else None
    print("| run | profile | threads | spin | prefetch | split | host io | issuer | ring ahead | one slot | on the CPU | t/s | NVML poll | first 4 ms | median ms | max ms | plan | KV | re-plans | copied MiB/token |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["token_ms"]
        copied = (r["counters"]["streamed_bytes"] or 0) / max(len(t) + 1, 1) / 2**20
        print(f"| {r['run']} | {_short(r['profile'])} | {r['threads']} | {r['spin'] if r['spin'] is not None else '-'} | {r['prefetch'] if r['prefetch'] is not None else '-'} | {_onoff(r['split_plans'])} | {_onoff(r['graph_host_io'])} | {_onoff(r['issue_thread'])} | {_onoff(r['ring_ahead'])} | {_onoff(r['one_slot'])} | {r['variant'] or '-'} | {r['tps']:.2f} | {r['nvml_poll_s'] or '-'} | {[round(x, 1) for x in t[:4]]} | "
              f"{statistics.median(t):.1f} | {max(t):.1f} | "
              f"{r['plan']['tier']}/{r['plan']['kind']}/{r['plan']['n_slots']} slots {r['plan']['predicted_ms']:.1f} | {r['kv_tokens']} | "
              f"{'; '.join(x['reason'] for x in r['replans']) or '-'} | {copied:.1f} |", flush=True)
    eng.close()
    path = write_report(args.out, "decode_runs", {"shape": args.shape, "budget": args.budget, "device": args.device,
                                                  "profiles": names, "probed_rates": args.probed, "split_variants": args.splits, "host_io_variants": args.host_io, "issuer_variants": args.issuer, "ring_ahead_variants": args.ahead, "one_slot_variants": args.one_slot, "threads": threads, "spins": spins, "prefetch_variants": args.prefetch,
                                                  "cpu_variants": ["+".join(v) or "none" for v in variants], "rows": rows},
                        "python -m engine.bench.decode_runs " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
