"""The accelerator the executor places work on: a CUDA GPU, or "sim", the CPU standing in for one.

Both keep the same byte accounting: every VRAM allocation the engine makes (resident weights, streaming
slots, KV blocks, reserved scratch) is booked under a tag against the budget, and one that would exceed
it raises `OutOfBudgetError` (on CUDA the driver may also refuse first; the engine treats both alike).
Both run weight copies on a separate copy engine: a CUDA stream, or for "sim" one background thread.
Waiting for the GPU spins only briefly, then polls with a short sleep: a wait never holds a core for long.

A budget is what the whole process may hold on the GPU, as NVML counts it: on CUDA the accelerator
measures what the process holds beyond its booked allocations (the CUDA context, cuBLAS workspaces) once,
and `usable(budget)` is what is left of a budget for bookings after that and a small allocator margin.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.errors import OutOfBudgetError
from engine.models.transfer import packed_move
from engine.units import format_bytes

TAGS = ("weights", "kv", "slots", "scratch")
_POLL_S = 0.0002
SWITCH_INTERVAL_S = 0.0002   # the interpreter's switch interval while an issuer thread runs
_SPIN_S = 0.002      # busy-poll this long before sleeping between polls (a sleep costs ~0.1-0.3 ms more)
CONTEXT_FALLBACK = 640 << 20          # a CUDA context + cuBLAS workspaces where NVML cannot say
ALLOCATOR_MARGIN = (160 << 20, 0.02)  # allocator rounding, workspaces, unbooked temporaries: max(160 MiB, 2%)
# Kept free under the allocator's cap (out of ALLOCATOR_MARGIN, so bookings do not shrink) for the kernels
# CUDA loads lazily on first use, outside the allocator, until budget changes have seen them: on the H200
# the MoE shape's 2 GiB row peaked 12-16 MiB over its budget at the first budget of a run once the
# bookings filled the cap (session 12, calls X and Z), and about 90 MiB had loaded after a batched decode.
LAZY_KERNEL_ROOM = 96 << 20


def process_vram_bytes(index: int = 0) -> int | None:
    """NVML's figure for this process on GPU `index` (None where NVML cannot say)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory:
                return int(p.usedGpuMemory)
    except Exception:  # noqa: BLE001 - no library, no driver, no per-process figures (WDDM)
        return None
    return None


def _outside_allocator(device: torch.device, reads: int = 5) -> int | None:
    """NVML's figure for this process less the allocator's reserved segments. Another thread (a copy, a
    plan refinement) can reserve or free a segment between the two figures, and a single read would count
    that segment as overhead: a read counts only where the reserved bytes were the same before and after
    NVML's; where they moved at every try, the larger of the two is taken off (an under-count, which
    `refresh_overhead` ignores: it never lowers the overhead)."""
    seen = None
    for _ in range(reads):
        before = torch.cuda.memory_reserved(device)
        nvml = process_vram_bytes(device.index or 0)
        after = torch.cuda.memory_reserved(device)
        if nvml is None:
            return None
        if before == after:
            return max(0, nvml - after)
        seen = max(0, nvml - max(before, after)) if seen is None else min(seen, nvml - max(before, after))
    return max(0, seen)


def _measure_overhead(device: torch.device) -> tuple[int, str]:
    """Bytes this process holds on the GPU outside its own allocations, after the CUDA context is up and
    cuBLAS has made its workspace; and how that figure was found."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    a = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    workspace = max(0, torch.cuda.memory_reserved(device) - before)
    seen = _outside_allocator(device)
    if seen is None:
        return CONTEXT_FALLBACK + workspace, "estimate (NVML has no per-process figure)"
    return seen + workspace, "measured with NVML"


HOST_ALIGN = 256          # host buffers and the tensors packed in them start at multiples of this
MIN_CHUNK = 64 << 20


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def pack_chunks(sizes: list[int]) -> tuple[int, list[tuple[int, list[tuple[int, int]]]]]:
    """First-fit decreasing packing of buffers into chunks of one power-of-two size (at least the
    largest buffer, at least MIN_CHUNK): (chunk size, [(bytes to allocate, [(buffer index, offset)])]).
    Each chunk is allocated at the power of two at or above what it holds, so only the last, partly
    filled chunks round up."""
    if not sizes:
        return 0, []
    chunk = max(MIN_CHUNK, _pow2(max(sizes)))
    bins: list[list] = []          # [used, [(index, offset)]]
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        n = -(-sizes[i] // HOST_ALIGN) * HOST_ALIGN
        for b in bins:
            if b[0] + n <= chunk:
                b[1].append((i, b[0]))
                b[0] += n
                break
        else:
            bins.append([n, [(i, 0)]])
    return chunk, [(_pow2(used), items) for used, items in bins]


def host_buffers(sizes: list[int], pin: bool) -> list[torch.Tensor]:
    """Host byte buffers of the given sizes; with `pin`, page-locked for the GPU's copy engine.

    PyTorch's pinned allocator rounds every block up to a power of two, so one block per sub-layer held
    22.1 GiB of host memory for an 8B model's 15 GiB of weights (`engine.bench.vram_audit` on the H200).
    The buffers are cut instead from a few pinned chunks of one power-of-two size (`pack_chunks`)."""
    if not pin:
        return [torch.empty(int(n), dtype=torch.uint8) for n in sizes]
    out: list[torch.Tensor | None] = [None] * len(sizes)
    for nbytes, items in pack_chunks([int(n) for n in sizes])[1]:
        mem = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for i, off in items:
            out[i] = mem[off:off + int(sizes[i])]
    return out


def _copy_inference(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.inference_mode():   # buffers made inside inference mode may only be written inside it
        dst.copy_(src)


class CopyHandle:
    """A weight copy in flight; `wait_compute()` orders compute after it, `done()` asks without waiting."""

    def __init__(self, accel: Accelerator, token):
        self._accel = accel
        self._token = token

    def done(self) -> bool:
        t = self._token
        return t.done() if isinstance(t, Future) else t.query()

    def wait_compute(self) -> None:
        """Make the compute that follows see the copied bytes."""
        t = self._token
        if isinstance(t, Future):
            t.result()
        else:
            torch.cuda.current_stream(self._accel.device).wait_event(t)

    def wait_host(self) -> None:
        t = self._token
        if isinstance(t, Future):
            t.result()
        else:
            while not t.query():
                time.sleep(_POLL_S)


class IssuedHandle(CopyHandle):
    """A copy handed to the accelerator's issuer thread (`Accelerator.copy_coded_async`): the handle of the
    copy as issued there, once it is (its token: the issuer's Future of that handle)."""

    def done(self) -> bool:
        return self._token.done() and self._token.result().done()

    def wait_compute(self) -> None:
        self._token.result().wait_compute()

    def wait_host(self) -> None:
        self._token.result().wait_host()


def expandable_segments() -> bool:
    """Let PyTorch's CUDA allocator grow one mapped segment in 2 MiB pages instead of keeping fixed segments:
    on unless SLIPSTREAM_EXPANDABLE_SEGMENTS is 0 (or off, false, no), and left alone where the user
    configured the allocator (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF). Under the allocator's cap
    (`Accelerator.cap_allocator`), fixed segments fragment as forced placements move weights in and out: on
    the H200 a switch to a moved plan at an unchanged 2 GiB budget (the MoE shape's head made resident) failed
    to place 38 MiB with 186 MiB reserved and unused beside 956 MiB live, and cached blocks given back did not
    help (session 21, call X; session 20's decode tiers planned apart ran out the same way); with expandable
    segments the same switch went through (call Y, where the CUDA engine tests passed with it). Giving memory
    back then unmaps it page by page; the issue-3 drop (Llama-3-8B shape, 8 -> 2 GiB mid-generation) still
    reached 90% in NVML 45 ms after the call (64 ms with fixed segments, one process each; session 22, call
    AD), well within the quarter second a game is owed. Call before the first CUDA allocation; True when set
    here."""
    if (os.environ.get("SLIPSTREAM_EXPANDABLE_SEGMENTS", "1").lower() in ("0", "off", "false", "no")
            or "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ):
        return False
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False
    setter("expandable_segments:True")
    return True


class Accelerator:
    """Byte-accounted device memory, a copy engine, and non-spinning waits."""

    def __init__(self, kind: str, index: int = 0):
        if kind not in ("cuda", "sim"):
            raise ValueError(kind)
        self.kind = kind
        self.device = torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")
        self.expandable_segments = kind == "cuda" and expandable_segments()   # (before the first allocation)
        self.budget = 0
        self.capped = False           # whether this accelerator set the allocator's process-wide cap
        self.used = {t: 0 for t in TAGS}
        self.peak = 0
        self._lock = threading.Lock()
        sim_overhead = int(os.environ.get("SLIPSTREAM_SIM_OVERHEAD", "0"))   # tests: a simulated context
        self.overhead, self.overhead_source = sim_overhead, "simulated (SLIPSTREAM_SIM_OVERHEAD)"
        if kind == "cuda":
            # cuDNN's attention builds an execution plan per new shape, and a decode step's key length is
            # new at every token: on the H200 each resident attention's SDPA call took 2.7 ms of host time
            # by decode token 40 (95 us at lengths seen before). Flash / memory-efficient kernels need no plan.
            torch.backends.cuda.enable_cudnn_sdp(False)
            self._copy_stream = torch.cuda.Stream(self.device)
            self._decode_stream = None          # transfer-coded copies' decodes (made on first use)
            self._pool = None
            env = os.environ.get("SLIPSTREAM_VRAM_OVERHEAD")
            if env is not None:
                self.overhead, self.overhead_source = int(env), "SLIPSTREAM_VRAM_OVERHEAD"
            else:
                self.overhead, self.overhead_source = _measure_overhead(self.device)
        else:
            self._copy_stream = self._decode_stream = None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-copy")
        self.start_overhead = self.overhead
        self.issue_thread = os.environ.get("SLIPSTREAM_COPY_ISSUER", "1").lower() not in ("0", "off", "false", "no")
        self.ring_ahead = os.environ.get("SLIPSTREAM_RING_AHEAD", "1").lower() not in ("0", "off", "false", "no")
        self._issuer: ThreadPoolExecutor | None = None

    @property
    def name(self) -> str:
        return str(self.device) if self.kind == "cuda" else "sim"

    def usable(self, budget: int) -> int:
        """What a whole-process budget leaves for bookings: less the process overhead and a margin."""
        if budget <= 0:
            return 0
        if self.kind != "cuda":
            return max(budget - self.overhead, 0)
        if os.environ.get("SLIPSTREAM_VRAM_OVERHEAD") == "0":
            return budget            # tests that size budgets in bytes of their own tiny models
        margin = max(ALLOCATOR_MARGIN[0], int(budget * ALLOCATOR_MARGIN[1]))
        return max(0, budget - self.overhead - margin)

    def refresh_overhead(self) -> None:
        """Raise the process overhead to what NVML now shows beyond the allocator's segments: kernels
        load lazily on first use and take device memory outside the allocator (about 90 MiB more after a
        batched decode than at start on the H200). Called at each budget change; never lowers it."""
        if self.kind != "cuda" or os.environ.get("SLIPSTREAM_VRAM_OVERHEAD") is not None:
            return
        seen = _outside_allocator(self.device)
        if seen is not None:
            self.overhead = max(self.overhead, seen)

    def lazy_room(self) -> int:
        """Bytes the allocator's cap keeps free for kernels still to load: LAZY_KERNEL_ROOM less what the
        overhead has grown by since start (0 where the overhead is given by SLIPSTREAM_VRAM_OVERHEAD)."""
        if self.kind != "cuda" or os.environ.get("SLIPSTREAM_VRAM_OVERHEAD") is not None:
            return 0
        return max(0, LAZY_KERNEL_ROOM - (self.overhead - self.start_overhead))

    def cap_allocator(self, budget: int) -> float | None:
        """Hold PyTorch's caching allocator to what a whole-process `budget` leaves after the process
        overhead and the room for kernels still to load (`lazy_room`): the bookings plus the rest of the
        allocator margin. Bookings count live buffers; the allocator can
        still keep freed blocks it cannot reuse yet (a block last used by the copy stream waits for its
        event) and reserve new segments beside them: on the H200, batched decode at a 4 GiB budget grew
        the reserved bytes to 4.9 GiB with 3.1 GiB live. At the cap the allocator frees its cached blocks
        and retries before it would fail. Returns the fraction of the card set (None: not capped)."""
        if self.kind != "cuda" or budget <= 0 or os.environ.get("SLIPSTREAM_VRAM_OVERHEAD") == "0":
            return None
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = min(1.0, max(budget - self.overhead - self.lazy_room(), 0) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        self.capped = True
        return fraction

    def lift_allocator_cap(self) -> None:
        """Give the process its whole card back (the cap is process-wide, so an engine closed and another
        opened in the same process, or weights made on the GPU after it, would otherwise stay under it)."""
        if self.capped:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.capped = False

    @property
    def total_used(self) -> int:
        return sum(self.used.values())

    # ---- accounting ----------------------------------------------------------------------------
    def book(self, nbytes: int, tag: str, what: str = "") -> None:
        """Book bytes under a tag; raise OutOfBudgetError if the budget would be exceeded."""
        with self._lock:
            total = self.total_used + nbytes
            if nbytes > 0 and total > self.budget:
                raise OutOfBudgetError(
                    f"{what or tag}: {format_bytes(nbytes)} more would exceed the VRAM budget of "
                    f"{format_bytes(self.budget)} ({format_bytes(self.total_used)} in use)" + self._overhead_note())
            self.used[tag] += nbytes
            self.peak = max(self.peak, total)

    def _overhead_note(self) -> str:
        """What the process holds outside the bookings, where that is not simulated away: a budget that
        leaves little room is often this (a CUDA context, kernels loaded since start)."""
        if not self.overhead:
            return ""
        grown = self.overhead - self.start_overhead
        return (f"; the process holds {format_bytes(self.overhead)} beside its bookings ({self.overhead_source}"
                + (f", {format_bytes(grown)} more than at start" if grown > 0 else "") + ")")

    def unbook(self, nbytes: int, tag: str) -> None:
        with self._lock:
            self.used[tag] -= nbytes
            assert self.used[tag] >= 0, (tag, self.used[tag])

    def alloc(self, nbytes: int, tag: str, what: str = "") -> torch.Tensor:
        """A booked flat byte buffer on the device."""
        self.book(nbytes, tag, what)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            if self.kind == "cuda":
                # The booking fits the budget, so what stands in the way is the caching allocator's free
                # blocks, which count against its cap (session 20, call P: a re-plan at the same budget whose
                # new slot was larger than any cached block, 242 MiB reserved and unused): give them back
                # to the driver and try once more.
                self.release_to_driver()
                try:
                    return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                except torch.OutOfMemoryError:
                    pass
            self.unbook(nbytes, tag)
            raise

    def free(self, buf: torch.Tensor | None, tag: str) -> None:
        if buf is not None:
            self.unbook(buf.numel() * buf.element_size(), tag)

    def release_to_driver(self) -> None:
        """Hand cached, unused device memory back to the driver so another process can take it."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- copies and waits ----------------------------------------------------------------------
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> CopyHandle:
        """Copy host -> device (or device -> device) on the copy engine, after the compute event `after`."""
        if self.kind == "cuda":
            with torch.cuda.stream(self._copy_stream):
                if after is not None:
                    self._copy_stream.wait_event(after)
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._copy_stream)
            return CopyHandle(self, ev)
        return CopyHandle(self, self._pool.submit(_copy_inference, dst, src))

    def copy_coded(self, dst: torch.Tensor, coded, stages, after=None, keep: bool = True) -> CopyHandle:
        """Copy a transfer-coded buffer (`transfer_code.CodedBuffer`) into `dst`, its raw bytes on the device,
        after the compute event `after`. Raw chunks go straight into `dst`; each coded piece crosses into a
        buffer of the `stages` ring (once what was decoded from it before is done) and is decoded from
        there into `dst` on a stream of its own, so the copy engine moves chunk c + 1 while the GPU decodes
        chunk c. The handle covers both. Host work per piece is a few calls: the views are cut once per
        (buffer, destination) and the ring's events are reused (`keep` False: a destination copied into once,
        such as a resident buffer, whose views the ring must not keep alive).

        `after` gates what writes into `dst`: the decodes, and raw pieces copied straight there. With
        `ring_ahead` (SLIPSTREAM_RING_AHEAD, on unless 0) the coded pieces cross into the ring without waiting
        for it, as far as the ring's free stages go: the copy engine moves a streamed sub-layer's first pieces
        while the compute that last read its slot still runs (in a decode whose CPU sub-layers sit between
        two streamed ones, that compute waits on the CPU, and the link stood idle meanwhile). Off, the whole
        copy waits for `after` (as before session 25). Not yet measured on the GPU."""
        prog = stages.program(coded, dst, keep)
        if self.kind != "cuda":
            def run() -> None:
                with torch.inference_mode():
                    for _k, src, st, step in prog.steps:
                        st.copy_(src)
                        if step is not None:
                            step()
            return CopyHandle(self, self._pool.submit(run))
        cs = self._copy_stream
        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(self.device)
        ds = self._decode_stream
        arrived, done, used = stages.events()
        prev = torch.cuda.current_stream(self.device)
        gate_cs = gate_ds = after is not None          # (each stream waits for `after` once, where it must)
        try:
            torch.cuda.set_stream(cs)
            if gate_cs and not self.ring_ahead:
                cs.wait_event(after)
                gate_cs = gate_ds = False
            for k, src, st, step in prog.steps:
                if k is None:                        # a raw piece, straight into dst
                    if gate_cs:
                        cs.wait_event(after)
                        gate_cs = False
                    st.copy_(src, non_blocking=True)
                    continue
                if used[k]:
                    cs.wait_event(done[k])
                st.copy_(src, non_blocking=True)
                arrived[k].record(cs)
                torch.cuda.set_stream(ds)
                if gate_ds:
                    ds.wait_event(after)
                    gate_ds = False
                ds.wait_event(arrived[k])
                step()
                done[k].record(ds)
                used[k] = True
                torch.cuda.set_stream(cs)
            if prog.any_raw:
                copied = torch.cuda.Event()
                copied.record(cs)
                ds.wait_event(copied)
            end = torch.cuda.Event()
            end.record(ds)
        finally:
            torch.cuda.set_stream(prev)
        return CopyHandle(self, end)

    def copy_coded_async(self, dst: torch.Tensor, coded, stages, after=None, keep: bool = True) -> CopyHandle:
        """`copy_coded`, issued from a thread of its own where `issue_thread` is set (SLIPSTREAM_COPY_ISSUER,
        on unless 0): a coded copy is a few host calls per 64 MiB piece (about 75 us each on the H200
        host, the decode kernel's launch most of it: `transfer_code_rate`'s issue_us), some 9 ms a token for
        the 16 FFNs the Llama-3-8B 4 GiB decode streams. From the step's own thread they stood between the
        CPU's sub-layers; from here they run while that thread waits in a native call (which lets go of the
        GIL). The issuer is the only user of the staging ring, in the order copies are asked for; a raw
        copy from the step's thread may reach the copy stream before a coded one asked earlier, which its
        own events make safe."""
        if not self.issue_thread:
            return self.copy_coded(dst, coded, stages, after, keep)
        if self._issuer is None:
            self._issuer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-copy-issue")
            # A thread that wants the interpreter lock waits up to the switch interval (5 ms by default) for a
            # thread that keeps it; the step's thread and the issuer hand it back and forth many times a step.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        return IssuedHandle(self, self._issuer.submit(self._issue_coded, dst, coded, stages, after, keep))

    def _issue_coded(self, dst, coded, stages, after, keep) -> CopyHandle:
        with torch.inference_mode():
            if self.kind == "cuda":
                with torch.cuda.device(self.device):
                    return self.copy_coded(dst, coded, stages, after, keep)
            return self.copy_coded(dst, coded, stages, after, keep)

    def issued(self) -> None:
        """Wait until every copy handed to the issuer thread is issued (before the ring is freed, or the
        issuer switched off)."""
        if self._issuer is not None:
            self._issuer.submit(lambda: None).result()

    def set_ring_ahead(self, flag: bool) -> bool:
        """Let coded pieces cross into the staging ring before the compute their copy waits for (see
        `copy_coded`), or not (benchmarks compare both); returns the old state."""
        self.issued()
        old, self.ring_ahead = self.ring_ahead, bool(flag)
        return old

    def set_issue_thread(self, flag: bool) -> bool:
        """Issue coded copies from the issuer thread or the caller's (benchmarks compare both); returns the
        old state."""
        self.issued()
        old, self.issue_thread = self.issue_thread, bool(flag)
        return old

    def wait_events(self, events) -> None:
        """Wait on the host for GPU events (None entries skipped)."""
        for ev in events:
            if ev is not None:
                self.wait_event_host(ev)

    def compute_event(self):
        """An event marking the compute issued so far (None on sim, where compute is synchronous)."""
        if self.kind != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait_event_host(self, ev) -> None:
        """Wait for a GPU event from the thread that runs the CPU side of the step: it polls without
        sleeping for a short while (nothing runs on the CPU meanwhile: the step's own CPU work is what
        waits), then with a short sleep, so a long wait leaves the cores to other processes."""
        if ev is None:
            return
        spin_until = time.perf_counter() + _SPIN_S
        yield_gil = self._issuer is not None
        while not ev.query():
            if time.perf_counter() > spin_until:
                time.sleep(_POLL_S)
            elif yield_gil:
                # (a bare spin keeps the interpreter lock for the switch interval, 5 ms: the issuer thread
                # then waits that long to issue the copy the GPU may be waiting on. The MoE 2 GiB decode, 8
                # streamed attentions a token, went 29 -> 56 ms a token so: session 24, call BH)
                time.sleep(0)

    def to_host(self, x):
        """Activations (a tensor or a MoE state) device -> CPU through pinned memory (`packed_move`), the
        host's one wait for the GPU's queue and the copy not spinning."""
        if self.kind != "cuda":
            return x
        if isinstance(x, torch.Tensor):
            return packed_move([x], "cpu", self.wait_queued)[0]
        return x.to("cpu", self.wait_queued)

    def to_device(self, x):
        """Activations (a tensor or a MoE state) CPU -> device from a pinned staging buffer, not waited for."""
        if self.kind != "cuda":
            return x
        if isinstance(x, torch.Tensor):
            return packed_move([x], self.device)[0]
        return x.to(self.device)

    def wait_queued(self) -> None:
        """Wait, without spinning long, for the work queued on the compute stream so far."""
        self.wait_event_host(self.compute_event())

    def synchronize(self) -> None:
        self.issued()
        if self.kind == "cuda":
            self.wait_queued()
            self._copy_stream.synchronize()
            if self._decode_stream is not None:
                self._decode_stream.synchronize()
        else:
            self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self.lift_allocator_cap()
        if self._issuer is not None:
            self._issuer.shutdown(wait=True)
            self._issuer = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
