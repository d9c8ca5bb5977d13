"""The PyTorch backend: loads a model, plans its placement for the VRAM budget, runs it, re-plans live.

Devices: "cpu" (no accelerator, everything on the CPU), "sim" (the CPU standing in for a GPU: the same
placement, streaming and byte accounting as on CUDA), "cuda"/"cuda:N". `set_vram_budget` may be called
from any thread at any time: a running step picks the new budget up at its next sub-layer boundary,
releases what no longer fits, hands the memory back to the driver and goes on; nothing is recomputed.

`generate` runs one request at a time; `submit` (and `generate_batch`) put requests into one running batch
(`engine.scheduler`), whose steps run on a background thread and interleave with `generate` and `score`
at step boundaries.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.api import Engine
from engine.errors import BadInputError, BudgetError, OutOfBudgetError
from engine.generation import CancelToken, Sampler, SamplingParams
from engine.scheduler import DEFAULT_MAX_RUNNING, Completion, Request, RequestHandle, Scheduler
from engine.sharding.executor import StepItem
from engine.sharding.kvcache import BLOCK_SIZE, Sequence
from engine.sharding.plan import DEFAULT_TIERS, PLAN_KINDS, Placement
from engine.sharding.spec import ModelSpec
from engine.units import parse_bytes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CONTEXT = 8192
OOM_RETRIES = 3                  # out-of-memory back-offs after which the next request tries the asked budget again
SIM_DEFAULT_BUDGET = 1 << 40     # "sim" without a budget: a notional GPU with room for everything
RATE_PROBE_WEIGHT_MIB = 512      # the rate probe at open (_at_rates_now): pinned FFN-shaped weights the CPU reads,
RATE_PROBE_COPY_MIB = 64         # a pinned buffer copied to the GPU (the most VRAM it takes),
RATE_PROBE_MIN_S = 0.2           # and the shortest timed pass
INITIAL_KV_TOKENS = 2048
IN_FORCE = -1             # a queued re-plan for the budget in force when it runs
KV_CUT_FLOOR_TOKENS = 64  # a budget drop cuts the KV capacity to twice the tokens in use, never below this
# A prompt of one step stays on the decode plan where its own tier's plan would save less than the switch
# there and back costs: the weights moved each way over PCIe plus this much (see _staying_pays)
PLAN_SWITCH_MS = 10.0
SPEC_TOKENS = 6           # most tokens an n-gram proposal adds to a step
SMALL_STEP = 16          # steps of up to this many tokens share one plan (see _plan_for_step)
# The thread that prices a new KV capacity's plans works while no step has run for REFINE_IDLE_S, and
# otherwise one block (a few milliseconds) per REFINE_MAX_WAIT_S; SLIPSTREAM_REFINE_YIELD=0: never waits
# (A/B runs: engine.bench.refine_contention)
REFINE_IDLE_S = 0.05
REFINE_MAX_WAIT_S = 1.0
REFINE_YIELD = os.environ.get("SLIPSTREAM_REFINE_YIELD", "1") != "0"
SPEC_PROBE_EVERY = 16    # with speculation judged not to pay, still try a verify step this often
SPEC_EMA = 0.2           # weight of the newest step in the measured step times
SPEC_MAX_COST = 1.3       # speculate when a step of SPEC_TOKENS + 1 tokens is predicted under 1.3x one


def _is_vl_folder(path) -> bool:
    from engine.loading.hf_vision import is_vl_folder

    return Path(path).is_dir() and is_vl_folder(Path(path))


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device in ("cpu", "sim"):
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise BadInputError(f"device={device!r}: no CUDA GPU is available to PyTorch here")
        return device
    raise BadInputError(f"device={device!r}: expected 'auto', 'cpu', 'sim', 'cuda' or 'cuda:N'")


def cut_kv_tokens(blocks_in_use: int) -> int:
    """The KV capacity a budget drop cuts to: twice the tokens in use, at least the floor, rounded up to
    a power of two."""
    need = max(2 * blocks_in_use * BLOCK_SIZE, KV_CUT_FLOOR_TOKENS)
    return 1 << (need - 1).bit_length()


class TorchEngine(Engine):
    """`path`: a GGUF file or Hugging Face folder, or an already loaded `LoadedModel` (benchmarks)."""

    backend = "torch"

    def __init__(self, path, *, device: str = "auto", vram_budget=None, n_ctx: int | None = None,
                 tiers: tuple[int, ...] = DEFAULT_TIERS, kind: str = "auto", profile=None,
                 progress=None, speculative: bool | None = None, kv_dtype: str | None = None,
                 host_kv_gib: float | None = None,
                 max_kv_tokens: int | None = None, max_batch: int = DEFAULT_MAX_RUNNING,
                 max_step_tokens: int | None = None):
        super().__init__()
        from engine.loading import LoadedModel, load_model
        from engine.sharding.device import Accelerator
        from engine.sharding.executor import Executor

        self.device = resolve_device(device)
        report = progress or (lambda fraction, message: None)
        report(0.05, "reading the model")
        self.vision = self.vision_weights = None
        self._vision_prompts: dict[int, object] = {}
        from engine.loading.hf_vision import LoadedVLModel

        if isinstance(path, LoadedModel):
            loaded = path
        elif isinstance(path, LoadedVLModel) or _is_vl_folder(path):
            from engine.loading.hf_vision import load_hf_vl

            vl = path if isinstance(path, LoadedVLModel) else load_hf_vl(Path(path))
            loaded = LoadedModel(vl.config, vl.weights, vl.tokenizer, vl.source, "hf", vl.config.dtype)
            self.vision, self.vision_weights = vl.vision, vl.vision_weights
            del vl
        else:
            loaded = load_model(path)
        self.source = str(loaded.source)
        self.file_type = loaded.file_type
        self.config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = _DTYPES[cfg.dtype]
        self.context_length = min(n_ctx or min(cfg.max_position_embeddings, DEFAULT_CONTEXT),
                                  cfg.max_position_embeddings)
        # KV capacity planned for: starts small (short chats get better plans) and grows with the
        # conversation (or the batch), each growth a re-plan, up to `max_kv_tokens`: the most the
        # sequences of a batch hold together (at least one full context).
        if max_kv_tokens is not None and (not _whole(max_kv_tokens) or max_kv_tokens < self.context_length):
            raise BadInputError(f"max_kv_tokens={max_kv_tokens!r}: expected a number of tokens that holds at "
                                f"least one context ({self.context_length} tokens)")
        if not _whole(max_batch) or max_batch < 1:
            raise BadInputError(f"max_batch={max_batch!r}: expected a number of requests, 1 or more")
        if max_step_tokens is not None and (not _whole(max_step_tokens) or max_step_tokens < 1):
            raise BadInputError(f"max_step_tokens={max_step_tokens!r}: expected a number of tokens, 1 or more")
        self.max_kv_tokens = int(max_kv_tokens or 4 * self.context_length)
        self.kv_tokens = self._kv_capacity(min(self.context_length, INITIAL_KV_TOKENS))
        if kv_dtype not in (None, "fp8"):
            raise BadInputError(f"kv_dtype={kv_dtype!r}: expected None (the model's precision) or 'fp8'")
        self.kv_dtype = kv_dtype
        self.spec = ModelSpec.from_config(cfg, kv_dtype=kv_dtype).widened(
            n for n, w in loaded.weights.items() if w.is_floating_point() and w.element_size() > self.dtype.itemsize)
        if self.device == "cpu":
            self.accel = None
        else:
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            self.accel = Accelerator("sim" if self.device == "sim" else "cuda", index)
        from engine import kernels

        kernels.prepare_async()                     # the native CPU matmul builds while weights are packed
        report(0.6, "packing weights into host memory")
        self.transfer_code = self._transfer_code_wanted()
        self.executor = Executor(cfg, loaded.weights, self.accel, self.dtype, kv_fp8=kv_dtype == "fp8",
                                 transfer_code=self.transfer_code)
        store = self.executor.store
        self.spec = self.spec.with_transfer(store.transfer_bytes(), store.stage_bytes, store.escape_index_bytes)
        self._set_host_kv(host_kv_gib)
        if self.vision is not None:
            from engine.models.vision import MRotaryTable
            from engine.models.vision.vision_pass import VisionPass

            self.executor.rope = MRotaryTable(cfg.head_dim, cfg.rope_theta, self.vision.mrope_section)
            self.supports_images = True
            # The tower's weights stay in (pinned) host memory, packed per block; passes stream them.
            self.vision_pass = VisionPass(self.vision, self.vision_weights, self.accel, self.dtype)
            self.vision_weights = self.vision_pass.host_weights
        del loaded
        report(0.85, "planning placement for the VRAM budget")
        self.tiers = tuple(sorted(tiers))
        self._forced = "auto"
        self._on_cpu: tuple[str, ...] = ()        # sub-layer name patterns every plan computes on the CPU (move_to_cpu)
        self._planner = None
        self._profile = profile
        self.rate_probe: dict | None = None       # the rates the plans were moved to (_at_rates_now)
        # small-step tiers planned apart from the prompts' (Planner split_small; SLIPSTREAM_PLAN_SPLIT=1)
        self._split_plans = os.environ.get("SLIPSTREAM_PLAN_SPLIT", "0") == "1"
        # the decode tier may stream through one slot where the planner prices that faster
        # (planner.ONE_SLOT_TIERS; off by default, SLIPSTREAM_ONE_SLOT_DECODE=1 allows it)
        self._one_slot = os.environ.get("SLIPSTREAM_ONE_SLOT_DECODE", "0") == "1"
        # a CPU share of the streamed dense FFNs' rows (Plan.ffn_cpu_rows): True = where the planner predicts
        # it faster (SLIPSTREAM_FFN_SHARE=1), False = never (the default: measured slower on the H200, see
        # planner.SHARE_STEPS), N = N rows in every plan (benchmarks' A/B runs)
        self._ffn_share: bool | int = os.environ.get("SLIPSTREAM_FFN_SHARE", "0") == "1"
        self.planset = None
        self._pending_budget: int | None = None
        self._pending_reason = "set_vram_budget"
        self._wanted_budget = 0            # the budget asked for (open, set_vram_budget)
        self._retry_wanted = False         # an out-of-memory back-off: the next prompt tries it again
        self._oom_retries = OOM_RETRIES
        self._budget_lock = threading.Lock()
        self._refining = False                    # a thread prices the plans of a cut KV capacity
        # (tiers, tokens) -> whether such a step stays on the plan in place, for the plan set in `_stay_of`
        self._stay_cache: dict = {}
        self._stay_of = None
        self._stayed = False                      # the last step stayed on the plan in place (_plan_for_step)
        # Steps running now and when the last one ended: that thread prices only while no step has run
        # for REFINE_IDLE_S (see `_refine_pause`)
        self._steps_running = 0
        self._last_step_end = 0.0
        self._activity = threading.Condition()
        self.refines = {"count": 0, "seconds": 0.0}   # (its runs: on the host beside the steps)
        self.replans: list[dict] = []             # history of re-plans (time, budget, reason, ms)
        self.speculative = speculative            # None: greedy decoding speculates where measured to pay
        self.spec_stats = {"proposed": 0, "accepted": 0}
        # Called with each speculative decode step's record ({"fed", "accepted", "next", "ms"}) where set
        # (benchmarks record real acceptance patterns with it: engine.bench.ngram_speedup).
        self.spec_observer = None
        self._spec_timing: dict[str, float | None] = {"plain": None, "verify": None, "gain": None}
        self.executor.between_sublayers = self._apply_pending_budget
        self.scheduler = Scheduler(self, self.max_kv_tokens // BLOCK_SIZE, max_batch, max_step_tokens)
        self._batch_cond = threading.Condition()
        self._batch_thread: threading.Thread | None = None
        self._batch_closing = False
        self.budget = 0
        if kind != "auto":
            self.force_plan(kind)
        self._wanted_budget = self._initial_budget(vram_budget)
        self._set_budget_now(self._wanted_budget, "open")
        if self.accel is not None and self.accel.kind == "cuda":
            # room in pinned host memory for the KV that sits in VRAM now: a budget drop spills it at once
            self.executor.kv.host.prewarm(self.executor.kv.gpu_bytes())
        report(1.0, "ready")

    def _set_host_kv(self, gib) -> None:
        """Cap of the host-RAM KV tier (blocks leaving VRAM are kept there); None: the default (4 GiB,
        or a quarter of the free RAM if less)."""
        if gib is None:
            return
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib >= 0:
            raise BadInputError(f"host_kv_gib={gib!r}: expected a number of GiB, 0 or more")
        self.executor.kv.set_host_capacity(int(gib * (1 << 30)))

    def _cut_kv_to_use(self) -> None:
        """On a budget drop the KV capacity falls back to what the sequences in use need (twice that, the
        growth rule, rounded up to a power of two: the drops of a long game session land on a few
        capacities whose plans are priced once); cached blocks past it go to the host-RAM tier, to come
        back by copy when wanted."""
        kv = self.executor.kv
        self.kv_tokens = min(self.kv_tokens, self._kv_capacity(cut_kv_tokens(kv.blocks_in_use())))
        kv.shrink(self.kv_tokens // BLOCK_SIZE)

    # ---- budget and plans ----------------------------------------------------------------------
    def _kv_capacity(self, tokens: int) -> int:
        return min(-(-tokens // BLOCK_SIZE) * BLOCK_SIZE, -(-self.max_kv_tokens // BLOCK_SIZE) * BLOCK_SIZE)

    def _fit_kv_to_request(self, tokens: int, step_tokens: int = 1) -> None:
        """At a request's start: a KV capacity grown for an earlier, longer context (its blocks stay cached
        for a prompt that shares them) is cut back to twice what the running sequences and this request's
        `tokens` need, rounded up to a power of two and at least INITIAL_KV_TOKENS, where that is less.
        The plan in force booked VRAM for that capacity's cache on the GPU attention layers; the re-plan
        gives it to weights (Llama-3-8B at 4 GiB after a 4096-token prompt: 114.7 ms predicted per token
        against 111.6 at the initial capacity). Cached blocks past the cut go to the host-RAM tier and come
        back by copy when a prompt wants them. A conversation that grows keeps its capacity."""
        if self.accel is None:
            return
        kv = self.executor.kv
        need = kv.blocks_in_use() + -(-tokens // BLOCK_SIZE)
        target = self._kv_capacity(max(cut_kv_tokens(need), INITIAL_KV_TOKENS))
        if target >= self.kv_tokens:
            return
        if self._apply_pending_budget() and target >= self.kv_tokens:   # (a drop queued meanwhile goes
            return                                                      # first, and may have cut it already)
        self.kv_tokens = target
        kv.shrink(target // BLOCK_SIZE)
        self._replan_or_back_off(self.budget, f"KV capacity cut to {target} tokens for a shorter request",
                                 step_tokens)

    def _ensure_kv_capacity(self, tokens: int, step_tokens: int = 1) -> None:
        """Grow the KV capacity to hold `tokens` (re-planned; `step_tokens`: the new tokens of the step
        about to run, whose plan the re-plan brings in where it would replace the one-token plan at once)."""
        if tokens > self.kv_tokens:
            self._apply_pending_budget()     # (a drop queued meanwhile first: never re-plan at the old budget)
            self.kv_tokens = self._kv_capacity(max(tokens, 2 * self.kv_tokens))
            self._replan_or_back_off(self.budget, f"context grew to {tokens} tokens", step_tokens)

    def _replan_or_back_off(self, budget: int, reason: str, step_tokens: int = 1) -> None:
        """`_set_budget_now`, and where its re-plan runs short (the pools grown for a longer context meet the
        allocator's cap, session 25 call BJ; the plan of a prompt's step, brought in by a KV cut, finds the
        process overhead grown by kernels loaded since the budget was set, session 29 calls CI and CJ: the
        MoE shape at 4 GiB, a few MiB over, the suite's row lost), a smaller budget, as after a step's
        out-of-memory, instead of an error for the request or for the caller of set_vram_budget (or of
        force_plan and the other switches that re-plan at once). As there, the budget asked for is tried again
        at a later request (`_retry_budget`)."""
        try:
            self._set_budget_now(budget, reason, step_tokens)
        except (torch.OutOfMemoryError, OutOfBudgetError) as exc:
            self.budget = budget                 # (backed off from the budget this re-plan was for)
            self._back_off(exc, 0)
            if self._oom_retries > 0 and self._wanted_budget > self.budget:
                self._oom_retries -= 1
                self._retry_wanted = True

    def _initial_budget(self, vram_budget) -> int:
        if vram_budget is not None:
            return parse_bytes(vram_budget, "vram_budget")
        if self.accel is None:
            return 0
        if self.accel.kind == "sim":
            return SIM_DEFAULT_BUDGET
        free, _total = torch.cuda.mem_get_info(self.accel.device)
        return max(0, free - (1 << 30))        # what the driver says is free, less a 1 GiB reserve

    def planner(self):
        if self._planner is None:
            from engine.sharding.planner import Planner
            from engine.sharding.profile import ProfileDatabase

            prof = self._profile
            if prof is None:
                prof = self._at_rates_now(ProfileDatabase.for_device(self.device))
            from engine.sharding.planner import ONE_SLOT_TIERS

            self._planner = Planner(self.spec, prof, tiers=self.tiers, split_small=self._split_plans,
                                    ffn_share=self._ffn_share is True,
                                    one_slot_tiers=ONE_SLOT_TIERS if self._one_slot else ())
        return self._planner

    def _at_rates_now(self, prof):
        """With SLIPSTREAM_RATE_PROBE=1, the stored profile moved to the CPU and PCIe rates of this machine now
        (`measure_link.probe_rates`, about two seconds, once per engine): the same machine's rates move with
        what else runs and from one boot or lease to the next, and a decode plan balances the CPU against
        PCIe. Off by default: on the H200 host (session 19, calls K and L) plans from the probed rates
        decoded within the run-to-run spread of the stored rates' plans (Llama-3-8B 4 GiB 10.48 against
        10.31 t/s, the MoE shape 32.4 / 29.2 against 32.2 / 28.6 at 4 / 2 GiB; medians of three runs
        taking turns in one engine), while two probes minutes apart on one lease read 128 and 103 GB/s.
        A profile given to the engine is used as is."""
        if (self.accel is None or self.accel.kind != "cuda" or not prof.has_gpu
                or os.environ.get("SLIPSTREAM_RATE_PROBE", "0") != "1"):
            return prof
        from engine.sharding.measure_link import probe_rates

        t0 = time.perf_counter()
        try:
            rates = probe_rates(RATE_PROBE_WEIGHT_MIB, RATE_PROBE_COPY_MIB, RATE_PROBE_MIN_S,
                                device=self.accel.device)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:      # (no room: plan from the stored rates)
            self.rate_probe = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            return prof
        finally:
            torch.cuda.empty_cache()
        scaled = prof.at_rates(rates)
        self.rate_probe = {**scaled.data["rates_scaled"], "seconds": round(time.perf_counter() - t0, 2)}
        return scaled

    def _make_planset(self, budget: int, kv_tokens: int | None = None):
        if self.accel is None:
            from engine.sharding.plan import Plan, PlanSet

            cpu = {s.name: Placement.CPU for s in self.spec.sublayers}
            return PlanSet(0, [Plan(t, "static", dict(cpu), 0) for t in self.tiers])
        kind = None if self._forced == "auto" else self._forced
        from engine.sharding import graphs

        # (the one-token CUDA graphs' pool and capture workspace stay out of the one-token plan: see
        # graphs.py; a larger tier's plan drops the graphs when it comes in, so it has the whole budget)
        reserve = graphs.reserve_for(budget, self.accel)
        planset = self.planner().plan(budget, kv_tokens=self.kv_tokens if kv_tokens is None else kv_tokens,
                                      force_kind=kind, tier_reserve={1: reserve} if reserve else None)
        if self._on_cpu:
            from engine.sharding.plan import PlanSet
            from engine.sharding.planner import best_step_tokens

            # (a move to the GPU that would not fit a tier's budget leaves that tier's plan as it was)
            moved = [self.planner().moved_to_cpu(p, self._on_cpu) for p in planset.plans]
            plans = [m if m.vram.total <= budget - (reserve if p.tier == 1 else 0) else p
                     for m, p in zip(moved, planset.plans)]
            planset = PlanSet(planset.budget, plans, step_tokens=best_step_tokens(plans))
        if self._ffn_share is not True and self._ffn_share is not False:
            from engine.sharding.plan import PlanSet
            from engine.sharding.planner import best_step_tokens

            plans = [self.planner().with_ffn_rows(p, int(self._ffn_share)) for p in planset.plans]
            planset = PlanSet(planset.budget, plans, step_tokens=best_step_tokens(plans))
        return planset

    def _kv_to_plan_for(self) -> int:
        """The KV capacity a re-plan prices. One never priced before (a budget drop cut the capacity, or the
        conversation grew it) is planned with the nearest larger capacity already priced, whose plans book
        more KV than needed and so fit, while a thread prices the exact one and re-plans when it is ready:
        the game's memory comes back in milliseconds, and decode does not stall, instead of waiting the
        second or two an 8B model's member tables take."""
        planner = self.planner()
        if planner.has_table(self.kv_tokens):
            return self.kv_tokens
        near = planner.nearest_table(self.kv_tokens)
        if near is None:
            return self.kv_tokens
        self._refine_in_background()
        return near

    def _refine_in_background(self) -> None:
        with self._budget_lock:
            if self._refining:
                return
            self._refining = True

        def run() -> None:
            t0 = time.perf_counter()
            try:
                while self.executor is not None:
                    kv = self.kv_tokens
                    self.planner().warm(kv, self._refine_pause)
                    if kv == self.kv_tokens:
                        break
            finally:
                with self._budget_lock:
                    self._refining = False
                    self.refines["count"] += 1
                    self.refines["seconds"] += time.perf_counter() - t0
            if self.executor is not None:
                self._post_budget(None, f"plans for {self.kv_tokens} KV tokens priced")

        threading.Thread(target=run, name="slipstream-plan-refine", daemon=True).start()

    def _refine_pause(self) -> None:
        """Between blocks of the plan refinement: wait while steps run (or ran less than REFINE_IDLE_S ago,
        as between a request's decode steps), but never more than REFINE_MAX_WAIT_S, so a busy engine still
        gets its exact plans in the end, one block of a few milliseconds at a time. The thread holds the
        interpreter lock while it prices; beside a decode it cost the decode's host work more than it took."""
        if not REFINE_YIELD:
            return
        give_up = time.monotonic() + REFINE_MAX_WAIT_S
        with self._activity:
            while self.executor is not None:
                now = time.monotonic()
                idle_at = self._last_step_end + REFINE_IDLE_S
                if (not self._steps_running and now >= idle_at) or now >= give_up:
                    return
                # (a running step notifies when it ends; otherwise wake when the engine has been idle long enough)
                self._activity.wait((give_up if self._steps_running else min(give_up, idle_at)) - now)

    def _step_activity(self, delta: int) -> None:
        with self._activity:
            self._steps_running += delta
            if delta < 0:
                self._last_step_end = time.monotonic()
                self._activity.notify_all()

    def _set_budget_now(self, budget: int, reason: str, step_tokens: int = 1) -> None:
        """Re-plan for `budget` and bring memory to the new plan (called with the engine idle or at a
        sub-layer boundary of the running step): the one-token plan's, or that of a step of `step_tokens`
        about to run (`_first_plan`)."""
        t0 = time.perf_counter()
        if self.accel is not None:
            self.accel.refresh_overhead()
        room = budget if self.accel is None else self.accel.usable(budget)   # less the process overhead
        shrinking = self.accel is not None and room < self.accel.budget
        if shrinking:
            self._cut_kv_to_use()
        planset = self._make_planset(room, None if self.accel is None else self._kv_to_plan_for())
        if self.accel is not None and not shrinking:
            self.accel.budget = room
            self.accel.cap_allocator(budget)
        self.planset = planset
        self.executor.activate(self._first_plan(planset, step_tokens), kv_blocks=self.kv_tokens // BLOCK_SIZE)
        if shrinking:
            self.accel.budget = room
            self.executor.release_to_driver()
            self.accel.cap_allocator(budget)
        self.budget = budget
        self.replans.append({"time": time.time(), "budget": budget, "reason": reason,
                             "replan_ms": (time.perf_counter() - t0) * 1e3})
        del self.replans[:-100]

    def _first_plan(self, planset, step_tokens: int):
        """The plan a re-plan brings memory to: the one-token plan, unless a larger step is about to run (a
        prompt whose KV growth or cut asked for the re-plan) that `_plan_for_step` would not keep on it. Its
        own plan then comes in at once, not after the one-token plan's weights have come in for nothing:
        on the H200 the Llama-3-8B shape's first 4096-token prompt at 8 GiB after shorter ones spent 142-204
        ms in the one-token plan's activation before its step (session 25, calls BJ, BL)."""
        small = planset.for_tokens(1)
        step_tokens = min(step_tokens, planset.step_tokens or planset.plans[-1].tier)   # (a prompt's first step)
        if step_tokens <= SMALL_STEP or self.accel is None:
            return small
        plan = planset.for_tokens(step_tokens)
        if plan is small or (not self._stayed and self._staying_pays(small, plan, step_tokens)):
            return small                        # (as `_plan_for_step` decides for the small plan in place)
        return plan

    def _apply_pending_budget(self) -> bool:
        if self._pending_budget is None:      # (called between every two sub-layers: no lock while idle)
            return False
        with self._budget_lock:
            budget, self._pending_budget = self._pending_budget, None
            reason, self._pending_reason = self._pending_reason, "set_vram_budget"
        if budget is None:
            return False
        self._replan_or_back_off(self.budget if budget == IN_FORCE else budget, reason)
        return True

    def _post_budget(self, budget: int | None, reason: str) -> None:
        """Queue a re-plan for `budget` (None: the budget in force when it is applied, unless another is
        already queued) and apply it now if the engine is idle, else at the next sub-layer boundary. (The
        budget in force is read when the re-plan runs: a plan refinement that finished while a budget drop
        was still being applied had queued the budget from before the drop, which then came back.)"""
        with self._budget_lock:
            if budget is None:
                if self._pending_budget is not None:
                    return
                budget = IN_FORCE
            self._pending_budget, self._pending_reason = budget, reason
        if self._lock.acquire(blocking=False):   # idle: apply now, in the caller's thread
            try:
                if self.executor is not None:
                    self._apply_pending_budget()
            finally:
                self._lock.release()

    def set_vram_budget(self, n_bytes) -> None:
        """Re-plan for a new budget (bytes or "4GiB"; None = what the driver reports free, less a
        reserve). Safe from any thread: mid-generation it takes effect at the next sub-layer boundary."""
        self._require_open()
        budget = self._initial_budget(None) if n_bytes is None else parse_bytes(n_bytes, "vram_budget")
        if budget > 0 and self.accel is None:
            # A CPU-only engine has no VRAM to use; the budget is recorded and has no effect.
            self.budget = budget
            return
        self._wanted_budget, self._oom_retries, self._retry_wanted = budget, OOM_RETRIES, False
        self._post_budget(budget, "set_vram_budget")

    def force_plan(self, kind: str) -> None:
        if kind != "auto" and kind not in PLAN_KINDS:
            raise BadInputError(f"plan kind {kind!r}: expected 'auto' or one of {', '.join(PLAN_KINDS)}")
        self._forced = kind
        if self.planset is not None:
            self._require_open()
            with self._lock:
                self._replan_or_back_off(self.budget, f"force_plan {kind}")

    def use_profile(self, prof) -> None:
        """Plan from `prof` (a ProfileDatabase) from now on, re-planning at once (benchmarks compare two
        profiles' plans in one engine, which takes the lease and the process out of the comparison)."""
        self._require_open()
        with self._lock:
            self._profile, self._planner = prof, None
            if self.planset is not None:
                self._replan_or_back_off(self.budget, "profile changed")

    def split_plans(self, flag: bool) -> None:
        """Plan the small-step tiers (decode, small batches) apart from the prompts' tiers from now on
        (`Planner(split_small=True)`: they may keep fewer layers' KV cache or another head placement in
        VRAM, the moves at each switch priced), re-planning at once; False goes back to one choice for all
        tiers. Off by default (SLIPSTREAM_PLAN_SPLIT=1 turns it on): measured on the GPU machine only
        against the shared choice, in one engine (`engine.bench.decode_runs --split-variants`)."""
        self._require_open()
        with self._lock:
            self._split_plans, self._planner = bool(flag), None
            if self.planset is not None:
                self._replan_or_back_off(self.budget,
                                         f"small-step tiers planned {'apart' if flag else 'with the rest'}")

    def one_slot_decode(self, flag: bool) -> None:
        """Whether the decode tier may stream through one slot where the planner prices that faster
        (`planner.ONE_SLOT_TIERS`; off by default, SLIPSTREAM_ONE_SLOT_DECODE=1 turns it on), re-planning at
        once: benchmarks set the two beside each other in one engine (`engine.bench.decode_runs
        --one-slot-variants`)."""
        self._require_open()
        with self._lock:
            self._one_slot, self._planner = bool(flag), None
            if self.planset is not None:
                self._replan_or_back_off(self.budget,
                                         f"decode tier {'may stream through one slot' if flag else 'keeps two slots'}")

    def ffn_share(self, setting: bool | int) -> None:
        """Whether the CPU may compute a share of the streamed dense FFNs' rows (`Plan.ffn_cpu_rows`): True
        where the planner predicts it faster, False (the default) never, an int N that many rows in every
        plan that streams a dense FFN, whatever the planner chose (benchmarks set the shares beside each
        other in one engine; the tokens are the same). Re-plans at once."""
        self._require_open()
        if not isinstance(setting, bool) and int(setting) < 0:
            raise BadInputError(f"ffn_share {setting!r}: expected True, False or a number of rows")
        with self._lock:
            self._ffn_share = setting if isinstance(setting, bool) else int(setting)
            if self._planner is not None:
                self._planner.ffn_share = self._ffn_share is True
            self.executor.ffn_share = self._ffn_share is not False
            if self.planset is not None:
                self._replan_or_back_off(self.budget, f"ffn share {self._ffn_share}")

    def move_to_cpu(self, patterns: tuple[str, ...] | list[str] = ()) -> None:
        """From now on compute the sub-layers whose names match `patterns` ("layers.*.attn", "head") on the
        CPU in every plan, whatever the planner chose, or place them as an entry "PATTERN=PLACE" says
        ("head=resident", "layers.*.attn=streamed"; "kv_layers=N" sets the GPU-resident KV prefix; a tier
        whose moved plan would not fit its budget keeps the planner's), re-planning at once; () goes back to
        the planner's plans. For benchmarks that set a placement beside the chosen one in one engine (the
        tokens are the same under any plan)."""
        self._require_open()
        from engine.sharding.planner import parse_move

        for entry in patterns:
            parse_move(entry)               # (a bad entry fails here, before anything moves)
        with self._lock:
            self._on_cpu = tuple(patterns)
            if self.planset is not None:
                self._replan_or_back_off(self.budget, f"sub-layers moved to the CPU: {', '.join(patterns) or 'none'}")

    def plan_report(self) -> dict:
        self._require_open()
        rep = self.planset.report()
        rep.update(device=self.device, forced=self._forced, moved_to_cpu=list(self._on_cpu), context_tokens=self.kv_tokens,
                   model_bytes=self.spec.total_weight_bytes, backend="torch")
        if self.accel is not None:
            rep["in_use"] = dict(self.accel.used, total=self.accel.total_used, peak=self.accel.peak)
            rep["process_overhead"] = {"bytes": self.accel.overhead, "source": self.accel.overhead_source,
                                       "bookable": self.accel.budget}
            rep["expandable_segments"] = self.accel.expandable_segments
            coded = self.executor.store.coded
            rep["transfer_coding"] = {"on": self.transfer_code, "sublayers": len(coded),
                                      "coded_bytes": sum(c.nbytes for c in coded.values()),
                                      "raw_bytes": sum(c.raw_bytes for c in coded.values())}
        from engine import kernels

        rep["cpu_matmul"] = kernels.status()
        rep["rate_probe"] = self.rate_probe
        rep["split_plans"] = self._split_plans
        rep["one_slot_decode"] = self._one_slot
        if self.vision is not None:
            rep["vision"] = self._vision_report()
        return rep

    def _require_open(self) -> None:
        if self.executor is None:
            raise BadInputError(f"{Path(self.source).name}: the model was closed")

    def _transfer_code_wanted(self) -> bool:
        """Whether streamed bf16 sub-layers move transfer-coded (`engine.sharding.transfer_code`): lossless,
        25% fewer bytes over PCIe, for a coded copy in host memory of 75% of the weights' bytes.
        By default on where the host has room for the copy beside a reserve for everything else (a quarter
        of its memory, at least 4 GiB), and room while the engine opens (the packed buffers and the coded
        copy beside the weights as loaded, 2 GiB to spare); `SLIPSTREAM_TRANSFER_CODE=1`/`0` decides instead. On CUDA it also
        needs the fused decode to build and run here (`transfer_code.cuda_decode_works`: Triton and a C
        compiler for its launcher); "sim" decodes with tensor operations."""
        from engine.sharding import transfer_code

        if self.accel is None or self.dtype != torch.bfloat16:
            return False
        forced = transfer_code.enabled_by_env()
        if forced is False or (forced is None and not self._host_room_for_coding()):
            return False
        return self.accel.kind != "cuda" or transfer_code.cuda_decode_works(self.accel.device)

    def _host_room_for_coding(self) -> bool:
        try:
            import psutil
        except ImportError:
            return False
        mem = psutil.virtual_memory()
        weights = self.spec.total_weight_bytes
        # (asked before the weights are packed: while the engine opens, the packed buffers and the coded copy
        # stand beside the weights as loaded, which are let go after; once open, the coded copy stays)
        opening = mem.available - 1.76 * weights >= 2 << 30
        return opening and mem.available - 0.76 * weights >= max(mem.total // 4, 4 << 30)

    def stats(self) -> dict:
        s = super().stats()
        if self.executor is None:
            return s
        kv = self.executor.kv
        coded = self.executor.store.coded
        s.update(transfer_coded_sublayers=len(coded), transfer_coded_bytes=sum(c.nbytes for c in coded.values()),
                 transfer_coded_ratio=(round(sum(c.nbytes for c in coded.values())
                                             / max(sum(c.raw_bytes for c in coded.values()), 1), 4)
                                       if coded else None),
                 transfer_coded_tight_chunks=sum(ch.tight for c in coded.values() for ch in c.chunks))
        s.update(budget=self.budget, plan=self.executor.plan.kind if self.executor.plan else None,
                 streamed_bytes=self.executor.copied_bytes, replans=len(self.replans),
                 spec_proposed=self.spec_stats["proposed"], spec_accepted=self.spec_stats["accepted"],
                 spec_plain_ms=self._spec_timing["plain"], spec_verify_ms=self._spec_timing["verify"],
                 spec_tokens_per_verify=self._spec_timing["gain"],
                 prefix_hit_tokens=kv.prefix_stats["hit_tokens"],
                 prefix_hit_rate=kv.prefix_stats["hit_tokens"] / max(kv.prefix_stats["prompt_tokens"], 1),
                 last_replan_ms=self.replans[-1]["replan_ms"] if self.replans else None,
                 plan_refines=self.refines["count"], plan_refine_s=round(self.refines["seconds"], 3))
        s.update(kv.host_report())
        if self.executor.graphs is not None:
            s.update(self.executor.graphs.stats())
        if self.vision is not None:
            last = self.vision_pass.last or {}
            s.update(vision_passes=self.vision_pass.passes, vision_where=last.get("where"),
                     vision_ms=last.get("measured_ms"), vision_predicted_ms=(last.get("plan") or {}).get("predicted_ms"),
                     vision_vram_bytes=last.get("booked_bytes"))
        b = self.scheduler.stats()
        s.update(running=b["running"], waiting=b["waiting"], batch_size=b["batch_size"],
                 batch_tokens=b["batch_tokens"], max_batch_size=b["max_batch_size"], batch_steps=b["steps"],
                 preemptions=b["preemptions"], preemptions_to_host=b["preemptions_to_host"])
        return s

    # ---- running steps -------------------------------------------------------------------------
    def _step(self, seq: Sequence, ids: list[int], all_logits: bool, **inputs) -> torch.Tensor:
        """One forward step of one sequence (see `_step_batch`)."""
        return self._step_batch([StepItem(seq, ids, all_logits, **inputs)])[0]

    def _step_batch(self, items: list[StepItem]) -> list[torch.Tensor]:
        """One forward step of one or more sequences under the plan of its tier (the step's total new
        tokens), re-planning on out-of-memory and retrying."""
        self._step_activity(1)
        try:
            return self._step_batch_now(items)
        finally:
            self._step_activity(-1)

    def _step_batch_now(self, items: list[StepItem]) -> list[torch.Tensor]:
        kv = self.executor.kv
        n_new = sum(len(it.ids) for it in items)
        for attempt in range(8):
            self._apply_pending_budget()
            grow = sum(-(-(it.seq.length + len(it.ids)) // BLOCK_SIZE) - len(it.seq.block_table) for it in items)
            self._ensure_kv_capacity((len(kv.refs) + max(grow, 0)) * BLOCK_SIZE, n_new)
            plan = self._plan_for_step(n_new)
            lengths = [it.seq.length for it in items]
            try:
                if plan is not self.executor.plan:
                    self.executor.activate(plan)
                return self.executor.forward_batch(items)
            except (torch.OutOfMemoryError, OutOfBudgetError) as exc:
                for it, length in zip(items, lengths):
                    kv.truncate(it.seq, length)
                if self.accel is None or self.budget == 0:
                    raise BudgetError(f"out of memory even with nothing on the GPU: {exc}") from exc
                self._back_off(exc, attempt)
                if self._oom_retries > 0 and self._wanted_budget > self.budget:
                    self._oom_retries -= 1
                    self._retry_wanted = True
        raise BudgetError("could not run a step within any budget")

    def _back_off(self, exc: Exception, attempt: int) -> None:
        """Re-plan at three quarters of the budget after `exc` (an out-of-memory or over-budget step; from
        the seventh attempt, at nothing on the GPU). A re-plan can run short itself (its KV cut comes before
        any weight leaves, and the allocator may hold blocks it cannot give back yet): then a smaller one is
        tried (after three failed, nothing on the GPU, which takes no VRAM)."""
        budget = self.budget
        for tries in range(5):
            budget = int(budget * 0.75) if attempt < 6 and tries < 3 else 0
            try:
                self._set_budget_now(budget, f"out of memory ({exc.__class__.__name__}); retrying")
                return
            except (torch.OutOfMemoryError, OutOfBudgetError) as again:
                if budget == 0:
                    raise BudgetError(f"out of memory even with nothing on the GPU: {again}") from again
                exc = again
        raise BudgetError("could not re-plan within any budget")

    def _retry_budget(self) -> None:
        """At a request's start: an out-of-memory back-off is not kept for good, the request tries the
        budget asked for again (re-planned with the process overhead NVML shows now, which counts the
        kernels loaded since). Only the first OOM_RETRIES back-offs after set_vram_budget ask for one."""
        if self._retry_wanted:
            self._retry_wanted = False
            self._post_budget(self._wanted_budget, "retry the budget asked for after out of memory")

    def _plan_for_step(self, n_new: int):
        """The plan of the step's tier; but a small step (a decode, a speculative verify, a small batch)
        keeps the small-step plan already in place: switching plans moves weights in and out of VRAM,
        which costs more than the better placement saves on one short step (decode alternating with
        7-token verify steps would otherwise swap resident weights at every step). A larger step (a short
        prompt) keeps it too where the switch costs more than it saves (`_staying_pays`)."""
        plan = self.planset.for_tokens(n_new)
        cur = self.executor.plan
        # A larger step stays at most once in a row (a prompt before its decode): a second one in a row is a
        # run of them (a batch of more than SMALL_STEP streams), where the switch pays once for all.
        stay = (cur is not None and plan is not cur and cur.tier <= SMALL_STEP
                and any(cur is p for p in self.planset.plans)
                and (n_new <= SMALL_STEP or (not self._stayed and self._staying_pays(cur, plan, n_new))))
        self._stayed = stay and n_new > SMALL_STEP
        return cur if stay else plan

    def _staying_pays(self, cur, plan, n_new: int) -> bool:
        """Whether a step of `n_new` tokens (a short prompt) is cheaper on the small-step plan in place than
        on its own tier's plan once the switch there and back is priced: the weights each way over PCIe and
        PLAN_SWITCH_MS (the one-token CUDA graphs captured again, the activation itself). On the MoE shape
        at 4 GiB the 64-token prompt's plan differed from the decode plan's by 1.4 ms predicted, and the
        first decode step after every prompt took 67-115 ms against 25-33 (session 16, call UU)."""
        if self.accel is None:
            return False
        if self._stay_of is not self.planset:     # (a re-plan: decide afresh)
            self._stay_cache, self._stay_of = {}, self.planset
        key = (cur.tier, plan.tier, n_new)
        if key not in self._stay_cache:
            from engine.sharding.memory import scratch_bytes
            from engine.sharding.planner import planning_context

            # (the step's temporaries on the plan in place must fit where the tier's own plan fits)
            if cur.vram.total - cur.vram.scratch + scratch_bytes(self.spec, n_new) > plan.vram.total:
                self._stay_cache[key] = False
                return False
            planner = self.planner()
            ctx = planning_context(n_new, self.kv_tokens)
            extra = planner.estimate(cur, n_new, ctx) - planner.estimate(plan, n_new, ctx)
            a, b = set(cur.resident()), set(plan.resident())
            moved = sum(self.executor.store.nbytes(n) for n in a ^ b)
            switch = planner.prof.copy_ms(moved) + PLAN_SWITCH_MS
            self._stay_cache[key] = extra < switch
        return self._stay_cache[key]

    def step_token_budget(self) -> int:
        """New tokens per step: the planner's best step size (the tier with the best time per token)."""
        return self.planset.step_tokens or self.tiers[-1]

    @staticmethod
    def _chunk_inputs(vision, i: int, j: int) -> dict:
        """Rotary positions and image embedding rows of prompt tokens i..j-1 of a vision prompt (none for
        text, or for tokens past the prompt, whose positions follow the cache index)."""
        if vision is None or i >= vision.positions.shape[-1]:
            return {}
        inputs = {"positions": vision.positions[..., i:j]}
        mask = vision.image_mask[i:j]
        k = int(mask.sum())
        if k:
            row = int(vision.image_mask[:i].sum())
            inputs["embeds"] = (mask, vision.embeddings[row:row + k])
        return inputs

    def _run(self, seq: Sequence, ids: list[int], all_logits: bool, vision=None) -> torch.Tensor:
        """Feed `ids` in chunks of the planner's best step size; a vision prompt's positions and image
        rows are cut to each chunk."""
        chunk = self.step_token_budget()
        outs = []
        for i in range(0, len(ids), chunk):
            j = min(i + chunk, len(ids))
            outs.append(self._step(seq, ids[i:j], all_logits, **self._chunk_inputs(vision, i, j)))
        return torch.cat(outs) if all_logits else outs[-1]

    # ---- continuous batching -------------------------------------------------------------------
    def submit(self, prompt_or_messages, *, max_new_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, stop=None, images=None, seed: int | None = None,
               cancel: CancelToken | None = None, background: bool = True) -> RequestHandle:
        """Queue a generation for the batch; iterate the handle for its events (as `generate` yields).
        Requests join and leave the running batch at any step; bad input raises here. The engine's
        background loop runs the steps; `background=False` only queues (the caller runs `step_batch()`)."""
        self._require_open()
        ids, params = self.prepare_request(prompt_or_messages, max_new_tokens, temperature, top_p, top_k,
                                           stop, images, seed)
        req = Request(ids, params, cancel, vision=self._vision_prompts.pop(id(ids), None))
        handle = RequestHandle(req, self.tokenizer, self._stats)
        self.scheduler.add(req)
        if background:
            self._wake_batch_loop()
        return handle

    def generate_batch(self, prompts, **params) -> list[Completion]:
        """Generate for every prompt (or message list) together; their completions in order."""
        handles = [self.submit(p, **params) for p in prompts]
        return [h.result() for h in handles]

    def step_batch(self) -> bool:
        """Run one batched step now (the background loop calls this); False when there was nothing to do."""
        with self._lock:
            if self.executor is None:
                return False
            with torch.inference_mode():
                return self.scheduler.step()

    def _wake_batch_loop(self) -> None:
        with self._batch_cond:
            if self._batch_thread is None or not self._batch_thread.is_alive():
                self._batch_thread = threading.Thread(target=self._batch_loop, name="torch-engine-batch",
                                                      daemon=True)
                self._batch_thread.start()
            self._batch_cond.notify_all()

    def _batch_loop(self) -> None:
        while True:
            with self._batch_cond:
                while not self._batch_closing and not self.scheduler.has_work:
                    self._batch_cond.wait()
                if self._batch_closing:
                    return
            try:
                stepped = self.step_batch()
            except Exception as exc:  # noqa: BLE001 - readers get the error; the loop serves on
                with self._lock:
                    if self.executor is not None:
                        self.scheduler.cancel_all(error=exc)
                stepped = True
            if not stepped:
                with self._batch_cond:
                    self._batch_cond.wait(0.01)

    # ---- images (vision-language models) -------------------------------------------------------
    def encode_prompt(self, prompt_or_messages, images=None) -> list[int]:
        self._require_open()
        if not images or self.vision is None:
            return super().encode_prompt(prompt_or_messages, images)
        from engine.models.vision import prepare_vision_prompt

        # The vision pass runs to completion (its weights streamed block by block, its VRAM booked
        # against the budget and freed) before the language model starts, under the engine's lock:
        # never beside another generation.
        with self._lock:
            vp = prepare_vision_prompt(self.vision_weights, self.vision, self.tokenizer, prompt_or_messages,
                                       images, dtype=self.dtype, encoder=self._encode_vision)
            if self.accel is not None:
                self.executor.release_to_driver()
        ids = list(vp.ids)
        while len(self._vision_prompts) >= 4:      # prompts refused after encoding (context) are dropped
            self._vision_prompts.pop(next(iter(self._vision_prompts)))
        self._vision_prompts[id(ids)] = vp
        return ids

    def _vision_plan(self, grids):
        prof = self.planner().prof if self.accel is not None else None
        used = self.accel.total_used if self.accel is not None else 0
        room = self.accel.budget if self.accel is not None else 0      # bookable: the process overhead is out
        return self.vision_pass.plan(grids, prof, room, used)

    @torch.inference_mode()
    def _encode_vision(self, pixel_values, grids) -> torch.Tensor:
        """One vision pass under the budget: the language model makes room first where it must (its
        plan for the budget less the pass; the full plan returns at its next step)."""
        self._apply_pending_budget()
        plan = self._vision_plan(grids)
        if plan.where == "gpu" and plan.vram_bytes > self.accel.budget - self.accel.total_used:
            room = self._make_planset(max(self.accel.budget - plan.vram_bytes, 0))
            self.executor.activate(room.for_tokens(1))
            self.executor.release_to_driver()

        def budget_dropped() -> bool:
            pending = self._pending_budget
            return pending is not None and pending != IN_FORCE and self.accel.usable(pending) < self.accel.total_used

        return self.vision_pass.run(pixel_values, grids, plan, budget_dropped)

    def force_vision(self, where: str = "auto") -> None:
        """Run vision passes on "gpu" (weights streamed), "cpu", or where predicted faster ("auto")."""
        from engine.models.vision.vision_pass import WHERE

        if where not in WHERE:
            raise BadInputError(f"vision placement {where!r}: expected one of {', '.join(WHERE)}")
        if self.vision is None:
            raise BadInputError(f"{Path(self.source).name} is a text-only model: it has no vision pass")
        self.vision_pass.where = where

    def _vision_report(self) -> dict:
        """The last pass (plan, booked VRAM, measured ms) and the plan a reference image (1280x720)
        would get now."""
        from engine.models.vision.qwen2_5_vl_processor import grid_for_size

        grid = grid_for_size(720, 1280, self.vision.processor)
        return {"weights_bytes": self.vision_pass.weight_bytes, "forced": self.vision_pass.where,
                "passes": self.vision_pass.passes, "last": self.vision_pass.last,
                "reference_image": {"size": [1280, 720], "grid": list(grid),
                                    **self._vision_plan([grid]).report()}}

    @torch.inference_mode()
    def _token_stream(self, ids: list[int], params: SamplingParams, cancel: CancelToken,
                      images) -> Iterator[int]:
        vp = self._vision_prompts.pop(id(ids), None)
        seq = Sequence() if vp is None else Sequence(rope_delta=vp.delta, cacheable=False)
        try:
            self.executor.kv.request_started()
            sampler = Sampler(params)
            self._retry_budget()
            n_new = len(ids) - (self.executor.kv.cached_prefix(ids) if vp is None else 0)
            self._fit_kv_to_request(len(ids) + params.max_new_tokens, n_new)
            if vp is None:
                # Blocks this prompt shares with an earlier one (the conversation so far) are reused,
                # copied back from the host-RAM tier where they were moved out of VRAM.
                self._ensure_kv_capacity(len(ids), n_new)
                common = self.executor.kv.match_prefix(seq, ids)
                logits = self._run(seq, ids[common:], False)[-1]
            else:
                logits = self._run(seq, ids, False, vision=vp)[-1]
            if params.temperature == 0 and self.speculative is not False:
                yield from self._speculative_stream(seq, ids, int(torch.argmax(logits)), cancel)
                return
            for _ in range(params.max_new_tokens):
                tid = sampler(logits)
                yield tid
                if cancel.cancelled or tid in self.tokenizer.eos_token_ids:
                    return
                if seq.length + 1 >= self.context_length:
                    return
                logits = self._step(seq, [tid], False)[-1]
        finally:
            if self.executor is not None:
                self.executor.kv.release(seq)     # its full blocks stay cached for the next turn

    # ---- n-gram speculative decoding (greedy only: output identical to plain decoding) ----------
    def _speculation_pays(self, n_plain: int = 1, n_verify: int = SPEC_TOKENS + 1) -> bool:
        """On where a step of `n_verify` tokens (proposals included) costs about as much as one of
        `n_plain` (weights streamed or computed from host memory dominate a step); `speculative=True/False`
        at open forces it."""
        if self.speculative is not None:
            return self.speculative
        if self.accel is None or self.planset is None:
            return False
        one = self.planset.for_tokens(n_plain).predicted_ms
        many = self.planset.for_tokens(n_verify).predicted_ms
        return one > 0 and many / one < SPEC_MAX_COST

    def _propose_now(self, step: int) -> bool:
        """Whether this decode step carries n-gram proposals. Forced on with `speculative=True`; by
        default (None) decided from measured step times, kept across requests: a verify step pays when
        the tokens it yields per millisecond beat a plain step's (one plain step is measured first, and
        a verify step is tried every SPEC_PROBE_EVERY steps to follow changes: a new plan, another prompt)."""
        if self.speculative:
            return True
        t = self._spec_timing
        if t["plain"] is None:
            return False
        if t["verify"] is None or step % SPEC_PROBE_EVERY == 0:
            return True
        return t["gain"] / t["verify"] >= 1.0 / t["plain"]

    def _time_step(self, key: str, ms: float, gain: int = 1) -> None:
        t = self._spec_timing
        t[key] = ms if t[key] is None else (1 - SPEC_EMA) * t[key] + SPEC_EMA * ms
        if key == "verify":
            t["gain"] = gain if t["gain"] is None else (1 - SPEC_EMA) * t["gain"] + SPEC_EMA * gain

    def _verify_step(self, seq: Sequence, fed: list[int]) -> list[int]:
        """One speculative decode step: `fed` is the last token and the proposals after it (none: a plain
        step). The model's argmax after every fed token (after the last only when nothing is proposed)."""
        logits = self._step(seq, fed, len(fed) > 1)
        return torch.argmax(logits, dim=-1).tolist()

    def _keep_accepted(self, seq: Sequence, start: int, n_proposed: int, n_ok: int) -> None:
        """After a verify step fed at length `start`: drop the KV of the rejected proposals, keeping the
        fed token and the `n_ok` accepted ones."""
        if n_ok < n_proposed:
            self.executor.kv.truncate(seq, start + 1 + n_ok)

    def _speculative_stream(self, seq: Sequence, ids: list[int], first: int, cancel: CancelToken) -> Iterator[int]:
        from engine.speculative import NgramIndex, accepted_prefix

        index = NgramIndex()
        index.extend(ids + [first])
        tid = first
        eos = self.tokenizer.eos_token_ids
        step = 0
        while True:
            yield tid
            if cancel.cancelled or tid in eos or seq.length + 1 >= self.context_length:
                return
            room = self.context_length - seq.length - 1
            step += 1
            proposal = index.propose(min(SPEC_TOKENS, room)) if self._propose_now(step) else []
            start = seq.length
            t0 = time.perf_counter()
            greedy = self._verify_step(seq, [tid] + proposal)
            ms = (time.perf_counter() - t0) * 1e3
            n_ok = accepted_prefix(proposal, greedy)
            if step > 1:                      # the first step may also switch plans: not a fair sample
                self._time_step("verify" if proposal else "plain", ms, n_ok + 1)
            self.spec_stats["proposed"] += len(proposal)
            self.spec_stats["accepted"] += n_ok
            self._keep_accepted(seq, start, len(proposal), n_ok)
            if self.spec_observer is not None:
                self.spec_observer({"fed": [tid] + proposal, "accepted": n_ok, "next": greedy[n_ok], "ms": ms})
            for t in proposal[:n_ok]:
                yield t
                if cancel.cancelled or t in eos:
                    return
            tid = greedy[n_ok] if proposal else greedy[-1]
            index.extend(proposal[:n_ok] + [tid])

    @torch.inference_mode()
    def score(self, token_ids) -> torch.Tensor:
        self._require_open()
        ids = [int(t) for t in (token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)]
        if not ids:
            raise BadInputError("score: no tokens")
        if len(ids) > self.context_length:
            from engine.errors import ContextLengthError

            raise ContextLengthError(f"{len(ids)} tokens do not fit the model's context of "
                                     f"{self.context_length} tokens")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise BadInputError(f"score: token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        with self._lock:
            seq = Sequence()      # every position's logits are wanted: nothing is taken from the cache
            self._retry_budget()
            try:
                return self._run(seq, ids, True)
            finally:
                self.executor.kv.release(seq)

    def close(self) -> None:
        with self._batch_cond:
            self._batch_closing = True
            self._batch_cond.notify_all()
        thread = self._batch_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            if self.executor is not None:
                self.scheduler.cancel_all()
            if self.executor is not None:
                self.executor.close()
                self.executor.release_to_driver()
                if self.accel is not None:
                    self.accel.close()
                self.executor = None
        with self._activity:         # (a plan refinement waiting for the engine to go idle ends now)
            self._activity.notify_all()
