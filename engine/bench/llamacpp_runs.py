"""The llama.cpp baselines: `llama.cpp-default` and `llama.cpp-tuned` rows at each budget.

For each scenario and budget: the default flags at the largest `-ngl` that fits, then each tuned variant
(see `llamacpp_plan.TUNED`) at its largest fitting configuration; the tuned row takes, per metric, the
best variant that fits (each variant's figures are kept in the row). Every llama-bench run is one
process (`-p 512,4096 -n 32 -r 1 -o jsonl`, llama-bench's own warm-up, all CPU threads) whose peak NVML
bytes are polled every 50 ms. Batched decode (`llama-batched-bench`, 4 and 16 sequences) runs after
every budget's main rows, where the deadline allows (see `run_batched`). Raw output of every process is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from engine.bench import llamacpp_plan as lp
from engine.bench.gguf_shapes import gguf_shape
from engine.bench.llamacpp_build import tool_env
from engine.bench.scenarios import BATCHES, DECODE_TOKENS, PROMPTS
from engine.bench.vram_poll import VramPoller, bare_context_bytes

RUN_TIMEOUT_S = 300
EST_RUN_S = 45          # a llama-bench run at a small -ngl (pp4096 twice at ~320 t/s dominates)


def run_process(argv: list[str], log_dir: Path, name: str, timeout_s: float, env: dict | None = None,
                poll_s: float = 0.05) -> dict:
    """Run one tool; its stdout/stderr/VRAM timeline go to `log_dir/name.*`. Returns
    {"rc", "seconds", "peak", "stdout", "stderr", "error"?}."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_p, err_p = log_dir / f"{name}.out", log_dir / f"{name}.err"
    t0 = time.perf_counter()
    timed_out = False
    with open(out_p, "w") as out, open(err_p, "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        with VramPoller([proc.pid], poll_s) as poll:
            try:
                rc = proc.wait(timeout=timeout_s)
                error = None if rc == 0 else f"exit status {rc}"
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                error = f"timed out after {timeout_s:.0f} s"
                timed_out = True
    secs = time.perf_counter() - t0
    (log_dir / f"{name}.vram.json").write_text(json.dumps(poll.timeline(t0, every=2)))
    rec = {"rc": rc, "seconds": round(secs, 2), "peak": poll.peak(proc.pid),
           "stdout": out_p.read_text(errors="replace"), "stderr": err_p.read_text(errors="replace")}
    if error:
        rec["error"] = error + ": " + " | ".join(rec["stderr"].strip().splitlines()[-3:])
    if timed_out:
        rec["abort"] = True          # cut by the time limit: no figure, and not a sign that it does not fit
    return rec


def shell_join(argv: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


class LlamaCppRunner:
    def __init__(self, bins: Path, gguf: Path, shape, threads: int, log_dir: Path, deadline, say=print,
                 prompts: tuple[int, ...] = PROMPTS, reps: int = 1):
        self.bins, self.gguf, self.shape, self.threads = bins, gguf, shape, threads
        self.log_dir, self.deadline, self.say = log_dir, deadline, say
        self.prompts = tuple(prompts)
        self.reps = max(1, int(reps))       # llama-bench -r: its figures are the mean of this many runs
        self.env = tool_env(bins)
        self.n = 0

    @property
    def n_ctx(self) -> int:
        """The largest context a run of this runner fills: the KV cache the VRAM prediction counts."""
        return max(self.prompts)

    def bench_argv(self, args: list[str], prompts=None, n_gen: int = DECODE_TOKENS) -> list[str]:
        return [str(self.bins / "llama-bench"), "-m", str(self.gguf), *args,
                "-p", ",".join(str(p) for p in prompts or self.prompts), "-n", str(n_gen), "-r", str(self.reps),
                "-t", str(self.threads), "-o", "jsonl"]

    def bench(self, variant: lp.Variant, x: int) -> dict:
        args = lp.variant_args(self.shape, variant, x)
        argv = self.bench_argv(args)
        self.n += 1
        name = f"{self.n:03d}-bench-{variant.name}-x{x}"
        rec = run_process(argv, self.log_dir, name, self.deadline.cap(RUN_TIMEOUT_S), self.env)
        parsed = lp.parse_llama_bench(rec.pop("stdout"))
        rec.pop("stderr")
        rec.update(x=x, args=args, command=shell_join(argv), log=name, **{k: v for k, v in parsed.items()})
        self.say(f"  {variant.key} x={x}: peak {rec['peak'] / 2**30:.2f} GiB, "
                 + ", ".join(f"{k} {parsed[k]:.1f}" for k in parsed if k != "records")
                 + (f" [{rec['error']}]" if rec.get("error") else ""))
        return rec

    def batched(self, args: list[str], n_prompt: int, n_ctx: int, batches=BATCHES,
                n_gen: int = DECODE_TOKENS) -> dict:
        flags = list(args)               # llama-batched-bench takes the same -lm/-ub/-b/-ot/-ngl flags
        argv = [str(self.bins / "llama-batched-bench"), "-m", str(self.gguf), *flags, "-fit", "off", "-pps",
                "-c", str(n_ctx), "-npp", str(n_prompt), "-ntg", str(n_gen),
                "-npl", ",".join(str(b) for b in batches), "-t", str(self.threads), "--output-format", "jsonl"]
        self.n += 1
        name = f"{self.n:03d}-batched"
        rec = run_process(argv, self.log_dir, name, self.deadline.cap(RUN_TIMEOUT_S), self.env)
        parsed = lp.parse_batched_bench(rec.pop("stdout") + "\n" + rec.pop("stderr"))
        rec.update(command=shell_join(argv), log=name, **parsed)
        return rec


def llamacpp_allowance(runner: LlamaCppRunner, tiny_gguf: Path) -> int:
    """NVML bytes of llama-bench holding a tiny model fully on the GPU: its CUDA context and buffers."""
    argv = [str(runner.bins / "llama-bench"), "-m", str(tiny_gguf), "-ngl", "99", "-p", "64", "-n", "4",
            "-r", "1", "-o", "jsonl"]
    rec = run_process(argv, runner.log_dir, "000-context", 120, runner.env)
    return int(rec["peak"])


def _best(variants: list[dict], key: str) -> dict | None:
    ok = [v for v in variants if v.get("fits") and v.get(key)]
    return max(ok, key=lambda v: v[key]) if ok else None


def row_from_run(system: str, model: str, budget: str, budget_b: int, run: dict | None, allowance: int,
                 note: str = "") -> dict:
    row = {"system": system, "model": model, "budget": budget, "budget_bytes": budget_b,
           "allowance_bytes": allowance}
    if run is None:
        row.update(peak_vram_bytes=None, prefill512_tps=None, prefill4096_tps=None, decode_tps=None,
                   command=None, fits=False, note=note or "no configuration fits this budget")
        return row
    row.update(peak_vram_bytes=run["peak"], prefill512_tps=run.get(f"pp{PROMPTS[0]}"),
               prefill4096_tps=run.get(f"pp{PROMPTS[1]}"), decode_tps=run.get(f"tg{DECODE_TOKENS}"),
               command=run["command"], plan={"x": run["x"], "flags": run["args"]}, fits=True, note=note)
    return row


def run_budget(runner: LlamaCppRunner, part, model: str, budget: str, budget_b: int, allowance: int,
               tuned: list[lp.Variant]) -> None:
    """The default row and the tuned row of one scenario at one budget (skipping what `part` has)."""
    limit = budget_b + allowance
    learned = part.state.setdefault("learned_c", {})
    results: dict[str, dict] = {}
    for variant in [lp.DEFAULT, *tuned]:
        key = f"{model}|{variant.key}|{budget}"
        done = part.state.setdefault("variant_runs", {})
        if key in done:
            results[variant.key] = done[key]
            continue
        if not runner.deadline.allows(EST_RUN_S):
            runner.say(f"  deadline: {variant.key} at {budget} left for a later call")
            part.state.setdefault("pending", []).append(key)
            break
        c0 = lp.c_prior(variant, learned, model, [lp.DEFAULT, *tuned])
        res = lp.search_fit(runner.shape, variant.mode, limit, lambda x, v=variant: runner.bench(v, x), c0,
                            n_ctx=runner.n_ctx)
        if res.aborted and res.best is None:
            runner.say(f"  {variant.key} at {budget}: cut by the time limit; left for a later call")
            part.state.setdefault("pending", []).append(key)
            break
        if res.aborted:                  # keep what fits from the runs that finished, and say so
            res.note = (f"search cut by the time limit; x={res.x} is the largest fitting configuration "
                        "that ran, a larger one may fit")
            runner.say(f"  {variant.key} at {budget}: {res.note}")
        if res.learned_c is not None:
            learned[f"{model}|{variant.key}"] = res.learned_c
        best = res.best
        summary = {"variant": variant.name, "system": variant.system, "fits": best is not None,
                   "note": res.note, "tried": [{"x": x, "peak": r.get("peak"), "error": r.get("error"),
                                                "log": r.get("log")} for x, r in res.runs.items()]}
        if best is not None:
            summary.update({k: best.get(k) for k in ("x", "args", "peak", "command", "seconds")},
                           **{k: v for k, v in best.items() if k.startswith(("pp", "tg"))})
        done[key] = summary
        results[variant.key] = summary
        part.save()
    default = results.get(lp.DEFAULT.key)
    runs_note = runs_note_for(runner.prompts, runner.reps)
    if default is not None:
        part.add(row_from_run("llama.cpp-default", model, budget, budget_b,
                              default if default.get("fits") else None, allowance,
                              note="defaults (-t all threads), the largest -ngl that fits" + runs_note))
    tuned_runs = [results[v.key] for v in tuned if v.key in results]
    if tuned_runs:                    # possibly of fewer variants than asked: the row's note lists them
        row = tuned_row(model, budget, budget_b, allowance, tuned_runs)
        row["note"] += runs_note
        part.add(row)
    part.save()


def runs_note_for(prompts: tuple[int, ...], reps: int = 1) -> str:
    """What a row's note adds when its llama-bench runs are not the standard `-p 512,4096 -n 32 -r 1`."""
    if tuple(prompts) == tuple(PROMPTS) and reps == 1:
        return ""
    missing = [str(p) for p in PROMPTS if p not in prompts]
    why = f" (no {'/'.join(missing)}-token prefill in these runs: every run reloads the model)" if missing else ""
    mean = f", the mean of {reps} runs" if reps > 1 else ""
    return f"; llama-bench -p {','.join(str(p) for p in prompts)} -n {DECODE_TOKENS} -r {reps}{why}{mean}"


def tuned_row(model: str, budget: str, budget_b: int, allowance: int, runs: list[dict]) -> dict:
    """Per metric, the best tuned variant that fits (generous to the baseline; variants recorded)."""
    pp5, pp4, tg = (f"pp{PROMPTS[0]}", f"pp{PROMPTS[1]}", f"tg{DECODE_TOKENS}")
    b_dec, b_pp4, b_pp5 = _best(runs, tg), _best(runs, pp4), _best(runs, pp5)
    row = row_from_run("llama.cpp-tuned", model, budget, budget_b, b_dec, allowance,
                       note="per metric the best fitting variant of: " + ", ".join(r["variant"] for r in runs))
    if b_dec is not None:
        row.update(prefill512_tps=b_pp5[pp5] if b_pp5 else None, prefill4096_tps=b_pp4[pp4] if b_pp4 else None,
                   decode_variant=b_dec["variant"], prefill4096_variant=b_pp4["variant"] if b_pp4 else None,
                   peak_vram_bytes=max(r["peak"] for r in (b_dec, b_pp4, b_pp5) if r))
    row["variants"] = runs
    return row


def run_batched(runner: LlamaCppRunner, part, model: str, budget: str, budget_b: int, allowance: int,
                tuned: list[lp.Variant]) -> None:
    """Batched decode (4 and 16 sequences sharing a 512-token prompt) for the default row and for the
    tuned row (its best decode variant), each at the largest configuration predicted to fit with the
    batch's larger KV cache (C learned from that variant's runs); the measured peak decides `fits`."""
    done = part.state.setdefault("variant_runs", {})
    learned = part.state.get("learned_c", {})
    n_ctx = max(BATCHES) * (PROMPTS[0] + DECODE_TOKENS) + 256
    for row in [r for r in part.rows if r.get("model") == model and r.get("budget") == budget
                and r["system"] in ("llama.cpp-default", "llama.cpp-tuned") and r.get("fits")]:
        key = f"{model}|batched|{row['system']}|{budget}"
        if key in done:
            continue
        if not runner.deadline.allows(EST_RUN_S):
            part.state.setdefault("pending", []).append(key)
            return
        name = "default" if row["system"] == "llama.cpp-default" else row.get("decode_variant")
        variant = next((v for v in (lp.DEFAULT, *tuned) if v.name == name), None)
        c = learned.get(f"{model}|{variant.key}") if variant else None
        if variant is None or c is None:
            continue
        x = lp.largest_fitting(runner.shape, variant.mode, c, budget_b + allowance, n_ctx)
        if x < 0:
            done[key] = {"fits": False, "note": "the batch's KV cache leaves no configuration that fits"}
            row["batched"] = done[key]
            part.save()
            continue
        args = lp.variant_args(runner.shape, variant, x)
        rec = runner.batched(args, PROMPTS[0], n_ctx)
        fits = rec["peak"] <= budget_b + allowance and not rec.get("error")
        done[key] = {k: v for k, v in rec.items() if k != "records"} | {"x": x, "fits": fits}
        for b in BATCHES:
            row[f"decode_batch{b}_tps"] = rec.get(f"tg_b{b}") if fits else None
        row["batched"] = {"variant": variant.name, "x": x, "args": args, "peak": rec["peak"], "fits": fits,
                          "command": rec["command"], "error": rec.get("error"),
                          "note": "llama-batched-bench -pps (one shared 512-token prompt), 32 new tokens per "
                                  "sequence; -ngl chosen for the batch's KV cache"}
        runner.say(f"  batched {row['system']} x={x}: " + ", ".join(
            f"b{b} {rec.get(f'tg_b{b}') or 0:.1f} t/s" for b in BATCHES) + f", peak {rec['peak'] / 2**30:.2f} GiB"
            + ("" if fits else " (over budget)"))
        part.add(row)


def default_threads() -> int:
    return os.cpu_count() or 1


def prepare_gguf(scenario, work: Path, vocab_dir: Path | None, dtype: str, say=print) -> tuple[Path, dict]:
    """The scenario's GGUF in the work folder (written once per lease, reused when its stamp matches)."""
    from engine.bench.gguf_shapes import write_gguf

    shape = gguf_shape(scenario.gguf_shape, scenario.layers)
    path = work / "models" / f"{scenario.model}-{dtype}.gguf"
    stamp = path.with_suffix(".json")
    if path.is_file() and stamp.is_file():
        facts = json.loads(stamp.read_text())
        if facts.get("bytes") == path.stat().st_size:
            return path, facts
    t0 = time.perf_counter()
    facts = write_gguf(shape, path, vocab_dir, dtype)
    facts["seconds"] = round(time.perf_counter() - t0, 1)
    stamp.write_text(json.dumps(facts))
    say(f"wrote {path} ({facts['bytes'] / 1e9:.1f} GB) in {facts['seconds']} s")
    return path, facts


def warm_page_cache(path: Path) -> threading.Thread:
    def read():
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def bare_torch_allowance() -> int:
    return bare_context_bytes()
