"""Native CPU kernels, built on first use on the machine that runs them.

`linear(x, w, bias)` computes `x @ w.T + bias` for a few rows of `x` (decode, small batches) with
`cpu_linear.c`: weights stay in their own precision (bf16, fp16, fp32), products and sums run in float32,
the result is rounded once, as PyTorch's own CPU matmul does. It exists because the CPU side of a plan is
bound by how fast weights stream from DRAM, and PyTorch's bf16 GEMV on the CPU reaches only part of that.

The library is compiled with the system C compiler (`$CC`, else `cc`/`gcc`/`clang`) for this CPU
(`-march=native`) into the user cache folder, keyed by the source, the compiler and the CPU's feature list,
so it builds once per machine (about a second). Without a compiler, on an unsupported dtype or shape, or
with `SLIPSTREAM_CPU_KERNEL=torch`, callers fall back to PyTorch: `linear` returns None and `status()` says
why.

`paged_decode_attention` is one-token (decode) attention over the paged KV cache, read through the block
table in place: a CPU decode step otherwise gathers the context's blocks (`index_select`) and runs SDPA
and its glue ops, which cost more than the attention's arithmetic. `SLIPSTREAM_CPU_ATTENTION=torch` (or
`set_attention_enabled(False)`) leaves attention alone and keeps the native matmuls.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from itertools import accumulate
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.c")
SPIN = 2000               # pause instructions a kernel worker spins for the next job before sleeping (~0.1 ms)
MIN_WEIGHTS = 1 << 22      # smaller float32 matrices stay with PyTorch: its one-row float32 matmul beats
                           # waking a second thread pool there (a 135M model decoded slower without it, two cores)
MIN_WEIGHTS_16BIT = 1 << 16   # 16-bit weights go native from here: PyTorch's one-row 16-bit matmul was slower
                              # than the pool at every size measured (a bf16 135M model: 53 -> 36 ms per token)
MAX_NORM_ELEMENTS = 1 << 16   # rms_norm natively up to this many elements (decode; a prompt keeps PyTorch's)
MAX_ROWS = 16              # above this many rows PyTorch's blocked GEMM (AVX-512) is the better path
MAX_ROWS_AMX_BF16 = 4      # bf16 where the CPU has AMX: PyTorch's GEMM reads the weights once at any row
                           # count while the kernel's dot products grow with the rows (engine.bench.cpu_matmul:
                           # 8 rows 13.4 GB/s against 22.9 on two cores here; 16 rows 23.5-27.8 against
                           # 56.7-68.8 on the H200 host; 4 rows still the kernel's, 66-79 against 62-66)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ISA = {0: "portable C", 1: "AVX-512", 2: "AVX512-BF16", 3: "AVX2"}

_lock = threading.Lock()
_busy = threading.Lock()       # held while the native pool runs a job
_lib = None
_why_not: str | None = None
_attention_fast = False    # the library's decode attention is vector code (else PyTorch's SDPA is kept)
_amx_tiles = False         # the library runs bf16 matmuls of many rows on AMX tiles (sl_amx_ready)
_dots_fast = False         # the library's matmuls are vector code (AVX-512 or AVX2 with FMA; `_matmul_lib`)
_threads = 0


def _cache_dir() -> Path:
    env = os.environ.get("SLIPSTREAM_KERNEL_CACHE")
    if env:
        return Path(env)
    try:
        import platformdirs
        return Path(platformdirs.user_cache_dir("Slipstream", appauthor=False)) / "kernels"
    except ImportError:
        return Path.home() / ".cache" / "slipstream" / "kernels"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def _build() -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    src = SOURCE.read_bytes()
    # SLIPSTREAM_KERNEL_DEBUG=1: the same optimised build with debug information (a crash's address then
    # names a source line: addr2line -e <library> <offset>), cached apart
    debug = ["-g"] if os.environ.get("SLIPSTREAM_KERNEL_DEBUG", "") == "1" else []
    key = hashlib.sha256(src + cc.encode() + _cpu_features().encode() + sys.platform.encode()
                         + " ".join(debug).encode()).hexdigest()[:16]
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    out = _cache_dir() / f"cpu_linear-{key}{suffix}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for arch in (["-march=native"], ["-mcpu=native"], []):
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=suffix, delete=False) as tmp:
            tmp_path = Path(tmp.name)
        cmd = [cc, "-O3", *debug, *arch, "-shared", "-fPIC", "-pthread", "-o", str(tmp_path), str(SOURCE), "-lm"]
        try:
            r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            r = None
            errors.append(f"{' '.join(cmd)}: {e}")
        if r is not None and r.returncode == 0:
            os.replace(tmp_path, out)     # atomic: a concurrent build of the same key is harmless
            return out
        if r is not None:
            errors.append(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        tmp_path.unlink(missing_ok=True)
    raise RuntimeError("building the CPU kernel failed: " + "; ".join(errors))


def _load():
    """The loaded library, or None (and `_why_not` set)."""
    global _lib, _why_not, _attention_fast, _amx_tiles, _dots_fast
    if _lib is not None or _why_not is not None:
        return _lib
    with _lock:
        if _lib is not None or _why_not is not None:
            return _lib
        if os.environ.get("SLIPSTREAM_CPU_KERNEL", "").lower() in ("torch", "off", "0", "none"):
            _why_not = "disabled by SLIPSTREAM_CPU_KERNEL"
            return None
        try:
            lib = ctypes.CDLL(str(_build()))     # CDLL releases the GIL during calls
        except (RuntimeError, OSError) as e:
            _why_not = str(e).splitlines()[0]
            log.info("CPU kernel unavailable, using PyTorch: %s", _why_not)
            return None
        lib.sl_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        lib.sl_linear.restype = ctypes.c_int
        lib.sl_linear_batch.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        lib.sl_linear_batch.restype = ctypes.c_int
        lib.sl_weighted_sum.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        lib.sl_weighted_sum.restype = ctypes.c_int
        lib.sl_scatter_add.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        lib.sl_scatter_add.restype = ctypes.c_int
        lib.sl_paged_attention.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
        lib.sl_paged_attention.restype = ctypes.c_int
        lib.sl_paged_attention_fast.restype = ctypes.c_int
        _attention_fast = bool(lib.sl_paged_attention_fast())
        lib.sl_rms_norm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_float]
        lib.sl_rms_norm.restype = ctypes.c_int
        lib.sl_moe_layer.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_void_p]
        lib.sl_moe_layer.restype = ctypes.c_int
        lib.sl_moe_route.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.sl_moe_route.restype = ctypes.c_int
        lib.sl_silu_mul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.sl_silu_mul.restype = ctypes.c_int
        lib.sl_attn_decode.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                                       ctypes.c_void_p, ctypes.c_void_p]
        lib.sl_attn_decode.restype = ctypes.c_int
        lib.sl_attn_decode_many.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
            ctypes.c_void_p]
        lib.sl_attn_decode_many.restype = ctypes.c_int
        lib.sl_ffn_layer.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_void_p]
        lib.sl_ffn_layer.restype = ctypes.c_int
        lib.sl_bf16_code.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int]
        lib.sl_bf16_code.restype = ctypes.c_int64
        lib.sl_bf16_escapes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int]
        lib.sl_bf16_escapes.restype = ctypes.c_int64
        lib.sl_linear_coded.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        lib.sl_linear_coded.restype = ctypes.c_int
        lib.sl_coded_ready.restype = ctypes.c_int
        lib.sl_ffn_layer_coded.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_void_p]
        lib.sl_ffn_layer_coded.restype = ctypes.c_int
        lib.sl_attn_decode_many_coded.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
            ctypes.c_void_p]
        lib.sl_attn_decode_many_coded.restype = ctypes.c_int
        lib.sl_bf16_tight_code.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int] + \
            [ctypes.c_void_p] * 6 + [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        lib.sl_bf16_tight_code.restype = ctypes.c_int64
        lib.sl_copy_many.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.sl_copy_many.restype = ctypes.c_int
        lib.sl_phase_timing.argtypes = [ctypes.c_int]
        lib.sl_phase_timing.restype = None
        lib.sl_phase_read.argtypes = [ctypes.c_void_p]
        lib.sl_phase_read.restype = None
        lib.sl_set_threads.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.sl_set_threads.restype = ctypes.c_int
        lib.sl_isa.restype = ctypes.c_int
        _dots_fast = lib.sl_isa() != 0
        lib.sl_amx_ready.restype = ctypes.c_int
        lib.sl_set_prefetch.argtypes = [ctypes.c_int]
        lib.sl_set_prefetch.restype = ctypes.c_int
        if os.environ.get("SLIPSTREAM_KERNEL_PREFETCH"):     # (elements a long row's reads run ahead; 0 off)
            value = os.environ["SLIPSTREAM_KERNEL_PREFETCH"]
            if value.strip().isdigit():
                lib.sl_set_prefetch(int(value))
            else:
                log.warning("SLIPSTREAM_KERNEL_PREFETCH=%r: expected a number of elements (0: off); keeping %d",
                            value, lib.sl_set_prefetch(-1))
        if os.environ.get("SLIPSTREAM_CPU_AMX", "1") != "0":    # (0: no tiles, for A/B runs)
            _amx_tiles = bool(lib.sl_amx_ready())
        _lib = lib
        return lib


_building = threading.Event()


def _matmul_lib():
    """The loaded library where its matmuls are vector code, else None: a portable-C build multiplies
    element by element, several times slower than PyTorch (that path, built for Haswell before AVX2 had a
    path of its own, read a bf16 FFN matrix at one token at 2.7 GB/s on two cores here, PyTorch held to
    AVX2 15-18), so its matmuls and the layer calls built on them stay with PyTorch; its norms, copies
    and coding still run."""
    lib = _load()
    return lib if lib is not None and _dots_fast else None


def prepare_async() -> None:
    """Build/load the library on a background thread (an engine calls this at open), so the first decode
    step never waits for the compiler; until it is ready, callers take PyTorch's path."""
    if _lib is not None or _why_not is not None or _building.is_set():
        return
    _building.set()

    def build() -> None:
        try:
            _load()
        finally:
            _building.clear()

    threading.Thread(target=build, name="slipstream-kernel-build", daemon=True).start()


def _sync_threads(lib) -> None:
    global _threads
    want = torch.get_num_threads()
    if want != _threads:
        with _lock:
            if want != _threads:
                _threads = lib.sl_set_threads(want, int(os.environ.get("SLIPSTREAM_KERNEL_SPIN", SPIN)))


def set_spin(spins: int) -> bool:
    """How many pause instructions a pool worker spins for the next job before it sleeps (SPIN, or
    SLIPSTREAM_KERNEL_SPIN at start), from now on: longer keeps the workers awake across a gap between CPU
    sub-layers (a GPU attention's 0.5 ms in a MoE decode) at the price of cores a game could use. False
    where the library is not loaded."""
    lib = _load()
    if lib is None:
        return False
    global _threads
    with _lock:
        _threads = lib.sl_set_threads(torch.get_num_threads(), max(int(spins), 0))
    return True


def set_prefetch(words: int) -> int | None:
    """How many elements ahead the native matmuls prefetch a long row's reads (rows of at least 4096
    elements; 0: leave it to the hardware prefetcher), from now on; the distance in use, or None where the
    library is not loaded. The products are the same either way. SLIPSTREAM_KERNEL_PREFETCH sets it at load."""
    lib = _load()
    return None if lib is None else int(lib.sl_set_prefetch(max(int(words), 0)))


def prefetch() -> int | None:
    """The distance `set_prefetch` set (512 elements unless changed), or None without the library."""
    lib = _load()
    return None if lib is None else int(lib.sl_set_prefetch(-1))


def status(wait: bool = False) -> str:
    """One line: which CPU matmul path small-batch linear layers take, and why (`wait`: for a build in
    progress to finish, where the answer must be final, as in a profile's fingerprint)."""
    if _building.is_set() and not wait:
        return "torch (the native kernel is still being built)"
    lib = _load()
    if lib is None:
        return f"torch ({_why_not})"
    tiles_note = ", AMX tiles past 16 rows" if _amx_tiles else ""
    return f"native {_ISA.get(lib.sl_isa(), '?')}{tiles_note}, {torch.get_num_threads()} threads"


_enabled = True
_attention = os.environ.get("SLIPSTREAM_CPU_ATTENTION", "").lower() not in ("torch", "off", "0", "none")


def set_enabled(flag: bool) -> bool:
    """Turn the native path (matmuls and attention) on or off in this process (benchmarks compare both);
    returns the old state."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


def set_attention_enabled(flag: bool) -> bool:
    """Turn native decode attention alone on or off (the matmuls keep their path); returns the old state."""
    global _attention
    old, _attention = _attention, bool(flag)
    return old


_amx: bool | None = None
_max_rows: dict[torch.dtype, int] = {}      # per dtype, worked out once (every native matmul asks)


def max_rows(dtype: torch.dtype) -> int:
    """The most rows a native matmul of `dtype` takes (SLIPSTREAM_NATIVE_MAX_ROWS overrides, for A/B runs)."""
    global _amx
    rows = _max_rows.get(dtype)
    if rows is None:
        env = os.environ.get("SLIPSTREAM_NATIVE_MAX_ROWS")
        if env:
            rows = int(env)
        elif dtype != torch.bfloat16:
            rows = MAX_ROWS
        else:
            if _amx is None:
                _amx = " amx_bf16" in f" {_cpu_features()} "
            rows = MAX_ROWS_AMX_BF16 if _amx else MAX_ROWS
        _max_rows[dtype] = rows
    return rows


def max_rows_many(dtype: torch.dtype) -> int:
    """The most rows per matrix in a batched job (`linear_many`: the experts a step routes to): MAX_ROWS,
    AMX or not (SLIPSTREAM_NATIVE_MAX_ROWS overrides). Past `max_rows`, one large matrix is PyTorch's, but
    a step's small expert matrices are not: PyTorch takes them one op at a time, each op waking its
    threads. Two cores with AMX, a Qwen3-30B-A3B layer's routed experts (`engine.bench.moe_cpu_experts`):
    32 tokens (up to 8 rows an expert) 76-77 ms against 90-109, 64 tokens (up to 14) 90 against 125-127,
    16 tokens (up to 6) 47-49 against 51-71."""
    env = os.environ.get("SLIPSTREAM_NATIVE_MAX_ROWS")
    return int(env) if env else MAX_ROWS


MAX_ROWS_STACKED = 1 << 16   # rows per expert in one `linear_stacked` job on AMX tiles (any prompt's)


def max_rows_stacked(dtype: torch.dtype) -> int:
    """The most rows per matrix in a `linear_stacked` job with `counts` (a step's routed experts): any
    count for bf16 where the library runs many-row matmuls on AMX tiles (`tiles()`), else
    `max_rows_many`. Past 16 rows the dot-product kernel stops being bound by DRAM; the tiles are not (a
    512-token prompt routes about 32 rows to each of a Qwen3-30B-A3B layer's experts), and one job over
    the picked experts replaces about seven PyTorch ops per expert."""
    if dtype == torch.bfloat16 and tiles():
        return MAX_ROWS_STACKED
    return max_rows_many(dtype)


def tiles() -> bool:
    """Whether bf16 matmuls of more than 16 rows in the native library run on AMX tiles: the CPU has them,
    Linux lends their state, a check product matched (`sl_amx_ready`), and SLIPSTREAM_CPU_AMX is not 0."""
    return _enabled and not _building.is_set() and _load() is not None and _amx_tiles


def usable(x: torch.Tensor, w: torch.Tensor, min_weights: int | None = None, rows: int | None = None) -> bool:
    return (x.device.type == "cpu" and x.dtype == w.dtype and x.shape[-1] == w.shape[-1]
            and _takes(x.numel() // max(w.shape[-1], 1), w, min_weights, rows))


def _takes(n_rows: int, w: torch.Tensor, min_weights: int | None = None, rows: int | None = None) -> bool:
    """Whether `linear` takes `n_rows` rows (of w's dtype and width, on the CPU) times w natively."""
    if min_weights is None:
        min_weights = MIN_WEIGHTS if w.dtype == torch.float32 else MIN_WEIGHTS_16BIT
    if _building.is_set():
        return False
    return (_enabled and w.device.type == "cpu" and w.dtype in _DTYPES and w.dim() == 2
            and 0 < n_rows <= (max_rows(w.dtype) if rows is None else rows)
            and w.numel() >= min_weights
            and _matmul_lib() is not None)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           min_weights: int | None = None, rows: int | None = None) -> torch.Tensor | None:
    """`x @ w.T (+ bias)` through the native kernel, or None where it does not apply (the caller then
    uses PyTorch). x [..., K], w [N, K], bias [N]; all on the CPU, one dtype. Matrices of fewer than
    `min_weights` elements are left to PyTorch, and inputs of more than `rows` rows (default `max_rows`)."""
    if not usable(x, w, min_weights, rows) or (bias is not None and (bias.dtype != w.dtype or bias.device.type != "cpu")):
        return None
    lib = _lib
    _sync_threads(lib)
    if x.requires_grad or w.requires_grad:
        return None
    x2 = x.reshape(-1, w.shape[1]).contiguous()
    if not w.is_contiguous():
        return None
    wc = w
    b = None if bias is None else bias.contiguous()
    y = torch.empty(x2.shape[0], w.shape[0], dtype=w.dtype)
    coded = _coded.get(wc.data_ptr()) if _coded else None
    if not _busy.acquire(blocking=False):   # one job at a time on the shared pool; another thread's call
        return None                         # (a second engine in the process) takes PyTorch's path
    try:
        if coded is not None and coded.shape == tuple(wc.shape):
            rc = lib.sl_linear_coded(x2.data_ptr(), ctypes.addressof(coded.desc),
                                     None if b is None else b.data_ptr(), y.data_ptr(), x2.shape[0], w.shape[0],
                                     w.shape[1])
            if rc == 0:
                _count_coded("linear")
                return y.reshape(*x.shape[:-1], w.shape[0])
        rc = lib.sl_linear(_DTYPES[w.dtype], x2.data_ptr(), wc.data_ptr(), None if b is None else b.data_ptr(),
                           y.data_ptr(), x2.shape[0], w.shape[0], w.shape[1])
    finally:
        _busy.release()
    if rc != 0:
        return None
    return y.reshape(*x.shape[:-1], w.shape[0])


MAX_BATCH = 1024           # matmuls in one `linear_many` call (the C side's limit)


def linear_many(xs: list[torch.Tensor], ws: list[torch.Tensor],
                min_weights: int | None = None) -> torch.Tensor | None:
    """`cat([x @ w.T for x, w in zip(xs, ws)])` as one job on the native pool: the experts a step routes
    to, each a matrix too small to be worth a pool wake-up of its own. Every w is [N, K] (one shape),
    every x [m_i, K] with 1 <= m_i <= max_rows_many(dtype), all on the CPU in one dtype. Returns [sum m_i, N], or
    None where the kernel does not apply (the caller then loops with PyTorch). `min_weights` applies to
    the matrices together."""
    if not xs or len(xs) != len(ws) or len(xs) > MAX_BATCH or not _enabled or _building.is_set():
        return None
    w0 = ws[0]
    if w0.dim() != 2 or w0.dtype not in _DTYPES or w0.numel() * len(ws) < (MIN_WEIGHTS if min_weights is None
                                                                           else min_weights):
        return None
    n, k = w0.shape
    rows = max_rows_many(w0.dtype)
    for x, w in zip(xs, ws):
        if (w.shape != w0.shape or w.dtype != w0.dtype or x.dtype != w0.dtype or w.device.type != "cpu"
                or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k or not 0 < x.shape[0] <= rows
                or not x.is_contiguous() or not w.is_contiguous() or x.requires_grad or w.requires_grad):
            return None
    return _batch(w0.dtype, [x.data_ptr() for x in xs], [w.data_ptr() for w in ws], [x.shape[0] for x in xs],
                  n, k)


def _batch(dtype: torch.dtype, xp: list[int], wp: list[int], counts: list[int], n: int, k: int):
    """One `sl_linear_batch` job: matmul i reads counts[i] rows at address xp[i] and the [n, k] matrix at
    wp[i]; the outputs are packed in order into a new [sum(counts), n] tensor (None: no kernel, or the
    pool is busy with another thread's job)."""
    lib = _matmul_lib()
    if lib is None:
        return None
    _sync_threads(lib)
    y = torch.empty(sum(counts), n, dtype=dtype)
    es, at, yp = y.element_size(), y.data_ptr(), []
    for c in counts:
        yp.append(at)
        at += c * n * es
    arr = ctypes.c_void_p * len(xp)
    if not _busy.acquire(blocking=False):
        return None
    try:
        rc = lib.sl_linear_batch(_DTYPES[dtype], len(xp), arr(*xp), arr(*wp), arr(*yp),
                                 (ctypes.c_int64 * len(xp))(*counts), n, k)
    finally:
        _busy.release()
    return y if rc == 0 else None


def linear_stacked(x: torch.Tensor, stacks: list[torch.Tensor], picks: list[tuple[int, int]],
                   min_weights: int | None = None, counts: list[int] | None = None) -> torch.Tensor | None:
    """`y[i] = x[i] @ stacks[s][j].T` for each pick i = (s, j), as one job on the native pool: the one-row
    matmuls of the experts a decode step routes to, read from stacked expert weights [E, N, K] (each
    expert's matrix contiguous; the stack itself may be strided) without a tensor per expert. x: [1, K]
    (every pick reads that row) or [len(picks), K], contiguous. Returns [len(picks), N], or None where the
    kernel does not apply (nothing is computed then). `min_weights` as in `linear_many`.

    With `counts` (a batch's or a prompt's step: pick i takes the next counts[i] rows of x, 1 to
    `max_rows_stacked` each), x is [sum(counts), K] and the result [sum(counts), N], rows in x's order."""
    m = len(picks)
    if counts is not None:
        if len(counts) != m or (m and not 0 < min(counts) <= max(counts) <= max_rows_stacked(x.dtype)):
            return None
        rows_in = sum(counts)
    else:
        rows_in = m
    if not m or m > MAX_BATCH or not stacks or not _enabled or _building.is_set():
        return None
    s0 = stacks[0]
    if s0.dim() != 3 or s0.dtype not in _DTYPES:
        return None
    _, n, k = s0.shape
    dtype = s0.dtype
    if n * k * m < (MIN_WEIGHTS if min_weights is None else min_weights):
        return None
    if (x.dtype != dtype or not x.is_cpu or x.dim() != 2 or x.shape[1] != k
            or x.shape[0] not in ((1, m) if counts is None else (rows_in,))
            or not x.is_contiguous() or x.requires_grad):
        return None
    bases, steps = [], []
    for st in stacks:
        if st is not s0 and (st.dtype != dtype or st.shape[1:] != s0.shape[1:] or st.stride()[1:] != s0.stride()[1:]):
            return None
        if not st.is_cpu or st.requires_grad:
            return None
        bases.append(st.data_ptr())
        steps.append(st.stride(0) * st.element_size())
    if s0.stride(2) != 1 or s0.stride(1) != k:
        return None
    sizes = [st.shape[0] for st in stacks]
    if any(not 0 <= j < sizes[g] for g, j in picks):
        return None
    xp, row = x.data_ptr(), k * x.element_size()
    if counts is not None:
        xs = [xp + row * a for a in accumulate(counts, initial=0)][:m]
    else:
        xs = [xp] * m if x.shape[0] == 1 else list(range(xp, xp + m * row, row))
    return _batch(dtype, xs, [bases[g] + j * steps[g] for g, j in picks], counts or [1] * m, n, k)


MOE_MAX_K = 64             # routed experts per token in one `moe_layer` call (the C side's limit)


class ExpertTable:
    """The addresses of a MoE layer's expert matrices, in expert order, for `moe_layer`: built from the
    groups' stacked weights [n, N, K] (each expert's matrix contiguous) and kept by the caller while those
    tensors live. `gate` holds each expert's stacked gate and up [2I, H] where `up` is None."""

    __slots__ = ("down", "dtype", "experts", "gate", "hidden", "inter", "up")

    def __init__(self, gate: list[int], up: list[int] | None, down: list[int], hidden: int, inter: int,
                 dtype: torch.dtype):
        arr = ctypes.c_void_p * len(down)
        self.gate, self.up, self.down = arr(*gate), None if up is None else arr(*up), arr(*down)
        self.experts, self.hidden, self.inter, self.dtype = len(down), hidden, inter, dtype


def expert_table(stacks: list[dict[str, torch.Tensor]]) -> ExpertTable | None:
    """An `ExpertTable` over the groups' weights (`experts.gate_up.weight` or `experts.gate.weight` and
    `experts.up.weight`, and `experts.down.weight`, each [n, N, K]), or None where a matrix is not
    contiguous, not on the CPU or not 16-bit."""
    names = ("experts.gate_up.weight",) if "experts.gate_up.weight" in stacks[0] else (
        "experts.gate.weight", "experts.up.weight")
    cols: dict[str, list[int]] = {n: [] for n in (*names, "experts.down.weight")}
    shapes, dtype = {}, stacks[0]["experts.down.weight"].dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    for w in stacks:
        for name, out in cols.items():
            st = w.get(name)
            if st is None or st.dim() != 3 or st.dtype != dtype or not st.is_cpu or st.requires_grad:
                return None
            n, rows, k = st.shape
            if st.stride(2) != 1 or st.stride(1) != k or shapes.setdefault(name, (rows, k)) != (rows, k):
                return None
            base, step = st.data_ptr(), st.stride(0) * st.element_size()
            out.extend(range(base, base + n * step, step) if n else ())
    hidden, inter = shapes["experts.down.weight"]
    fused = len(names) == 1
    if shapes[names[0]] != ((2 * inter if fused else inter), hidden) or (
            not fused and shapes[names[1]] != (inter, hidden)):
        return None
    return ExpertTable(cols[names[0]], None if fused else cols[names[1]], cols["experts.down.weight"], hidden,
                       inter, dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` for contiguous 16-bit CPU tensors of one shape and dtype, through the library's
    `sl_silu_mul` (what `moe_layer` computes between its two projections); None where it does not apply."""
    if (not _enabled or _building.is_set() or gate.dtype not in (torch.bfloat16, torch.float16) or up.dtype != gate.dtype
            or gate.shape != up.shape or not gate.is_cpu or not up.is_cpu or not gate.is_contiguous()
            or not up.is_contiguous()):
        return None
    lib = _load()
    if lib is None:
        return None
    out = torch.empty_like(gate)
    rc = lib.sl_silu_mul(_DTYPES[gate.dtype], gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out if rc == 0 else None


MOE_MAX_T = 16             # tokens in one `moe_layer` call (the C side's MOE_MAX_T)


def moe_route(logits: torch.Tensor, top_k: int, norm_topk: bool,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The routing of a step of up to MOE_MAX_T tokens on the CPU (`route_top` in cpu_linear.c, which
    `moe_layer` shares, so a layer run either way picks the same experts with the same weights): (weights
    [t, k] in `dtype`, experts [t, k] int64), each row's k most probable experts of softmax(logits [t, E]) in
    descending order, ties to the lower expert, renormalised where `norm_topk`. None where it does not apply."""
    if (not _enabled or _building.is_set() or logits.dim() != 2 or not 0 < logits.shape[0] <= MOE_MAX_T
            or not logits.is_cpu or logits.dtype not in _DTYPES or dtype not in _DTYPES
            or not 0 < top_k <= min(MOE_MAX_K, logits.shape[1]) or not logits.is_contiguous()):
        return None
    lib = _load()
    if lib is None:
        return None
    t = logits.shape[0]
    top_i = torch.empty(t, top_k, dtype=torch.int64)
    top_w = torch.empty(t, top_k, dtype=dtype)
    rc = lib.sl_moe_route(_DTYPES[logits.dtype], logits.data_ptr(), t, logits.shape[1], top_k, int(norm_topk),
                          _DTYPES[dtype], top_i.data_ptr(), top_w.data_ptr())
    return (top_w, top_i) if rc == 0 else None


def moe_layer(x: torch.Tensor, norm_w: torch.Tensor, eps: float, router: torch.Tensor, top_k: int,
              norm_topk: bool, table: ExpertTable) -> torch.Tensor | None:
    """A step of up to MOE_MAX_T tokens through a whole MoE layer whose router and experts are all on the
    CPU, in one native call (`sl_moe_layer` in cpu_linear.c: norm, router, top k, the routed experts'
    SwiGLU, their weighted sum and the residual add, rounded where the tensor path rounds): x [t, H] ->
    [t, H]. None (nothing done) where it does not apply: no kernel, another dtype, shapes that do not match,
    the pool busy with another thread's job."""
    if (not _enabled or _building.is_set() or x.dtype != table.dtype or x.dim() != 2
            or not 0 < x.shape[0] <= MOE_MAX_T):
        return None
    H = x.shape[1]
    if (H != table.hidden or not x.is_cpu or not x.is_contiguous() or x.requires_grad or not 0 < top_k <= MOE_MAX_K
            or router.dim() != 2 or router.shape != (table.experts, H) or not router.is_cpu
            or not router.is_contiguous() or router.dtype not in (x.dtype, torch.float32)
            or norm_w.shape != (H,) or not norm_w.is_cpu or not norm_w.is_contiguous()
            or norm_w.dtype not in (x.dtype, torch.float32)):
        return None
    lib = _matmul_lib()
    if lib is None:
        return None
    _sync_threads(lib)
    out = torch.empty_like(x)
    if not _busy.acquire(blocking=False):
        return None
    try:
        rc = lib.sl_moe_layer(_DTYPES[x.dtype], _DTYPES[norm_w.dtype], _DTYPES[router.dtype], x.data_ptr(),
                              x.shape[0], norm_w.data_ptr(), float(eps), router.data_ptr(), table.experts, top_k,
                              int(norm_topk), table.gate, table.up, table.down, H, table.inter, out.data_ptr())
    finally:
        _busy.release()
    return out if rc == 0 else None


ATTENTION_PHASES = ("norm", "q/k/v job", "q/k norms, RoPE, cache write", "attention", "output job, residual")
FFN_PHASES = ("norm", "gate/up job", "silu times up", "down job, residual")


def set_phase_timing(on: bool) -> bool:
    """Time the phases of the attention and FFN layer calls (a clock read between phases; off by default).
    False where the library is not loaded."""
    lib = _load()
    if lib is None:
        return False
    lib.sl_phase_timing(1 if on else 0)
    return True


def read_phases() -> dict | None:
    """Seconds per phase of the attention and FFN layer calls since the last read, and the calls timed
    (`set_phase_timing`); the sums are reset. None where the library is not loaded."""
    lib = _load()
    if lib is None:
        return None
    buf = (ctypes.c_double * 11)()
    lib.sl_phase_read(buf)
    return {"attention": dict(zip(ATTENTION_PHASES, buf[0:5])), "attention_calls": int(buf[5]),
            "ffn": dict(zip(FFN_PHASES, buf[6:10])), "ffn_calls": int(buf[10])}


def attention_decode(x: torch.Tensor, w: dict[str, torch.Tensor], eps: float, heads: int, kv_heads: int,
                     cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     table: torch.Tensor, pos: int) -> torch.Tensor | None:
    """One decode token's attention sub-layer on the CPU in one native call (`sl_attn_decode`: the norm, the
    stacked q/k/v projection with its bias, the q/k norms where `w` has them, RoPE, the cache write at
    `pos`, attention over positions 0..pos and the output projection with the residual add, rounded where
    the tensor path rounds). x [1, H] 16-bit; w: the sub-layer's weights ("attn_norm.weight",
    "qkv.weight", optional "qkv.bias", "q_norm.weight" and "k_norm.weight", "o.weight"); cos, sin: [d]
    rows in x's dtype; k_pool, v_pool: [n_blocks, BLOCK, kv_heads, d] in x's dtype; table: the sequence's
    block ids (int64). None (nothing written) where it does not apply: another dtype or layout, no vector
    attention kernel (`attention_ready`), a matmul the tensor path would leave to PyTorch (its bits would
    differ), the pool busy."""
    if x.dim() != 2 or x.shape[0] != 1:
        return None
    return attention_decode_many(x, w, eps, heads, kv_heads, cos.reshape(1, -1), sin.reshape(1, -1), k_pool, v_pool,
                                 [table], [pos])


ATTN_MAX_B = 64     # tokens of one attention_decode_many call (ATTN_MAX_B in cpu_linear.c)


def attention_decode_many(x: torch.Tensor, w: dict[str, torch.Tensor], eps: float, heads: int, kv_heads: int,
                          cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          tables: list[torch.Tensor], positions: list[int]) -> torch.Tensor | None:
    """`attention_decode` for B decode tokens of B sequences at once (`sl_attn_decode_many`; a continuous
    batch's step): x [B, H], cos and sin [B, d] (row b at token b's position), token b written at
    positions[b] of the blocks tables[b] and attending over 0..positions[b]. The projections run as one
    matmul of B rows, as the tensor path's do (same bits); None where that matmul would not be the
    library's (more rows than `max_rows`), or where `attention_decode` would decline."""
    if not attention_ready() or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        return None
    B, (dtype, H) = x.shape[0], (x.dtype, x.shape[1])
    if not 0 < B <= ATTN_MAX_B or len(tables) != B or len(positions) != B:
        return None
    qkv, o, nw = w.get("qkv.weight"), w.get("o.weight"), w.get("attn_norm.weight")
    bias, qn, kn = w.get("qkv.bias"), w.get("q_norm.weight"), w.get("k_norm.weight")
    if bias is None and "q.bias" in w:         # (the biases' packing left gaps between them: no stacked view)
        bias = torch.cat([w["q.bias"], w["k.bias"], w["v.bias"]])
    d = k_pool.shape[-1] if k_pool.dim() == 4 else 0
    if (qkv is None or o is None or nw is None or not d or (qn is None) != (kn is None) or not x.is_contiguous()
            or qkv.shape != ((heads + 2 * kv_heads) * d, H) or o.shape != (H, heads * d)
            or not usable(x, qkv) or o.dtype != dtype or not _takes(B, o)
            or not qkv.is_contiguous() or not o.is_contiguous() or nw.shape != (H,) or not nw.is_contiguous()
            or nw.dtype not in (dtype, torch.float32) or nw.device.type != "cpu"
            or (bias is not None and (bias.dtype != dtype or bias.shape != (qkv.shape[0],) or not bias.is_cpu))
            or k_pool.dtype != dtype or v_pool.dtype != dtype or k_pool.shape != v_pool.shape
            or k_pool.shape[1] != KV_BLOCK or k_pool.shape[2] != kv_heads or d > MAX_HEAD_DIM
            or not (k_pool.is_cpu and v_pool.is_cpu and k_pool.is_contiguous() and v_pool.is_contiguous())
            or cos.dtype != dtype or sin.dtype != dtype or cos.shape != (B, d) or sin.shape != (B, d)
            or not (cos.is_cpu and sin.is_cpu and cos.is_contiguous() and sin.is_contiguous())
            or any(t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() for t in tables)):
        return None
    if qn is not None and (qn.dtype != kn.dtype or qn.dtype not in (dtype, torch.float32) or qn.shape != (d,)
                           or kn.shape != (d,) or not (qn.is_cpu and kn.is_cpu and qn.is_contiguous()
                                                       and kn.is_contiguous())):
        return None
    lib = _lib
    _sync_threads(lib)     # (the call's jobs run on the pool: at torch's thread count, as every other call's)
    out = torch.empty_like(x)
    ptrs = (ctypes.c_void_p * B)(*[t.data_ptr() for t in tables])
    lens = (ctypes.c_int64 * B)(*[t.numel() for t in tables])
    pos = (ctypes.c_int64 * B)(*positions)
    cq, co = (_coded.get(qkv.data_ptr()), _coded.get(o.data_ptr())) if _coded else (None, None)
    with _busy:
        if cq is not None and co is not None and cq.shape == tuple(qkv.shape) and co.shape == tuple(o.shape):
            rc = lib.sl_attn_decode_many_coded(
                _DTYPES[nw.dtype], x.data_ptr(), B, H, nw.data_ptr(), float(eps), ctypes.addressof(cq.desc),
                None if bias is None else bias.data_ptr(), heads, kv_heads, d,
                _DTYPES[qn.dtype] if qn is not None else 0, None if qn is None else qn.data_ptr(),
                None if kn is None else kn.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(),
                v_pool.data_ptr(), k_pool.shape[0], ptrs, lens, pos, 1.0 / math.sqrt(d), ctypes.addressof(co.desc),
                out.data_ptr())
            if rc == 0:
                _count_coded("attention")
                return out
        rc = lib.sl_attn_decode_many(_DTYPES[dtype], _DTYPES[nw.dtype], x.data_ptr(), B, H, nw.data_ptr(),
                                     float(eps), qkv.data_ptr(), None if bias is None else bias.data_ptr(), heads,
                                     kv_heads, d, _DTYPES[qn.dtype] if qn is not None else 0,
                                     None if qn is None else qn.data_ptr(), None if kn is None else kn.data_ptr(),
                                     cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                                     k_pool.shape[0], ptrs, lens, pos, 1.0 / math.sqrt(d), o.data_ptr(),
                                     out.data_ptr())
    return out if rc == 0 else None


# the dense FFN as one native call (`ffn_layer`); SLIPSTREAM_CPU_FFN_CALL=0 (or set_ffn_call) for A/B runs
_ffn_call = os.environ.get("SLIPSTREAM_CPU_FFN_CALL", "1") != "0"


def set_ffn_call(flag: bool) -> bool:
    """Turn the one-call dense FFN on or off in this process (benchmarks compare both); returns the old state."""
    global _ffn_call
    old, _ffn_call = _ffn_call, bool(flag)
    return old


def ffn_layer(x: torch.Tensor, w: dict[str, torch.Tensor], eps: float) -> torch.Tensor | None:
    """A dense SwiGLU FFN sub-layer for a few rows on the CPU in one native call (`sl_ffn_layer`: the norm,
    gate and up, silu times up, down and the residual add, rounded where `dense.ffn_block` rounds): x [t, H]
    16-bit -> [t, H]. None where it does not apply, among others where the tensor path would leave a
    matmul to PyTorch (too small a matrix, too many rows: its bits would differ)."""
    if (not _ffn_call or not _enabled or _building.is_set() or x.dtype not in (torch.bfloat16, torch.float16)
            or x.dim() != 2 or not x.is_cpu or not x.is_contiguous() or x.requires_grad):
        return None
    nw, down = w.get("ffn_norm.weight"), w.get("down.weight")
    gu = w.get("gate_up.weight")
    gate, up = (gu, None) if gu is not None else (w.get("gate.weight"), w.get("up.weight"))
    if nw is None or down is None or gate is None or (gu is None and up is None):
        return None
    t, H = x.shape
    inter = down.shape[1] if down.dim() == 2 else 0
    if (down.shape != (H, inter) or gate.shape != ((2 * inter if up is None else inter), H)
            or (up is not None and up.shape != (inter, H)) or nw.shape != (H,)
            or nw.dtype not in (x.dtype, torch.float32) or not nw.is_cpu or not nw.is_contiguous()
            or any(m.dtype != x.dtype or not m.is_contiguous() for m in (gate, down, *(() if up is None else (up,))))
            or not usable(x, gate) or (up is not None and not usable(x, up))
            or not _takes(t, down)):
        return None
    lib = _lib
    _sync_threads(lib)
    out = torch.empty_like(x)
    coded = _coded.get(gate.data_ptr()) if up is None and _coded else None
    coded_down = _coded.get(down.data_ptr()) if coded is not None else None
    if not _busy.acquire(blocking=False):
        return None
    try:
        if coded_down is not None and coded.shape == tuple(gate.shape) and coded_down.shape == tuple(down.shape):
            rc = lib.sl_ffn_layer_coded(x.data_ptr(), t, H, _DTYPES[nw.dtype], nw.data_ptr(), float(eps),
                                        ctypes.addressof(coded.desc), ctypes.addressof(coded_down.desc), inter,
                                        out.data_ptr())
            if rc == 0:
                _count_coded("ffn")
                return out
        rc = lib.sl_ffn_layer(_DTYPES[x.dtype], _DTYPES[nw.dtype], x.data_ptr(), t, H, nw.data_ptr(), float(eps),
                              gate.data_ptr(), None if up is None else up.data_ptr(), down.data_ptr(), inter,
                              out.data_ptr())
    finally:
        _busy.release()
    return out if rc == 0 else None


# Raw matrices (by address) whose transfer-coded form the native calls read instead (`read_coded`), and how
# many calls did so
_coded: dict[int, object] = {}
coded_calls = {"linear": 0, "ffn": 0, "attention": 0}


def _count_coded(kind: str) -> None:
    coded_calls[kind] += 1


def read_coded(raw: torch.Tensor, mat) -> None:
    """From now on the native calls read matrix `raw` (bf16 [n, k] on the CPU) from `mat`, its transfer-coded
    form (a `transfer_code.CpuMatrix`): `linear`, `ffn_layer` where its FFN's gate_up and down both have one,
    the attention call where qkv and o do. The same bits, three quarters of the bytes (opt-in:
    `SLIPSTREAM_CPU_CODED=1`, see `engine.sharding.weights`)."""
    if mat.shape != tuple(raw.shape) or raw.dtype != torch.bfloat16:
        raise ValueError("read_coded: the coded matrix is not this one")
    _coded[raw.data_ptr()] = mat


def forget_coded(raws) -> None:
    """Stop reading these raw matrices coded (their store closes)."""
    for t in raws:
        _coded.pop(t.data_ptr(), None)


def weighted_sum(out: torch.Tensor, y: torch.Tensor, wt: torch.Tensor, from_zero: bool = False) -> bool:
    """`out.addcmul_(y[i], wt[i])` for each row i of y in turn, in one native call: out [..., N] holds one
    row, y [m, N], wt [m], all contiguous bf16 (or all fp16) on the CPU; every step rounds to the dtype
    as PyTorch's addcmul_ does, so the sums are the same to the bit. `from_zero`: out's contents are
    ignored, the sum starts at zero (as from `torch.zeros`). False (out untouched) where it does not
    apply: other dtypes (a float32 product is not exact, so PyTorch's rounding could differ), shapes, no
    kernel."""
    if not _enabled or _building.is_set():
        return False
    dtype = out.dtype
    if dtype not in (torch.bfloat16, torch.float16) or y.dtype != dtype or wt.dtype != dtype:
        return False
    if (y.dim() != 2 or out.numel() != y.shape[1] or wt.numel() != y.shape[0] or not out.is_cpu or not y.is_cpu
            or not wt.is_cpu or not out.is_contiguous() or not y.is_contiguous() or not wt.is_contiguous()
            or out.requires_grad):
        return False
    lib = _load()
    if lib is None:
        return False
    o = out.data_ptr()
    return lib.sl_weighted_sum(_DTYPES[dtype], o, None if from_zero else o, y.data_ptr(), wt.data_ptr(),
                               y.shape[0], y.shape[1]) == 0


class CodedMat(ctypes.Structure):
    """The C side's `coded_mat`: a bf16 matrix read in place from its transfer-coded form."""
    _fields_ = [("n_chunks", ctypes.c_int64), ("first_row", ctypes.POINTER(ctypes.c_int64)),
                ("lo", ctypes.POINTER(ctypes.c_void_p)),
                ("nib", ctypes.POINTER(ctypes.c_void_p)), ("base", ctypes.POINTER(ctypes.c_uint8)),
                ("esc_pos", ctypes.c_void_p), ("esc_val", ctypes.c_void_p), ("n_esc", ctypes.c_int64),
                ("word0", ctypes.c_int64)]


def coded_ready() -> bool:
    """Whether the native matmul reads transfer-coded matrices here (AVX512-BF16)."""
    lib = _load()
    return lib is not None and bool(lib.sl_coded_ready())


def linear_coded(x: torch.Tensor, mat, n: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ w.T (+ bias)` for a bf16 matrix w [n, k] held transfer-coded (`mat`: a
    `transfer_code.CpuMatrix`), read in place: the same bits as `linear` over the raw matrix, from three
    quarters of the bytes. None where it does not apply (the caller reads the raw matrix)."""
    if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != k or x.requires_grad
            or (bias is not None and (bias.dtype != torch.bfloat16 or bias.device.type != "cpu"))):
        return None
    lib = _load()
    if lib is None or _building.is_set():
        return None
    _sync_threads(lib)
    x2 = x.reshape(-1, k).contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    if not _busy.acquire(blocking=False):
        return None
    try:
        rc = lib.sl_linear_coded(x2.data_ptr(), ctypes.addressof(mat.desc), None if b is None else b.data_ptr(),
                                 y.data_ptr(), x2.shape[0], n, k)
    finally:
        _busy.release()
    return None if rc != 0 else y.reshape(*x.shape[:-1], n)


def bf16_code(words: torch.Tensor, base: int, lo: torch.Tensor | None, nib: torch.Tensor | None) -> int | None:
    """Transfer coding's encoder (`engine.sharding.transfer_code`) in one native call over the pool: the low
    bytes of `words` (int16 [W], contiguous, on the CPU) into `lo` (uint8 [W]) and their 4-bit codes against
    `base` into `nib` (uint8 [ceil(W/2)]); with `lo` and `nib` None it only counts. Returns the number of
    escapes, or None where the library is not there (the caller codes with tensor operations)."""
    if not (words.is_cpu and words.is_contiguous()):
        return None
    if lo is not None and not (lo.is_cpu and nib.is_cpu and lo.is_contiguous() and nib.is_contiguous()
                               and lo.numel() == words.numel() and nib.numel() == (words.numel() + 1) // 2):
        return None
    lib = _load()
    if lib is None:
        return None
    _sync_threads(lib)
    pooled = _busy.acquire(blocking=False)
    try:
        n = lib.sl_bf16_code(words.data_ptr(), words.numel(), int(base), None if lo is None else lo.data_ptr(),
                             None if nib is None else nib.data_ptr(), int(pooled))
    finally:
        if pooled:
            _busy.release()
    return None if n < 0 else int(n)


def bf16_escapes(words: torch.Tensor, base: int, k: int) -> torch.Tensor | None:
    """The word positions (int32 [k]) that `bf16_code` coded as escapes; None without the library."""
    lib = _load()
    if lib is None:
        return None
    pos = torch.empty(k, dtype=torch.int32)
    pooled = _busy.acquire(blocking=False)
    try:
        got = lib.sl_bf16_escapes(words.data_ptr(), words.numel(), int(base), pos.data_ptr(), k, int(pooled))
    finally:
        if pooled:
            _busy.release()
    return pos if got == k else None


def bf16_tight_code(words: torch.Tensor, base: int, base2: int, parts: tuple[torch.Tensor, ...] | None = None,
                    pos: torch.Tensor | None = None) -> tuple[int, int] | None:
    """Transfer coding's tight encoder (`engine.sharding.transfer_code._code_tight`) in one native call over
    the pool: `words` (int16 [W], contiguous, on the CPU) against the windows `base` and `base2` into `parts`
    (block starts int32, low bytes, signs, codes, second codes: uint8 views of the chunk, the second codes
    zeroed) and the escapes' positions into `pos` (int32); with `parts` None it only counts. Returns (second
    stream's length, escapes), or None where the library is not there (the caller uses tensor operations)."""
    if not (words.is_cpu and words.is_contiguous()):
        return None
    if parts is not None and not all(p.is_cpu and p.is_contiguous() for p in parts):
        return None
    lib = _load()
    if lib is None:
        return None
    _sync_threads(lib)
    ptrs = [None] * 5 if parts is None else [p.data_ptr() for p in parts]
    n2 = ctypes.c_int64(0)
    pooled = _busy.acquire(blocking=False)
    try:
        esc = lib.sl_bf16_tight_code(words.data_ptr(), words.numel(), int(base), int(base2), *ptrs,
                                     None if pos is None else pos.data_ptr(), ctypes.byref(n2), int(pooled))
    finally:
        if pooled:
            _busy.release()
    return None if esc < 0 else (int(n2.value), int(esc))


def copy_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Copy each (dst, src) pair of contiguous CPU tensors of the same byte size (not overlapping) in one
    native call whose pieces the pool shares; False (nothing copied) where the library is not there or off,
    or a pair does not qualify (the caller copies with PyTorch)."""
    if not pairs or not _enabled or _building.is_set():
        return False
    for dst, src in pairs:
        if (dst.device.type != "cpu" or src.device.type != "cpu" or not dst.is_contiguous() or not src.is_contiguous()
                or dst.numel() * dst.element_size() != src.numel() * src.element_size()):
            return False
    lib = _load()
    if lib is None:
        return False
    n = len(pairs)
    dst = (ctypes.c_void_p * n)(*[d.data_ptr() for d, _ in pairs])
    src = (ctypes.c_void_p * n)(*[s.data_ptr() for _, s in pairs])
    nbytes = (ctypes.c_int64 * n)(*[d.numel() * d.element_size() for d, _ in pairs])
    _sync_threads(lib)
    pooled = _busy.acquire(blocking=False)
    try:
        return lib.sl_copy_many(n, dst, src, nbytes, int(pooled)) == 0
    finally:
        if pooled:
            _busy.release()


def scatter_add(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor) -> bool:
    """`out.index_add_(0, rows[i:i+1], y[i:i+1])` for each i in turn, in one native call (a large one split
    by columns over the pool, the same bits):
    out [R, N], y [m, N] contiguous in one dtype (bf16, fp16, fp32) on the CPU, rows int64 [m] within R
    (repeats allowed: each add rounds to the dtype before the next, in order). False (out untouched)
    where it does not apply."""
    if not _enabled or _building.is_set() or out.dtype not in _DTYPES or y.dtype != out.dtype:
        return False
    if (out.dim() != 2 or y.dim() != 2 or y.shape[1] != out.shape[1] or rows.dtype != torch.int64
            or rows.numel() != y.shape[0] or not (out.is_cpu and y.is_cpu and rows.is_cpu)
            or not (out.is_contiguous() and y.is_contiguous() and rows.is_contiguous()) or out.requires_grad):
        return False
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < out.shape[0]:
        return False
    lib = _load()
    if lib is None:
        return False
    _sync_threads(lib)
    pooled = _busy.acquire(blocking=False)    # (a prompt's adds split by columns on the pool; else here)
    try:
        return lib.sl_scatter_add(_DTYPES[out.dtype], out.data_ptr(), y.data_ptr(), rows.data_ptr(), y.shape[0],
                                  y.shape[1], int(pooled)) == 0
    finally:
        if pooled:
            _busy.release()


MAX_HEAD_DIM = 256         # the C side's limit (an item's scratch lives on its thread's stack)
KV_BLOCK = 16              # tokens per pool block the C side reads (kvcache.BLOCK_SIZE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight2: torch.Tensor | None = None,
             period: int = 0, split: int = 0) -> torch.Tensor | None:
    """The engine's rms_norm over the last dimension of a CPU tensor in one native call (decode rows: the
    dozen small PyTorch ops it replaces cost more than the arithmetic), or None where it does not apply.
    With `weight2`, rows whose index (over all leading dimensions) modulo `period` is `split` or more
    take it instead of `weight`."""
    if not _enabled or _building.is_set() or x.device.type != "cpu" or x.dtype not in _DTYPES:
        return None
    n = x.shape[-1]
    for w in (weight, weight2):
        if w is not None and (w.device.type != "cpu" or w.dim() != 1 or w.shape[0] != n or not w.is_contiguous()
                              or w.dtype not in (x.dtype, torch.float32)):
            return None
    if weight2 is not None and weight2.dtype != weight.dtype:
        return None
    if not x.is_contiguous() or x.requires_grad or x.numel() > MAX_NORM_ELEMENTS:
        return None
    lib = _load()
    if lib is None:
        return None
    out = torch.empty_like(x)
    rc = lib.sl_rms_norm(_DTYPES[x.dtype], _DTYPES[weight.dtype], x.data_ptr(), weight.data_ptr(),
                         None if weight2 is None else weight2.data_ptr(), out.data_ptr(), x.numel() // n, n,
                         period, split, float(eps))
    return out if rc == 0 else None


def attention_ready() -> bool:
    """Whether `paged_decode_attention` may answer now (cheap: callers test it before preparing tables):
    on, built, and built with vector code (AVX-512, or AVX2 with FMA and F16C) that beats PyTorch's SDPA;
    a build without was slower for fp16, so it leaves attention to PyTorch."""
    if not (_enabled and _attention) or _building.is_set():
        return False
    return _load() is not None and _attention_fast


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           tables: list[torch.Tensor], lengths: list[int], rows: list[int] | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of one new query token per sequence over its first `lengths[i]` keys and values, read from
    the paged pools through its block table, no gathered copy: float32 scores and softmax, the output
    rounded once, as PyTorch's CPU SDPA (`enable_gqa`: query head h reads KV head h // (heads / kv_heads)).

    k_pool, v_pool: [n_blocks, BLOCK_SIZE, kv_heads, head_dim], contiguous, q's dtype (bf16, fp16, fp32).
    q: [heads, head_dim] (one sequence), or [heads, N, head_dim] with sequence i's query at row rows[i]
    (default i). tables: one int64 CPU tensor of block ids per sequence. Returns out (a new tensor like q
    unless given; only the sequences' rows are written), or None where the kernel does not apply: not
    `attention_ready()`, another dtype (an FP8 pool's uint8), tensors off the CPU, a layout
    it does not take. Nothing is written then. A pool busy with another thread's job is waited for (a
    matmul takes PyTorch's path instead): which arithmetic a step gets never depends on timing."""
    if not attention_ready():
        return None
    dtype = q.dtype
    code = _DTYPES.get(dtype)
    shape = k_pool.shape
    if (code is None or k_pool.dtype != dtype or v_pool.dtype != dtype or len(shape) != 4 or v_pool.shape != shape
            or shape[1] != KV_BLOCK or shape[3] > MAX_HEAD_DIM or not (q.is_cpu and k_pool.is_cpu and v_pool.is_cpu)
            or not (k_pool.is_contiguous() and v_pool.is_contiguous()) or q.requires_grad):
        return None
    n_blocks, _, kv_heads, d = shape
    two_d = q.dim() == 2
    if q.dim() != 3 and not two_d:
        return None
    q_strides = q.stride()
    heads, n_rows = q.shape[0], 1 if two_d else q.shape[1]
    n = len(tables)
    if rows is None:
        rows = range(n)
    if (q.shape[-1] != d or heads % kv_heads or q_strides[-1] != 1 or not n or len(lengths) != n or len(rows) != n
            or min(rows) < 0 or max(rows) >= n_rows):
        return None
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != dtype or not out.is_cpu:
        return None
    o_strides = out.stride()
    if o_strides[-1] != 1:
        return None
    if any(t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() for t in tables):
        return None
    lib = _lib
    _sync_threads(lib)
    es = q.element_size()
    qp, op = q.data_ptr(), out.data_ptr()
    qs, os_ = (0, 0) if two_d else (q_strides[1] * es, o_strides[1] * es)
    ptrs, ints = ctypes.c_void_p * n, ctypes.c_int64 * n
    args = (code, n, ptrs(*[qp + r * qs for r in rows]), ptrs(*[op + r * os_ for r in rows]),
            ptrs(*[t.data_ptr() for t in tables]), ints(*[t.numel() for t in tables]), ints(*lengths),
            k_pool.data_ptr(), v_pool.data_ptr(), n_blocks, heads, kv_heads, d, q_strides[0], o_strides[0],
            1.0 / math.sqrt(d))
    with _busy:
        rc = lib.sl_paged_attention(*args)
    return out if rc == 0 else None
