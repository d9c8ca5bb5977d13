"""The native library's thread pool under stalls that hold its race windows open (a test build of
`engine/kernels/cpu_linear.c` with SL_POOL_TEST): every chunk of every job runs exactly once, in its own job.

Session 17: the H200 host's decode died in a worker of the library (a general protection fault under
`kernels.ffn_layer`). One window fits: a worker that read the job counter with every chunk of the last job
claimed, and was then held up, compared its chunk number with the next job's chunk count and won its
compare-and-swap on the old counter before the new one was published, so it ran a chunk past the old job's
end, in the new job's fields, and counted it done there (the new job could then end before its last chunk).
`run_pool` now closes the counter before it changes the job's fields. The test builds the library twice:
as it is, and with that closing line taken out, which must show the fault under the same stalls.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from engine import kernels

SOURCE = Path(kernels.__file__).with_name("cpu_linear.c")
CLOSING = ("    atomic_store_explicit(&pool.next, ((unsigned long long)job_no << 32) | 0xffffffffull, "
           "memory_order_seq_cst);\n")


def _build(tmp_path: Path, name: str, text: str):
    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src, lib = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    src.write_text(text)
    r = subprocess.run([cc, "-O2", "-DSL_POOL_TEST", "-shared", "-fPIC", "-pthread", "-o", str(lib), str(src), "-lm"],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = ctypes.CDLL(str(lib))
    out.sl_pool_test.argtypes = [ctypes.c_int] * 5
    out.sl_pool_test.restype = ctypes.c_int
    return out


def test_every_chunk_runs_once_in_its_own_job_when_workers_are_held_up(tmp_path):
    text = SOURCE.read_text()
    assert text.count(CLOSING) == 1
    # 40 jobs alternating 1 and 64 chunks on 4 threads; a worker that finds its job's chunks all claimed
    # waits 300 us, the caller waits 3 ms between a job's fields and its counter
    args = (4, 40, 64, 300, 3000)
    assert _build(tmp_path, "pool", text).sl_pool_test(*args) == 0
    assert _build(tmp_path, "pool_open", text.replace(CLOSING, "")).sl_pool_test(*args) > 0
