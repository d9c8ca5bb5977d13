"""One-token FFN steps on the GPU replayed from CUDA graphs.

A decode step's GPU sub-layers are short (a one-token FFN is a dozen small kernels over weights already
in VRAM), so the host time to issue them costs more than the GPU time to run them: the H200 traces of the
4 GiB plan show about 0.5 ms of host time per streamed FFN, on the path of a step whose CPU is the
bottleneck. A CUDA graph issues the same kernels in one launch.

A graph is keyed by the weights' addresses, shapes and strides: a streamed FFN's weights sit in a slot
whose views have the same addresses for every layer the slot carries, so one graph per slot serves them
all (and one per resident FFN). It reads whatever those addresses hold when it replays, which is what
the key says: the weights of the sub-layer being run. A graph is captured on the second sighting of its
key (the first runs eagerly and warms cuBLAS up). Graphs replay in order on the compute stream and their
outputs are copied out at once, so they share one memory pool (their intermediates are a few hundred KB).
Replaying the captured kernels gives the eager path's numbers (tested on the GPU machine).

`SLIPSTREAM_CUDA_GRAPHS=0` turns them off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.errors import OutOfBudgetError
from engine.models import dense

MAX_GRAPHS = 64           # a plan has at most one per resident FFN plus one per slot
POOL_BOOKING = 4 << 20    # VRAM booked for the shared pool (intermediates of one-token FFNs)


def enabled() -> bool:
    return os.environ.get("SLIPSTREAM_CUDA_GRAPHS", "1").lower() not in ("0", "off", "false", "no")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor       # static input
    y: torch.Tensor       # static output


class FFNGraphs:
    def __init__(self, cfg, accel):
        self.cfg, self.accel = cfg, accel
        self._graphs: dict[tuple, _Graph] = {}
        self._seen: set[tuple] = set()
        self._pool = None
        self._stream = None
        self._no_room = False
        self.booked = 0
        self.captures = 0
        self.replays = 0

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        return x.device.type == "cuda" and x.shape[0] == 1

    def run(self, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`dense.ffn_block(cfg, w, x)` for a one-token `x` on the GPU."""
        key = (x.dtype, x.device, x.shape,
               tuple((n, t.data_ptr(), t.shape, t.stride(), t.dtype) for n, t in sorted(w.items())))
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen or len(self._graphs) >= MAX_GRAPHS or self._no_room:
                self._seen.add(key)
                return dense.ffn_block(self.cfg, w, x)
            g = self._capture(w, x, key)
            if g is None:
                return dense.ffn_block(self.cfg, w, x)
        g.x.copy_(x)
        g.graph.replay()
        self.replays += 1
        return g.y.clone()

    def _capture(self, w, x, key) -> _Graph | None:
        """Capture on a side stream (after a warm-up run there, so cuBLAS has its workspace for it), without
        `torch.cuda.graph`'s device sync, garbage collection and cache release: a re-plan while a game
        loads may bring a few new keys, and their captures must cost what a step does."""
        if self._pool is None:
            try:
                self.accel.book(POOL_BOOKING, "scratch", "CUDA graphs of one-token FFNs")
            except OutOfBudgetError:           # a plan that fills the budget runs eagerly
                self._no_room = True
                return None
            self.booked = POOL_BOOKING
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=x.device)
        cur = torch.cuda.current_stream(x.device)
        xin = x.clone()
        self._stream.wait_stream(cur)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            dense.ffn_block(self.cfg, w, xin)
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                y = dense.ffn_block(self.cfg, w, xin)
            finally:
                graph.capture_end()
        cur.wait_stream(self._stream)
        g = self._graphs[key] = _Graph(graph, xin, y)
        self.captures += 1
        return g

    def clear(self) -> None:
        """Drop every graph and its pool's booking (a plan change, a budget drop, close)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = None
        self._no_room = False
        if self.booked:
            self.accel.unbook(self.booked, "scratch")
            self.booked = 0
