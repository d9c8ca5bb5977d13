"""One-token GPU work of a decode step replayed from CUDA graphs.

A decode step's GPU sub-layers are short: a one-token attention's norm, projections, q/k norms and RoPE
are about 30 small kernels over weights already in VRAM, and the host takes 10-20 us to issue each. The
H200 traces (session 8, the MoE shape at 4 GiB) show 0.5 ms of host time in them per attention, 24 per
token, on the path of a step whose host is the bottleneck. A CUDA graph issues the same kernels in one
launch; the same holds for a one-token FFN on the GPU, and for a MoE layer held in VRAM whole
(`moe.layer_few_tokens`: router, every expert group and the residual add, with nothing read back).

A graph is keyed by what it computes and the weights' addresses, shapes and strides: a streamed
sub-layer's weights sit in a slot whose views have the same addresses for every layer the slot carries,
so one graph per slot serves them all (and one per resident sub-layer). It reads whatever those
addresses hold when it replays: the weights of the sub-layer being run. A graph is captured at the
second sighting of its key (the first runs eagerly). RoPE's cos/sin live in two buffers that every
graph reads, refreshed once per step. Graphs replay in order on the compute stream, and each result is
used before its graph replays again, so they share one memory pool.

Memory: the pool and the capture stream's cuBLAS workspace come out of `RESERVE`, which the engine keeps
out of the one-token plan's budget (`reserve_for`; a larger tier's plan has the whole budget, since the
graphs are dropped when it comes in: session 9's first suite row at 2 GiB, with the reserve out of every
tier, prefilled in 256-token steps instead of 1024 and lost 3/4 of its prefill speed) and the graphs book
when they first capture; where it cannot be booked (a budget below `MIN_ROOM`), or the allocator grows
past it, everything runs eagerly. Every
re-plan drops the graphs (weights move), gives their memory back to the driver (the suite's first run
with graphs met an out-of-memory when a larger budget's weights came in beside the last plan's pool
and capture workspace) and unbooks it. The replayed kernels are the eager ones, so the numbers are the same (tested on
the GPU machine).

With `SLIPSTREAM_GRAPH_ATTENTION=1` a one-token attention is captured whole: its cache write (a pool
row from a device index) and its attention over a padded context (the sequence's blocks gathered through
a padded table, its positions masked: `decode_index`, `dense.attend_one_token`), so the eager glue between
the projections and the output projection goes too. Off until it has run on the GPU machine (written in
session 9, after the last call); tested on the CPU with the graphs' replays run eagerly.

A captured attention between two host sub-layers (the MoE decode at small budgets: CPU experts before and
after) runs from the host (`run_host`, `Executor._attention_from_host`): the hidden state goes from a pinned
twin of the graph's input straight into it, and the output from the graph's own buffer straight into
another pinned twin, with no device tensor, device copy or clone around the replay. Session 20's call S (the
Qwen3-30B-A3B shape at 2 GiB, runs taking turns in one engine): faster in 6 of 6 pairs, about 4 ms a token
(0.15 ms an attention). `SLIPSTREAM_GRAPH_HOST_IO=0` turns it off.

On by default; `SLIPSTREAM_CUDA_GRAPHS=0` turns them off. On the H200 (session 8, call D) the MoE shape's
decode at 4 GiB ran 7-16% faster with them (host time per GPU attention 0.36-0.52 ms against 0.63-0.75),
Llama-3-8B's at 4 GiB no faster (its step waits on PCIe), and the generation tests gave the same tokens
with and without. Session 9, call H: the MoE shape (8 layers, 4 GiB) 21.0-22.8 ms per token with them
against 24.3-26.1 without, in alternating processes; the suite's re-plans 2 -> 4 -> 8 GiB with graphs on
met no out-of-memory, and NVML's peaks stayed within the budgets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import OutOfBudgetError
from engine.sharding.kvcache import BLOCK_SIZE

RESERVE = 64 << 20        # VRAM kept for the pool (a few MB) and the capture stream's cuBLAS workspace
MIN_ROOM = 16 * RESERVE   # no graphs in smaller budgets: the reserve would cost more weights than it saves
MAX_GRAPHS = 384          # per plan: one per resident sub-layer of a kind plus one per slot, and a layer's
                          # captured attention for each padded context met


def enabled() -> bool:
    """On unless SLIPSTREAM_CUDA_GRAPHS is 0 (or off, false, no)."""
    return os.environ.get("SLIPSTREAM_CUDA_GRAPHS", "1").lower() not in ("0", "off", "false", "no")


MIN_CONTEXT = 256         # the smallest padded context of a captured decode attention (then powers of two)


def attention_enabled() -> bool:
    """Whether a one-token attention is captured whole, its cache write and attention over a padded
    context included: on unless SLIPSTREAM_GRAPH_ATTENTION is 0 (or off, false, no)."""
    return os.environ.get("SLIPSTREAM_GRAPH_ATTENTION", "1").lower() not in ("0", "off", "false", "no")


def padded_context(length: int) -> int:
    """The padded context a decode attention over `length` positions is captured for."""
    return max(MIN_CONTEXT, 1 << (length - 1).bit_length())


def fits_padded_context(length: int, kv_bytes_per_token: int) -> bool:
    """Whether a captured decode attention over `length` positions gathers its padded context within a
    quarter of the reserve (longer contexts take the paged path: their gather would outgrow the graphs'
    memory and send every graph of the plan back to eager work)."""
    return padded_context(length) * kv_bytes_per_token <= RESERVE // 4


def visible(length: int, start: int, window: int | None, device=None) -> torch.Tensor:
    """Which of `length` cache positions a new token at position `start` sees (bool [length]): those up to
    its own, and within `window` where one is set."""
    pos = torch.arange(length, device=device)
    seen = pos <= start
    if window is not None:
        seen &= pos > start - window
    return seen


def reserve_for(room: int, accel) -> int:
    """Bytes to keep out of the plans' budget for graphs when `room` is bookable on `accel`."""
    if accel is None or accel.kind != "cuda" or not enabled() or room < MIN_ROOM:
        return 0
    return RESERVE


def host_io_enabled() -> bool:
    """Whether a captured one-token attention whose input comes from the host and whose output goes back
    to it copies straight between pinned host buffers and the graph's own input and output
    (`OneTokenGraphs.run_host`): on unless SLIPSTREAM_GRAPH_HOST_IO is 0 (or off, false, no)."""
    return os.environ.get("SLIPSTREAM_GRAPH_HOST_IO", "1").lower() not in ("0", "off", "false", "no")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor       # static input
    out: object           # static output (a tensor or a tuple of them)
    host: tuple[torch.Tensor, torch.Tensor] | None = None   # pinned twins of x and out (`run_host`)


class OneTokenGraphs:
    def __init__(self, accel):
        self.accel = accel
        self._graphs: dict[tuple, _Graph] = {}
        self._seen: set[tuple] = set()
        self._pool = None
        self._stream = None
        self._no_room = False
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_src: tuple | None = None
        self._kv_index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # padded context: (rows, valid)
        self._kv_src: dict[int, tuple] = {}
        self.booked = 0
        self.error: str | None = None
        self._base = 0
        self.peak_bytes = 0       # the most the allocator reserved for graphs beyond the step's own memory
        self.captures = 0
        self.replays = 0
        self.host_replays = 0     # replays whose input and output crossed through the graph's pinned twins

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        return x.is_cuda and x.shape[0] == 1

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin buffers the graphs read, holding `cos`/`sin` (copied in once per new pair)."""
        if self._rope is None or self._rope[0].shape != cos.shape or self._rope[0].dtype != cos.dtype:
            if self._rope is not None:           # graphs read the old buffers: capture again
                self._graphs.clear()
                self._seen.clear()
            self._rope = (cos.clone(), sin.clone())
        elif self._rope_src is None or self._rope_src[0] is not cos or self._rope_src[1] is not sin:
            self._rope[0].copy_(cos)
            self._rope[1].copy_(sin)
        self._rope_src = (cos, sin)          # (held, so a new step's tensors can never share their identity)
        return self._rope

    def decode_index(self, blocks: list[int], start: int, window: int | None,
                     device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The buffers a captured decode attention reads for a new token at position `start` of a sequence
        whose cache blocks are `blocks`: its pool row [1], the blocks of the padded context
        (`padded_context`; past the sequence's own blocks, its first block again) and which of those
        positions the token sees (bool [context]: before it, and within `window`). Refreshed once per step
        (every layer shares them). Each padded context keeps its own buffers, and so its graphs, until the
        plan changes: a new conversation starts small again and finds them. (No graph is dropped on its
        own: the last graph of a private pool dropped, the next capture into it fails in the allocator.)"""
        length = start + 1
        ctx = padded_context(length)
        n_blocks = ctx // BLOCK_SIZE
        bufs = self._kv_index.get(ctx)
        if bufs is None:
            bufs = self._kv_index[ctx] = (torch.empty(1 + n_blocks, dtype=torch.long, device=device),
                                          torch.empty(ctx, dtype=torch.bool, device=device))
        rows, valid = bufs
        used = blocks[:-(-length // BLOCK_SIZE)]
        src = (ctx, start, tuple(used), window)
        if src != self._kv_src.get(ctx):
            table = used + [used[0]] * (n_blocks - len(used))
            slot = used[start // BLOCK_SIZE] * BLOCK_SIZE + start % BLOCK_SIZE
            rows.copy_(torch.tensor([slot, *table], dtype=torch.long))
            valid.copy_(visible(ctx, start, window))
            self._kv_src[ctx] = src
        return rows[:1], rows[1:], valid

    @staticmethod
    def _key(kind: str, w: dict[str, torch.Tensor], x: torch.Tensor) -> tuple:
        return (kind, x.dtype, x.shape,
                tuple((n, t.data_ptr(), t.shape, t.stride(), t.dtype) for n, t in sorted(w.items())))

    def run_host(self, kind: str, w: dict[str, torch.Tensor], x: torch.Tensor, wait: Callable[[], None]):
        """The graph of `kind` over `w` already captured for a one-token input, run on `x` from the host
        with the result back on the host (a new CPU tensor); None where no such graph is captured yet (the
        caller takes `run`'s way, which captures at the second sighting). The input is staged in the
        graph's pinned twin and copied straight into its static input, the output straight from its static
        output into the other twin, and `wait()` (the caller's wait for the compute stream) returns when
        it is there: no device tensor is allocated, no copy runs on the device, and the host's result is
        the graph's own bits. (The twins are reused at the next run of this graph: the input's copy is done
        by then, as the wait came after it.)"""
        if x.device.type != "cpu" or x.shape[0] != 1:
            return None
        g = self._graphs.get(self._key(kind, w, x))
        if g is None or not isinstance(g.out, torch.Tensor):
            return None
        if g.host is None:
            g.host = (torch.empty(g.x.shape, dtype=g.x.dtype, pin_memory=True),
                      torch.empty(g.out.shape, dtype=g.out.dtype, pin_memory=True))
        pin_in, pin_out = g.host
        pin_in.copy_(x)
        g.x.copy_(pin_in, non_blocking=True)
        g.graph.replay()
        pin_out.copy_(g.out, non_blocking=True)
        wait()
        self.replays += 1
        self.host_replays += 1
        return pin_out.clone()

    def run(self, kind: str, fn: Callable, w: dict[str, torch.Tensor], x: torch.Tensor):
        """`fn(w, x)` for a one-token `x` on the GPU (its other inputs: `rope`'s buffers), from a graph.
        The result's tensors are the graph's own: use them before the same kind of sub-layer runs again."""
        key = self._key(kind, w, x)
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen or len(self._graphs) >= MAX_GRAPHS or self._no_room:
                self._seen.add(key)
                return fn(w, x)
            g = self._capture(fn, w, x, key)
            if g is None:
                return fn(w, x)
        g.x.copy_(x)
        g.graph.replay()
        self.replays += 1
        return g.out

    def _capture(self, fn, w, x, key) -> _Graph | None:
        """Capture on a side stream (after a warm-up run there, which gives that stream its cuBLAS
        workspace), without `torch.cuda.graph`'s device sync, garbage collection and cache release: a
        re-plan while a game loads brings new keys, and their captures must cost what a step does. What
        the allocator reserves beyond the step's own memory from the first capture on (the workspace, the
        pool) must stay within `RESERVE`, else this plan runs eagerly."""
        dev = x.device
        if self._pool is None:
            try:
                self.accel.book(RESERVE, "scratch", "CUDA graphs of one-token decode work")
            except OutOfBudgetError:            # the engine kept no reserve (a small budget): eagerly
                self._no_room = True
                return None
            self.booked = RESERVE
            self._base = torch.cuda.memory_reserved(dev)
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=dev)
        cur = torch.cuda.current_stream(dev)
        xin = x.clone()
        self._stream.wait_stream(cur)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                fn(w, xin)
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = fn(w, xin)
                finally:
                    graph.capture_end()
        except (torch.OutOfMemoryError, RuntimeError) as exc:   # the allocator's cap, or a capture the
            cur.wait_stream(self._stream)                        # driver refused: this plan runs eagerly
            self._give_up(f"{type(exc).__name__}: {exc}"[:300])
            return None
        cur.wait_stream(self._stream)
        self.captures += 1
        grown = torch.cuda.memory_reserved(dev) - self._base
        self.peak_bytes = max(self.peak_bytes, grown)
        if grown > RESERVE:
            del graph, out
            self._give_up(f"graphs reserved {grown >> 20} MiB, over their {RESERVE >> 20} MiB")
            return None
        g = self._graphs[key] = _Graph(graph, xin, out)
        return g

    def _give_up(self, why: str) -> None:
        """Run eagerly until the next plan, with the graphs' memory back to the driver."""
        self.error = why
        self.clear()
        self._no_room = True

    def clear(self) -> None:
        """Drop every graph and give their memory back (the pool's segments, the capture stream's cuBLAS
        workspace) and its booking: a plan change, a budget drop, close."""
        had_pool = self._pool is not None
        self._graphs.clear()
        self._seen.clear()
        self._pool, self._stream = None, None
        self._no_room = False
        self._rope, self._rope_src = None, None
        self._kv_index, self._kv_src = {}, {}
        if had_pool:
            torch.cuda.synchronize()
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
        if self.booked:
            self.accel.unbook(self.booked, "scratch")
            self.booked = 0

    def stats(self) -> dict:
        return {"cuda_graphs": len(self._graphs), "cuda_graph_captures": self.captures,
                "cuda_graph_replays": self.replays, "cuda_graph_host_replays": self.host_replays,
                "cuda_graph_booked": self.booked, "cuda_graph_error": self.error,
                "cuda_graph_peak_bytes": self.peak_bytes}
