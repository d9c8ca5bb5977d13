"""Continuous batching: requests join and leave a running batch at any step.

`Scheduler.step()` builds one batched step and runs it through the engine (`TorchEngine._step_batch`):
every running request that is decoding adds its one new token, then prompts still being read in add
chunks from what is left of the step's token budget (so a long prompt is read over several steps while
the others keep decoding). The step's total token count picks the plan tier. Requests whose step reached
the end of their tokens sample their next token (greedy or temperature, each with its own seeded
generator) and hand it to their `RequestHandle`, which turns ids into text events on the reader's thread.

KV budget: the sequences of the running batch may hold at most `limit_blocks` KV blocks. A request is
admitted when its prompt fits beside the others (with a block of headroom per running request); when a
step would need more blocks than are left, the most recently admitted request is preempted and goes back
to the front of the queue: its KV moves to the host-RAM tier where the cache has one with room (and comes
back by copy), else it is given up (full blocks stay in the prefix cache, so resuming usually recomputes
only a partial block). `_evict` / `_resume` are the only places that know how.

Threads: `add`, `cancel` and the getters are safe from any thread; `step` runs with the engine's lock held
(one step at a time; `generate`, `score` and re-plans interleave with the batch at step boundaries).
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.errors import OutOfBudgetError
from engine.generation import CancelToken, GenerationEvent, Sampler, SamplingParams, token_events
from engine.sharding.executor import StepItem
from engine.sharding.kvcache import BLOCK_SIZE, Sequence
from engine.speculative import NgramIndex, accepted_prefix

DEFAULT_MAX_RUNNING = 16
_END = object()                      # end of a request's token queue


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


class Request:
    """One generation in the scheduler: its prompt and sampled tokens, its KV sequence while admitted."""

    _ids = itertools.count()

    def __init__(self, ids: list[int], params: SamplingParams, cancel: CancelToken | None = None,
                 vision=None):
        self.id = next(Request._ids)
        self.prompt = list(ids)
        self.params = params
        self.cancel_token = cancel or CancelToken()
        self.vision = vision                  # a prepared vision prompt (positions, image rows), or None
        self.sampler = Sampler(params)
        self.tokens = list(ids)               # prompt + generated; the KV holds tokens[:seq.length]
        self.generated = 0
        self.seq: Sequence | None = None
        self.ngram: NgramIndex | None = None  # n-gram index of `tokens` (greedy requests that speculate)
        self.state = "waiting"                # waiting | running | finished
        self.admitted = -1                    # admission order (the newest running one is preempted)
        self.preemptions = 0
        self.error: BaseException | None = None
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self._abandoned = threading.Event()
        self.submitted = time.perf_counter()
        self.t_first: float | None = None     # when the scheduler sampled the first and last tokens
        self.t_last: float | None = None
        self.token_times: list[float] = []     # when it sampled each token (batched decode's throughput)

    @property
    def done(self) -> bool:
        return self.cancel_token.cancelled or self._abandoned.is_set()

    def abandon(self) -> None:
        """The reader stopped (a stop string, or it went away): the scheduler drops the request."""
        self._abandoned.set()

    def token_ids(self) -> Iterator[int]:
        """Sampled token ids as the scheduler produces them (blocks between steps)."""
        while True:
            item = self.out.get()
            if item is _END:
                if self.error is not None:
                    raise self.error
                return
            yield item


class RequestHandle:
    """What `submit` returns: iterate it for `GenerationEvent`s (as `generate` yields); `cancel()` stops
    this request only; `close()` ends it early. Each handle is read once, from any one thread."""

    def __init__(self, request: Request, tokenizer, stats: dict | None = None):
        self.request = request
        self.finish_reason: str | None = None
        self.text = ""
        self.stats: dict = {}
        self._shared_stats = stats
        self._events = self._run(tokenizer)

    def _run(self, tokenizer) -> Iterator[GenerationEvent]:
        req = self.request
        try:
            for ev in token_events(req.token_ids(), tokenizer, len(req.prompt), req.params, req.cancel_token,
                                   self.stats, t0=req.submitted):
                self.text += ev.text
                if ev.finish_reason is not None:
                    self.finish_reason = ev.finish_reason
                    if self._shared_stats is not None:
                        self._shared_stats.update(self.stats)
                yield ev
        finally:
            req.abandon()

    def __iter__(self) -> Iterator[GenerationEvent]:
        return self._events

    def __next__(self) -> GenerationEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def cancel(self) -> None:
        self.request.cancel_token.cancel()

    @property
    def token_ids(self) -> list[int]:
        """The tokens sampled so far (an end-of-sequence token included)."""
        return self.request.tokens[len(self.request.prompt):]

    def result(self) -> Completion:
        """Read the request to its end."""
        for _ in self._events:
            pass
        return Completion(self.text, self.token_ids, self.finish_reason or "cancelled")


@dataclass(slots=True)
class _Entry:
    """A request's part of a step, with the n-gram proposal appended to its decode token (if any)."""
    req: Request
    item: StepItem
    proposal: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str


class Scheduler:
    """Admission, chunking, preemption and sampling for the batched steps of one engine.

    engine: a `TorchEngine` (its `executor.kv`, `_step_batch`, `step_token_budget()`, `context_length`,
    `tokenizer.eos_token_ids` and `_chunk_inputs` are used). limit_blocks: KV blocks the running batch may
    hold. max_running: requests in the batch at once. max_step_tokens: the step's token budget (None: the
    planner's best step size)."""

    def __init__(self, engine, limit_blocks: int, max_running: int = DEFAULT_MAX_RUNNING,
                 max_step_tokens: int | None = None):
        self.engine = engine
        self.limit_blocks = limit_blocks
        self.max_running = max(1, int(max_running))
        self.max_step_tokens = max_step_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._lock = threading.Lock()          # guards `waiting` against add() from other threads
        self._admitted = itertools.count()
        self.counters = {"steps": 0, "preemptions": 0, "batch_size": 0, "batch_tokens": 0,
                         "max_batch_size": 0, "finished": 0, "preemptions_to_host": 0}

    # ---- from any thread ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.params.max_new_tokens <= 0:
            self._finish(req)
            return
        with self._lock:
            self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), **self.counters}

    # ---- stepping (engine lock held) ----------------------------------------------------------------
    @property
    def kv(self):
        return self.engine.executor.kv

    def blocks_in_use(self) -> int:
        return len(self.kv.refs)

    def step(self) -> bool:
        """Run one batched step; False when there was nothing to run."""
        for req in [r for r in self.running if r.done]:
            self._retire(req)
        with self._lock:
            gone = [r for r in self.waiting if r.done]
            for req in gone:
                self.waiting.remove(req)
        for req in gone:
            self._retire(req)
        self._admit()
        plan = self._build()
        if not plan:
            return False
        items = [e.item for e in plan]
        try:
            logits = self.engine._step_batch(items)
        except Exception as exc:  # noqa: BLE001 - the step's requests end with the error; the others go on
            for e in plan:
                e.req.error = exc
                self._retire(e.req)
            return True
        self.counters["steps"] += 1
        self.counters["batch_size"] = len(plan)
        self.counters["batch_tokens"] = sum(len(it.ids) for it in items)
        self.counters["max_batch_size"] = max(self.counters["max_batch_size"], len(plan))
        for e, out in zip(plan, logits):
            if e.proposal:
                self._verify(e, out)
            elif e.req.seq.length == len(e.req.tokens):     # the step reached the end: sample the next token
                self._emit(e.req, e.req.sampler(out[-1]))
        return True

    def _verify(self, e: _Entry, logits) -> None:
        """Keep the proposed tokens the model agrees with (its argmax), then its own next token; the KV
        of the rejected ones is cut away. Greedy output is the same as without proposals."""
        req, proposal = e.req, e.proposal
        greedy = logits.argmax(dim=-1).tolist()
        n_ok = accepted_prefix(proposal, greedy)
        self.engine.spec_stats["proposed"] += len(proposal)
        self.engine.spec_stats["accepted"] += n_ok
        if n_ok < len(proposal):
            self.kv.truncate(req.seq, req.seq.length - len(proposal) + n_ok)
        for tid in proposal[:n_ok] + [greedy[n_ok]]:
            if req.state != "running":
                return
            self._emit(req, tid)

    def _admit(self) -> None:
        """Move waiting requests into the batch, oldest first, while their prompts fit the KV budget."""
        while len(self.running) < self.max_running:
            with self._lock:
                if not self.waiting:
                    return
                req = self.waiting[0]
                cached = self._cached_blocks(req)
                need = blocks_for(len(req.tokens) + 1) - cached
                if self.running and self.blocks_in_use() + need + len(self.running) > self.limit_blocks:
                    return
                self.waiting.popleft()
            try:
                # Plan for the KV it brings (blocks copied back from host RAM need room in the pools).
                self.kv.request_started()
                self.engine._retry_budget()
                self.engine._ensure_kv_capacity((self.blocks_in_use() + need) * BLOCK_SIZE)
                self._resume(req)
            except (OutOfBudgetError, torch.OutOfMemoryError) as exc:
                if req.seq is not None and not getattr(req.seq, "host_slots", None):
                    self.kv.release(req.seq)
                    req.seq = None
                self.kv.idle_if_unused()
                if not self.running:         # nothing else runs: no room will come back for it
                    req.error = exc
                    self._retire(req)
                    continue
                with self._lock:
                    self.waiting.appendleft(req)
                return
            req.state = "running"
            req.admitted = next(self._admitted)
            self.running.append(req)

    def _cached_blocks(self, req: Request) -> int:
        if req.vision is not None:
            return 0
        return self.kv.cached_prefix(req.tokens, host=False) // BLOCK_SIZE

    def step_budget(self) -> int:
        return max(1, self.max_step_tokens or self.engine.step_token_budget())

    def _build(self) -> list[_Entry]:
        """The step: decode tokens first, then prompt chunks, then n-gram proposals for greedy decoders
        where the step's plan says verifying them costs little; preempting the newest request while the
        step needs more KV blocks than are left."""
        while True:
            budget = self.step_budget()
            plan = []
            decoding = [r for r in self.running if len(r.tokens) - r.seq.length == 1]
            reading = [r for r in self.running if len(r.tokens) - r.seq.length > 1]
            for req in decoding + reading:
                if budget <= 0:
                    break
                start = req.seq.length
                end = min(len(req.tokens), start + budget)
                if req.vision is not None and start < len(req.prompt) < end:
                    end = len(req.prompt)          # image prompts: a chunk never mixes prompt and output
                budget -= end - start
                inputs = self.engine._chunk_inputs(req.vision, start, end)
                item = StepItem(req.seq, req.tokens[start:end], **inputs)
                plan.append(_Entry(req, item))
            self._propose(plan, budget)
            new_blocks = sum(blocks_for(e.req.seq.length + len(e.item.ids)) - len(e.req.seq.block_table)
                             for e in plan)
            if not plan or self.blocks_in_use() + new_blocks <= self.limit_blocks:
                return plan
            victim = max(self.running, key=lambda r: r.admitted)
            if len(self.running) == 1:
                victim.error = RuntimeError(f"a request of {len(victim.tokens)} tokens does not fit the KV "
                                            f"limit of {self.limit_blocks * BLOCK_SIZE} tokens")
                self._retire(victim)
                return []
            self._preempt(victim)

    def _propose(self, plan: list[_Entry], budget: int) -> None:
        """Add n-gram proposals (prompt lookup) to the greedy decoders of the step, within the budget,
        where a step with them is predicted to cost little more than one without."""
        from engine.backends.torch_engine import SPEC_TOKENS

        n_plain = sum(len(e.item.ids) for e in plan)
        if budget <= 0 or self.engine.speculative is False:
            return
        added = 0
        for e in plan:
            req = e.req
            if budget - added <= 0 or req.params.temperature != 0 or len(e.item.ids) != 1 \
                    or len(req.tokens) - req.seq.length != 1 or req.vision is not None:
                continue
            room = min(budget - added, SPEC_TOKENS, self.engine.context_length - len(req.tokens) - 1,
                       req.params.max_new_tokens - req.generated - 1)
            if room <= 0:
                continue
            if req.ngram is None:
                req.ngram = NgramIndex()
                req.ngram.extend(req.tokens)
            e.proposal = req.ngram.propose(room)
            added += len(e.proposal)
        if added and not self.engine._speculation_pays(n_plain, n_plain + added):
            added = 0
            for e in plan:
                e.proposal = []
        for e in plan:
            if e.proposal:
                e.item.ids = e.item.ids + e.proposal
                e.item.all_logits = True

    def _emit(self, req: Request, tid: int) -> None:
        req.t_last = time.perf_counter()
        req.token_times.append(req.t_last)
        if req.t_first is None:
            req.t_first = req.t_last
        req.tokens.append(tid)
        if req.ngram is not None:
            req.ngram.extend([tid])
        req.generated += 1
        req.out.put(tid)
        if (tid in self.engine.tokenizer.eos_token_ids or req.generated >= req.params.max_new_tokens
                or len(req.tokens) >= self.engine.context_length):
            self._retire(req)

    # ---- leaving the batch --------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self._evict(req)
        self.running.remove(req)
        req.state = "waiting"
        req.preemptions += 1
        self.counters["preemptions"] += 1
        with self._lock:
            self.waiting.appendleft(req)

    def _evict(self, req: Request) -> None:
        """Set a preempted request's KV aside: to host RAM where the cache has a host tier with room
        (`kv.offload`; it comes back by copy), else given up, to be recomputed on resume (its full blocks
        stay in the prefix cache, so usually only the last partial block is computed again)."""
        offload = getattr(self.kv, "offload", None)
        if offload is not None and offload(req.seq):
            self.counters["preemptions_to_host"] += 1
            return
        self.kv.release(req.seq)
        req.seq = None

    def _resume(self, req: Request) -> None:
        """Give an admitted request its KV sequence: an offloaded one is copied back; otherwise the cached
        blocks of its longest cached prefix (the rest is read in as prompt chunks)."""
        if req.seq is not None:
            self.kv.restore(req.seq)
        elif req.vision is not None:
            req.seq = Sequence(rope_delta=req.vision.delta, cacheable=False)
        else:
            req.seq = Sequence()
            self.kv.match_prefix(req.seq, req.tokens)

    def _retire(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.seq is not None:
            self.kv.release(req.seq)       # its full blocks stay cached for a later turn
            req.seq = None
        self._finish(req)

    def _finish(self, req: Request) -> None:
        if req.state != "finished":
            req.state = "finished"
            self.counters["finished"] += 1
            req.out.put(_END)

    def cancel_all(self, error: BaseException | None = None) -> None:
        """Finish every request: cancelled (the engine is closing), or failed with `error` (their readers
        get it raised)."""
        with self._lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for req in list(self.running) + waiting:
            if error is None:
                req.cancel_token.cancel()
            else:
                req.error = error
            self._retire(req)
