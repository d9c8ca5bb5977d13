"""The parts of `python -m engine bench --gpu` (see `engine.bench.gpu_suite` for the overview)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

from engine.bench import llamacpp_build as lb
from engine.bench.partials import Deadline, Partial, now_iso
from engine.bench.scenarios import budgets as pick_budgets
from engine.bench.scenarios import pick


def say(msg: str) -> None:
    print(msg, flush=True)


# How every system's random weights are drawn (engine.loading.random_init.random_std: a wide embedding and
# narrow residual writes, so that a MoE shape's tokens spread over the experts), recorded in each part.
WEIGHTS = "random_std"


def run_part(name: str, args, machine: dict, command: str) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if name == "merge":
        from engine.bench.gpu_merge import merge

        return merge([out] + ([Path(args.prior)] if args.prior else []),
                     Path(args.results_dir or args.out), dry_run=args.dry_run, say=say)
    # build-llamacpp and gguf leave nothing in --out (the device tool brings back 8 files per call):
    # their state lives in the work folder; the llamacpp part records the build and the GGUF facts.
    internal = name in ("build-llamacpp", "gguf")
    part = Partial(lb.work_dir() / "internal" if internal else out, name,
                   None if internal or not args.prior else Path(args.prior), machine)
    part.meta.setdefault("commands", []).append(command)
    part.meta["dry_run"] = bool(args.dry_run)
    if not internal:
        part.meta["weights"] = WEIGHTS   # (parts without it predate the weights whose MoE routing spreads)
        from engine.bench.gpu_common import lease_probe

        probe = dict(lease_probe(64, 0.1, 16) if args.dry_run else lease_probe(), at=now_iso())   # dry: a taste
        part.meta.setdefault("lease_probes", []).append(probe)
        say(f"lease probe: CPU one-token matmuls {probe['cpu_gemv_gbps']} GB/s, host->GPU {probe['h2d_gbps']} GB/s, "
            f"steal {probe['steal_share']}, load {probe['loadavg']}")
    part.save()
    deadline = Deadline(args.deadline_epoch)
    try:
        fn = {"build-llamacpp": part_build, "gguf": part_gguf, "llamacpp": part_llamacpp,
              "slipstream": part_slipstream, "accelerate": part_accelerate, "corun": part_corun,
              "vl": part_vl}[name]
        return fn(args, part, deadline, command)
    finally:
        part.save()
        if not internal:
            part.pack_logs()


# ---- llama.cpp ---------------------------------------------------------------------------------------
def resolve_bins(args, part: Partial, build: bool = True) -> Path | None:
    """The folder holding llama-bench: --llamacpp-bin, a build in the work folder, carried packed parts,
    or a fresh build (not in a dry run)."""
    if args.llamacpp_bin:
        b = Path(args.llamacpp_bin)
        return b if lb.tools_ok(b) else None
    src = Path(args.carry) / "llama.cpp-src.tar.xz"
    if lb.tools_ok(lb.bin_dir()):
        return lb.bin_dir()
    if not src.is_file():
        say(f"llama.cpp: no source at {src} (run python -m engine.bench.prepare_carry here first)")
        return None
    if args.dry_run and not build:
        return None
    packed = next((d for d in (Path(args.prior) if args.prior else None, Path(args.carry))
                   if d is not None and list(d.glob(lb.PACK_NAME + ".*"))), None)
    if args.dry_run and packed is None:
        say("llama.cpp: dry run, no build (give --llamacpp-bin to use one)")
        return None
    info = lb.ensure_built(src, cuda=not args.dry_run, packed=packed, log_dir=part.log_dir, say=say)
    part.meta["build"] = info
    part.save()
    return Path(info["bin_dir"])


def part_build(args, part: Partial, deadline, command: str) -> int:
    bins = resolve_bins(args, part)
    if bins is None:
        part.meta["build_note"] = "no llama.cpp build (dry run or no source)"
        return 0 if args.dry_run else 1
    if args.pack_bins and part.meta.get("build", {}).get("how") == "built":
        parts = lb.pack(bins, Path(args.out))
        total = sum(p.stat().st_size for p in parts)
        if total > 45 << 20:                 # too big to carry back beside the rest: a later call rebuilds
            for p in parts:
                p.unlink()
            say(f"packed build is {total / 2**20:.0f} MiB: not kept (a later call rebuilds)")
        else:
            say("packed " + ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in parts))
    return 0


def part_gguf(args, part: Partial, deadline, command: str) -> int:
    """Write the scenarios' GGUFs (and the tiny one for the allowance) into the work folder."""
    for scenario in pick(args.models, args.dry_run) + pick("tiny-llama", True):
        if scenario.kind != "vl":
            scenario_gguf(scenario, args)
    return 0


def vocab_dir(carry: Path) -> Path | None:
    dest = lb.work_dir() / "vocab"
    if list(dest.glob("models/*.gguf")):
        return dest / "models"
    src = carry / "llama.cpp-src.tar.xz"
    if not src.is_file():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src, "r:xz") as tf:
        members = [m for m in tf.getmembers() if m.name.startswith("models/") and m.name.endswith(".gguf")]
        tf.extractall(dest, members=members, filter="data")
    return dest / "models"


def make_room(models_dir: Path, need: int, keep: Path) -> None:
    """Delete other GGUFs in the work folder when the disk would not hold `need` more bytes (+4 GB)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    for other in sorted(models_dir.glob("*.gguf")):
        if shutil.disk_usage(models_dir).free > need + 4e9:
            return
        if other != keep:
            say(f"deleting {other} to make room")
            other.unlink()
            other.with_suffix(".json").unlink(missing_ok=True)


def scenario_gguf(scenario, args, say=say) -> tuple[Path, dict]:
    from engine.bench.gguf_shapes import gguf_shape
    from engine.bench.llamacpp_runs import prepare_gguf

    shape = gguf_shape(scenario.gguf_shape, scenario.layers)
    target = lb.work_dir() / "models" / f"{scenario.model}-{args.gguf_dtype}.gguf"
    wb = shape.weight_bytes()
    make_room(target.parent, wb["token_embd"] + wb["output"] + shape.layers * wb["layer"], target)
    return prepare_gguf(scenario, lb.work_dir(), vocab_dir(Path(args.carry)), args.gguf_dtype, say=say)


def part_llamacpp(args, part: Partial, deadline, command: str) -> int:
    from engine.bench import llamacpp_runs as lr
    from engine.bench.gguf_shapes import gguf_shape

    bins = resolve_bins(args, part)
    if bins is None:
        part.meta["note"] = "llama.cpp not available: no rows"
        return 0 if args.dry_run else 1
    threads = lr.default_threads()
    part.meta.update(threads=threads, bins=str(bins), prompts=list(lr.PROMPTS), decode_tokens=lr.DECODE_TOKENS)
    for scenario in pick(args.models, args.dry_run):
        if scenario.kind == "vl":
            continue
        tuned, prompts = llamacpp_choices(args, scenario)
        part.meta.setdefault("prompts_by_model", {})[scenario.model] = list(prompts)
        if not deadline.allows(lr.EST_RUN_S + 60):
            say(f"deadline: llama.cpp {scenario.model} left for a later call")
            break
        gguf, facts = scenario_gguf(scenario, args)
        part.meta.setdefault("gguf", {})[scenario.model] = facts
        shape = gguf_shape(scenario.gguf_shape, scenario.layers)
        runner = lr.LlamaCppRunner(bins, gguf, shape, threads, part.log_dir / scenario.model, deadline, say=say,
                                   prompts=prompts, reps=args.llamacpp_reps)
        if "allowance_llamacpp" not in part.meta:
            tiny, _ = scenario_gguf(pick("tiny-llama", True)[0], args)
            part.meta["allowance_llamacpp"] = lr.llamacpp_allowance(runner, tiny)
            say(f"llama.cpp allowance (its CUDA context with a tiny model): "
                f"{part.meta['allowance_llamacpp'] / 2**20:.0f} MiB")
        allowance = int(part.meta["allowance_llamacpp"])
        for bname, b in pick_budgets(args.budgets, args.dry_run):
            say(f"llama.cpp {scenario.model} at {bname}:")
            lr.run_budget(runner, part, scenario.model, bname, b, allowance, tuned)
            part.pack_logs()
        if not args.no_batched:
            for bname, b in pick_budgets(args.budgets, args.dry_run):
                lr.run_batched(runner, part, scenario.model, bname, b, allowance, tuned)
                part.pack_logs()
        if not deadline.allows(lr.EST_RUN_S):
            say("deadline reached: the rest is left for a later call (--prior resumes it)")
            return 0
    return 0


def llamacpp_choices(args, scenario) -> tuple[list, tuple[int, ...]]:
    """The tuned variants (run in this order) and llama-bench prompt lengths of one scenario: --tuned /
    --llamacpp-prompts when given, else the scenario's own (the MoE shape: the --n-cpu-moe variants with
    and without mmap, -p 512), else the defaults."""
    from engine.bench import llamacpp_plan as lp

    if args.tuned:
        names = args.tuned.split(",")
    elif scenario.llamacpp_tuned is not None:
        names = list(scenario.llamacpp_tuned)
    else:
        names = [v.name for v in lp.TUNED if v.default_on]
    by_name = {v.name: v for v in lp.TUNED}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--tuned: unknown variant(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    prompts_arg = getattr(args, "llamacpp_prompts", None)
    prompts = tuple(int(p) for p in prompts_arg.split(",")) if prompts_arg else scenario.llamacpp_prompts
    return [by_name[n] for n in dict.fromkeys(names)], prompts          # in the order given


def plan_llamacpp(args, say=say) -> int:
    """`--plan-only`: the llama.cpp runs the llamacpp part would start, without llama.cpp, a GPU or the
    GGUF: per scenario, budget and variant the first command line (predicted from the prior C, or the C
    learned in --prior's part-llamacpp.json), then the search simulated for peaks that miss the prediction
    by -0.5 to +1 GB (learned C carried across budgets, as in the part): how many runs each would take."""
    from engine.bench import llamacpp_plan as lp
    from engine.bench import llamacpp_runs as lr
    from engine.bench.gguf_shapes import gguf_shape

    prior = {}
    if args.prior and (Path(args.prior) / "part-llamacpp.json").is_file():
        prior = json.loads((Path(args.prior) / "part-llamacpp.json").read_text())
    allowance = prior.get("meta", {}).get("allowance_llamacpp")
    source = "from --prior" if allowance else "assumed: the H200 figure of the first session"
    allowance = int(allowance or 656408576)
    learned = prior.get("state", {}).get("learned_c", {})
    say(f"llama.cpp allowance {allowance / 2**20:.0f} MiB ({source}); fits: peak <= budget + allowance")
    for scenario in pick(args.models, args.dry_run):
        if scenario.kind == "vl":
            continue
        tuned, prompts = llamacpp_choices(args, scenario)
        shape = gguf_shape(scenario.gguf_shape, scenario.layers)
        gguf = lb.work_dir() / "models" / f"{scenario.model}-{args.gguf_dtype}.gguf"
        runner = lr.LlamaCppRunner(lb.bin_dir(), gguf, shape, lr.default_threads(), lb.work_dir(), Deadline(None),
                                   say=say, prompts=prompts)
        budgets = pick_budgets(args.budgets, args.dry_run)
        say(f"{scenario.model}: {shape.layers} layers, prompts {','.join(map(str, prompts))}, "
            f"variants default + {', '.join(v.name for v in tuned)}")
        for variant in [lp.DEFAULT, *tuned]:
            c0 = lp.c_prior(variant, learned, scenario.model, [lp.DEFAULT, *tuned])
            for bname, b in budgets:
                x = max(0, lp.largest_fitting(shape, variant.mode, c0, b + allowance, runner.n_ctx))
                peak = c0 + lp.offloaded_bytes(shape, variant.mode, x, runner.n_ctx)
                say(f"  {variant.key} at {bname}: first run x={x} (predicted peak {peak / 2**30:.2f} GiB): "
                    + lr.shell_join(runner.bench_argv(lp.variant_args(shape, variant, x))))
            for offset in (-0.5e9, 0.0, 0.5e9, 1.0e9):
                runs, c = [], c0
                for bname, b in budgets:
                    res = lp.search_fit(shape, variant.mode, b + allowance,
                                        lambda x, t=c0 + offset, shape=shape, mode=variant.mode, n=runner.n_ctx:
                                        {"peak": t + lp.offloaded_bytes(shape, mode, x, n)}, c, n_ctx=runner.n_ctx)
                    c = res.learned_c if res.learned_c is not None else c
                    runs.append(f"{bname}: x " + ",".join(map(str, res.runs)) + f" -> {res.x}")
                say(f"    if the peak is {offset / 1e9:+.1f} GB off: " + "; ".join(runs))
    return 0


# ---- Slipstream, accelerate --------------------------------------------------------------------------
def use_profile(part: Partial, device: str) -> dict:
    """Point the engine at the committed H200 profile database (a copy: a new measurement may be added
    there) and record the profile the planner uses."""
    from engine.sharding.profile import ProfileDatabase

    if device != "sim" and "SLIPSTREAM_PROFILE_DB" not in os.environ:
        db = lb.work_dir() / "profile.json"
        committed = Path("docs/benchmarks/profiles/h200.json")
        if committed.is_file() and not db.is_file():
            db.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(committed, db)
        os.environ["SLIPSTREAM_PROFILE_DB"] = str(db)
    prof = ProfileDatabase.for_device(device).to_dict()
    part.meta["profile"] = prof
    part.meta["profile_db"] = os.environ.get("SLIPSTREAM_PROFILE_DB")
    part.save()
    return prof


def part_slipstream(args, part: Partial, deadline, command: str) -> int:
    from engine.bench.slipstream_runs import run_scenario
    from engine.bench.vram_poll import bare_context_bytes

    device = "sim" if args.dry_run else "cuda"
    use_profile(part, device)
    if "allowance_torch" not in part.meta:
        part.meta["allowance_torch"] = bare_context_bytes()
        say(f"torch allowance (a bare CUDA context + cuBLAS): {part.meta['allowance_torch'] / 2**20:.0f} MiB")
    from engine.bench.gpu_common import rates_probe

    probe = (lambda: rates_probe(16, 4, 0.02)) if args.dry_run else rates_probe     # (dry: a taste)
    for scenario in pick(args.models, args.dry_run):
        if not deadline.allows(120):
            say("deadline reached: the rest is left for a later call")
            break
        run_scenario(scenario, pick_budgets(args.budgets, args.dry_run), part, device, max(1, args.runs),
                     int(part.meta["allowance_torch"]), command, deadline, say=say, probe=probe)
        part.pack_logs()
    return 0


def part_accelerate(args, part: Partial, deadline, command: str) -> int:
    from engine.bench.accelerate_runs import run_scenario
    from engine.bench.vram_poll import bare_context_bytes

    if "allowance_torch" not in part.meta:
        part.meta["allowance_torch"] = bare_context_bytes()
    models = args.models or ("tiny-llama" if args.dry_run else "llama3-8b")
    for scenario in pick(models, args.dry_run):
        if scenario.kind == "vl":
            continue
        if not deadline.allows(150):
            say("deadline reached: the rest is left for a later call")
            break
        try:
            run_scenario(scenario, pick_budgets(args.budgets, args.dry_run), part, int(part.meta["allowance_torch"]),
                         command, deadline, say=say)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next scenario
            say(f"accelerate {scenario.model}: failed: {type(exc).__name__}: {exc}")
            part.meta.setdefault("errors", []).append(f"{scenario.model}: {type(exc).__name__}: {exc}")
        part.pack_logs()
    return 0


def part_vl(args, part: Partial, deadline, command: str) -> int:
    """The vision-language scenario (`engine.bench.vl_runs`): Slipstream and accelerate per budget."""
    from engine.bench.vl_runs import run_vl
    from engine.bench.vram_poll import bare_context_bytes

    use_profile(part, "sim" if args.dry_run else "cuda")
    if "allowance_torch" not in part.meta:
        part.meta["allowance_torch"] = bare_context_bytes()
    systems = tuple(s for s in (args.vl_systems or "slipstream,accelerate").split(","))
    run_vl(args, part, deadline, command, pick_budgets(args.budgets, args.dry_run), int(part.meta["allowance_torch"]),
           systems, say=say)
    return 0


# ---- co-run ------------------------------------------------------------------------------------------
def learned_c_default(args, model: str) -> float | None:
    for d in (Path(args.out), Path(args.prior) if args.prior else None):
        if d is None or not (d / "part-llamacpp.json").is_file():
            continue
        state = json.loads((d / "part-llamacpp.json").read_text()).get("state", {})
        c = state.get("learned_c", {}).get(f"{model}|llama.cpp-default/default")
        if c is not None:
            return float(c)
    return None


def part_corun(args, part: Partial, deadline, command: str) -> int:
    from engine.bench import corun as cr
    from engine.bench import llamacpp_plan as lp
    from engine.bench.gguf_shapes import gguf_shape

    scenario = pick(args.models, args.dry_run)[0]
    work = lb.work_dir() / "corun"
    sim_dir = str(work / "simcard") if args.dry_run else None
    cfg = cr.CorunConfig.dry(sim_dir) if args.dry_run else cr.CorunConfig(cap=args.cap, phases=args.phases)
    part.meta["config"] = vars(cfg)
    threads = max(1, (os.cpu_count() or 2) - 1)         # one core left for the game's own thread
    part.meta["threads"] = threads
    for system in args.corun_systems.split(","):
        slip = system.startswith("slipstream")
        key_row = {"system": system, "model": scenario.model, "budget": "auto" if slip else "fixed",
                   "scenario": "corun"}
        from engine.bench.partials import row_key

        if part.has(row_key(key_row)):
            continue
        need = cr._phases_s(cfg.phases) + 90
        if not deadline.allows(need):
            say(f"co-run {system}: {need:.0f} s needed, not enough left in this call")
            continue
        wdir = work / system
        if slip:
            argv = cr._py("engine.bench.corun_slipstream", "--model", scenario.model, "--cap", cfg.cap,
                          "--threads", str(threads),
                          "--overhead", "measured" if system.endswith("+overhead") else "none",
                          "--overhead-initial", cfg.overhead_initial, "--overhead-step", cfg.overhead_step,
                          "--force-plan", cfg.force_plan,
                          "--reserve", cfg.reserve, "--interval", str(cfg.interval), "--hysteresis", cfg.hysteresis,
                          "--slack", cfg.slack, "--log", str(wdir / "model.jsonl"),
                          "--ready-file", str(wdir / "model.ready"), "--stop-file", str(wdir / "stop"))
            if sim_dir:
                argv += ["--sim-dir", sim_dir, "--sim-context", cfg.sim_context]
            env, extra = None, {}
        else:
            bins = resolve_bins(args, part)
            if bins is None:
                part.add({**key_row, "note": "llama.cpp not available here (dry run without a build)"})
                continue
            gguf, _ = scenario_gguf(scenario, args)
            shape = gguf_shape(scenario.gguf_shape, scenario.layers)
            c = learned_c_default(args, scenario.model) or lp.DEFAULT.prior_c
            extra = {"c_bytes": c}
            argv = [str(bins / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", "64", "-r", "100000",
                    "--progress", "-t", str(threads), "-o", "jsonl"]
            env = lb.tool_env(bins)
        say(f"co-run {system} ({scenario.model}, cap {cfg.cap}, phases {cfg.phases})")
        make = (lambda a=argv: a) if slip else \
            (lambda a=argv, s=shape, e=extra: _with_ngl(a, s, cfg, e, _card_used(cfg)))
        raw = cr.run_system(system, cfg, wdir, make, env, say=say)
        summary = cr.summarize(system, cfg, wdir, raw)
        summary.update(extra)
        _copy_logs(wdir, part.log_dir / system)
        part.add({**key_row, **summary})
        g, m = summary.get("game_ooms"), summary.get("model_errors")
        say(f"  co-run {system}: game OOM attempts {g}, stall {summary.get('game_oom_stall_s')} s, "
            f"card over cap {summary.get('card_over_cap_s')} s, model errors {m}; per phase "
            + "; ".join(f"fps {p['game_fps'] or 0:.0f} / tok/s {p['model_tps'] or 0:.1f}"
                        for p in summary.get("per_phase", [])))
    return 0


def _card_used(cfg) -> int:
    """The device's used bytes now (the simulated card's in a dry run)."""
    from engine.bench.vram_poll import VramPoller

    if cfg.sim_dir:
        from engine.bench.simcard import SimCard

        return SimCard(cfg.sim_dir).nvmlDeviceGetMemoryInfo(0).used
    return VramPoller().device_used()


def _with_ngl(argv: list[str], shape, cfg, extra: dict, used: int) -> list[str]:
    """Insert the -ngl chosen at start: the largest predicted to fit what is free under the cap once
    the game holds its first working set, less the same reserve Slipstream's policy keeps."""
    from engine.bench import llamacpp_plan as lp
    from engine.units import parse_bytes

    extra["device_used_at_start"] = used
    free = parse_bytes(cfg.cap) - used - parse_bytes(cfg.reserve)
    x = max(0, lp.largest_fitting(shape, "ngl", extra["c_bytes"], free, n_ctx=64))
    extra.update(ngl=x, free_at_start=free)
    say(f"  llama.cpp co-run: {free / 2**30:.1f} GiB free under the cap at start -> -ngl {x}")
    return argv[:3] + ["-ngl", str(x)] + argv[3:]


def _copy_logs(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.suffix in (".jsonl", ".json", ".out", ".err"):
            shutil.copy(p, dst / p.name)


if __name__ == "__main__":
    sys.exit("use: python -m engine bench --gpu --part ...")
