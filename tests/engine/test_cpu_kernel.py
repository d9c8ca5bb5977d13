"""The native CPU matmul (engine.kernels) against a float64 reference, and its fallbacks."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.models import dense

needs_kernel = pytest.mark.skipif(kernels._load() is None, reason=f"no native kernel: {kernels.status()}")


@pytest.fixture(autouse=True)
def _every_row_count(monkeypatch):
    """The kernel's arithmetic is tested up to its 16 rows in every dtype, also where the engine hands
    bf16 matmuls of more than 4 rows to PyTorch (CPUs with AMX; see `kernels.max_rows`)."""
    monkeypatch.setattr(kernels, "MAX_ROWS_AMX_BF16", kernels.MAX_ROWS)
    monkeypatch.setattr(kernels, "_max_rows", {})


def test_bf16_rows_of_one_matrix_go_to_pytorch_past_four_where_the_cpu_has_amx(monkeypatch):
    """One large bf16 matrix of more than 4 rows is PyTorch's on an AMX CPU; a batched job's small
    matrices (a step's routed experts) stay native up to 16 rows."""
    monkeypatch.undo()
    monkeypatch.delenv("SLIPSTREAM_NATIVE_MAX_ROWS", raising=False)
    for amx, want in ((True, kernels.MAX_ROWS_AMX_BF16), (False, kernels.MAX_ROWS)):
        monkeypatch.setattr(kernels, "_amx", amx)
        monkeypatch.setattr(kernels, "_max_rows", {})
        assert kernels.max_rows(torch.bfloat16) == want
        assert kernels.max_rows(torch.float16) == kernels.max_rows(torch.float32) == kernels.MAX_ROWS
    assert kernels.MAX_ROWS_AMX_BF16 < kernels.MAX_ROWS
    monkeypatch.setattr(kernels, "_amx", True)
    monkeypatch.setattr(kernels, "_max_rows", {})
    w = torch.randn(4096, 512).to(torch.bfloat16)
    for rows, native in ((4, True), (5, False), (16, False)):
        assert kernels.usable(torch.randn(rows, 512).to(torch.bfloat16), w, min_weights=0) is (
            native and kernels._load() is not None)
    for rows, native in ((4, True), (5, True), (16, True), (17, False)):
        assert (kernels.linear_many([torch.randn(rows, 512).to(torch.bfloat16)], [w], min_weights=0) is not None) is (
            native and kernels._load() is not None)
    monkeypatch.setenv("SLIPSTREAM_NATIVE_MAX_ROWS", "16")
    monkeypatch.setattr(kernels, "_max_rows", {})
    assert kernels.max_rows(torch.bfloat16) == 16


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("shape", [(300, 1024), (37, 50), (5, 33), (1, 1), (260, 16)])
def test_matches_float64_reference(dtype, rows, shape):
    """As accurate as a float32-accumulating matmul rounded once (what PyTorch's CPU matmul does)."""
    g = torch.Generator().manual_seed(rows * 1000 + shape[0])
    n, k = shape
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        y = kernels.linear(x, w, bias, min_weights=0)
        assert y is not None and y.dtype == dtype and y.shape == (rows, n)
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        once = (x.float() @ w.float().T + (0 if bias is None else bias.float())).to(dtype)
        assert _rel_err(y, ref) <= max(1.01 * _rel_err(once, ref), 2e-6)


@needs_kernel
def test_several_threads_split_rows_exactly():
    """Row ranges per thread cover every output once: same result with 1 and 2 threads, big enough to
    wake the pool."""
    w = torch.randn(4099, 512).to(torch.bfloat16)
    x = torch.randn(3, 512).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, w, min_weights=0)
        torch.set_num_threads(2)
        two = kernels.linear(x, w, min_weights=0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert _rel_err(two, x.double() @ w.double().T) < 1e-2


@needs_kernel
def test_leading_dims_and_fallbacks():
    w = torch.randn(64, 32)
    x = torch.randn(2, 3, 32)
    y = kernels.linear(x, w, min_weights=0)
    assert y.shape == (2, 3, 64)
    assert torch.allclose(y, F.linear(x, w), atol=1e-5)
    assert kernels.linear(x, w) is None                                    # too small to be worth it
    assert kernels.linear(torch.randn(17, 32), w, min_weights=0) is None                  # more rows than the kernel takes
    assert kernels.linear(x.to(torch.float64), w.to(torch.float64), min_weights=0) is None  # dtype it does not handle
    assert kernels.linear(x.to(torch.bfloat16), w, min_weights=0) is None                 # mixed dtypes
    assert kernels.linear(torch.randn(1, 64), w.T, min_weights=0) is None                 # non-contiguous weight
    # dense.linear always answers, through whichever path applies
    for xx in (torch.randn(1, 32), torch.randn(40, 32)):
        assert torch.allclose(dense.linear(xx, w), F.linear(xx, w), atol=1e-5)


def _status_in_subprocess(env: dict) -> str:
    code = "from engine import kernels; print(kernels.status())"
    full = {**os.environ, **env}
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=full, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_disabled_by_environment(tmp_path):
    out = _status_in_subprocess({"SLIPSTREAM_CPU_KERNEL": "torch", "SLIPSTREAM_KERNEL_CACHE": str(tmp_path)})
    assert out == "torch (disabled by SLIPSTREAM_CPU_KERNEL)"


def test_without_a_compiler_falls_back_with_a_reason(tmp_path):
    out = _status_in_subprocess({"CC": "", "PATH": str(tmp_path), "SLIPSTREAM_KERNEL_CACHE": str(tmp_path)})
    assert out.startswith("torch (") and "compiler" in out


@needs_kernel
def test_a_debug_build_is_cached_apart_and_carries_line_information(tmp_path, monkeypatch):
    """SLIPSTREAM_KERNEL_DEBUG=1 builds the same optimised library with debug information (a crash's offset
    then names a source line), under its own cache key; without it the plain build is used."""
    monkeypatch.setenv("SLIPSTREAM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("SLIPSTREAM_KERNEL_DEBUG", raising=False)
    plain = kernels._build()
    monkeypatch.setenv("SLIPSTREAM_KERNEL_DEBUG", "1")
    debug = kernels._build()
    assert debug != plain and debug.exists() and plain.exists()
    assert b".debug_info" in debug.read_bytes() and b".debug_info" not in plain.read_bytes()


@needs_kernel
def test_concurrent_callers_all_get_right_answers():
    """The native pool runs one job at a time; a caller that finds it busy gets PyTorch's result, never a
    mixed one."""
    import threading

    w = torch.randn(2048, 512).to(torch.bfloat16)
    xs = [torch.randn(2, 512).to(torch.bfloat16) for _ in range(4)]
    want = [F.linear(x.float(), w.float()) for x in xs]
    errors, native = [], []

    def run(i):
        for _ in range(50):
            y = kernels.linear(xs[i], w, min_weights=0)
            if y is None:
                y = F.linear(xs[i], w)
            else:
                native.append(i)
            if (y.float() - want[i]).abs().max() > 0.05 * want[i].abs().max():
                errors.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and native


def test_background_build_never_blocks_a_caller(tmp_path):
    """An engine starts the build at open; a matmul issued meanwhile takes PyTorch's path, and once the
    build is done the native path answers."""
    code = ("import time, torch\n"
            "from engine import kernels\n"
            "kernels.prepare_async()\n"
            "w = torch.randn(64, 32); x = torch.randn(1, 32)\n"
            "early = kernels.linear(x, w, min_weights=0)\n"
            "t = time.time()\n"
            "while kernels._building.is_set() and time.time() - t < 120: time.sleep(0.05)\n"
            "late = kernels.linear(x, w, min_weights=0)\n"
            "print(early is None, late is not None, kernels.status())\n")
    env = {**os.environ, "SLIPSTREAM_KERNEL_CACHE": str(tmp_path)}      # empty cache: a real build
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=180,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr
    early_none, late_native, status = r.stdout.split(maxsplit=2)
    assert early_none == "True"
    assert late_native == ("True" if status.startswith("native") else "False")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_many_matches_each_matmul(dtype):
    """One pool job over matrices of one shape, each with its own rows (1..16), equals the matmuls one by
    one through the same kernel; the split crosses matrix boundaries (rows not a multiple of 4, 2 threads)."""
    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(301, 96, generator=g).to(dtype) for _ in range(5)]
    xs = [torch.randn(m, 96, generator=g).to(dtype) for m in (1, 16, 3, 1, 7)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = kernels.linear_many(xs, ws, min_weights=0)
        each = torch.cat([kernels.linear(x, w, min_weights=0) for x, w in zip(xs, ws)])
    finally:
        torch.set_num_threads(before)
    assert y is not None and y.shape == (28, 301) and y.dtype == dtype
    assert torch.equal(y, each)
    ref = torch.cat([x.double() @ w.double().T for x, w in zip(xs, ws)])
    once = torch.cat([(x.float() @ w.float().T).to(dtype) for x, w in zip(xs, ws)])
    assert _rel_err(y, ref) <= max(1.01 * _rel_err(once, ref), 2e-6)


@needs_kernel
def test_linear_many_declines_what_it_cannot_run():
    w = torch.randn(8, 4)
    assert kernels.linear_many([torch.randn(17, 4)], [w], min_weights=0) is None          # too many rows
    assert kernels.linear_many([torch.randn(1, 4)], [torch.randn(8, 5)], min_weights=0) is None
    assert kernels.linear_many([torch.randn(1, 4), torch.randn(1, 4)], [w, torch.randn(9, 4)],
                               min_weights=0) is None                                      # two shapes
    assert kernels.linear_many([torch.randn(1, 4).bfloat16()], [w], min_weights=0) is None   # two dtypes
    assert kernels.linear_many([torch.randn(1, 4)], [w]) is None                         # below MIN_WEIGHTS
    assert kernels.linear_many([], []) is None


@needs_kernel
def test_pool_under_oversubscription_gives_exact_results():
    """Many back-to-back jobs of mixed sizes (pool jobs, inline ones, batches) on more kernel threads than
    cores: workers wake late and miss jobs, chunks are claimed by whoever is awake; every result equals
    the one-thread result bit for bit (each output row is computed by one thread, the same way)."""
    g = torch.Generator().manual_seed(11)
    cases = []
    for i in range(60):
        n = [4099, 37, 515, 1024, 8][i % 5]
        k = [256, 64, 96, 128, 32][(i // 5) % 5]
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        x = torch.randn(1 + i % 5, k, generator=g).to(torch.bfloat16)
        cases.append((x, w))
    many = [([torch.randn(1 + j % 3, 96, generator=g).to(torch.bfloat16) for j in range(7)],
             [torch.randn(301, 96, generator=g).to(torch.bfloat16) for _ in range(7)]) for _ in range(5)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [kernels.linear(x, w, min_weights=0) for x, w in cases]
        want_many = [kernels.linear_many(xs, ws, min_weights=0) for xs, ws in many]
        torch.set_num_threads(6)
        for _ in range(3):
            got = [kernels.linear(x, w, min_weights=0) for x, w in cases]
            got_many = [kernels.linear_many(xs, ws, min_weights=0) for xs, ws in many]
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert all(torch.equal(a, b) for a, b in zip(got_many, want_many))
    finally:
        torch.set_num_threads(before)


def _torch_rms_norm(x, weight, eps):
    """dense.rms_norm's PyTorch steps (the reference the native norm follows)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:
        return (weight.float() * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("wide_weight", [False, True])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 576), (1, 40, 128), (2, 7)])
def test_native_rms_norm_follows_the_pytorch_steps(dtype, wide_weight, shape):
    """The same rounding steps as the PyTorch norm: 16-bit results equal but for the last bit of a few
    elements, float32 ones within four units of the last place (only the order of the sum of squares differs)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(torch.float32 if wide_weight else dtype)
    got = kernels.rms_norm(x, w, 1e-6)
    want = _torch_rms_norm(x, w, 1e-6)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -21}[dtype]
    diff = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
    assert diff.max().item() <= 1.01 * ulp
    if dtype != torch.float32:     # (in float32 a last-bit change of a row's scale shows in all its elements)
        assert (got != want).float().mean().item() <= 0.02


@needs_kernel
def test_native_rms_norm_two_weights_by_row_and_its_fallbacks():
    """q/k norms in one call: rows whose head index is past `split` take the second weight; what the
    kernel cannot take returns None (the caller keeps PyTorch)."""
    g = torch.Generator().manual_seed(3)
    nh, nkv, d = 4, 2, 64
    qk = torch.randn(2, nh + nkv, d, generator=g).to(torch.bfloat16)
    qw, kw = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16), (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16)
    got = kernels.rms_norm(qk, qw, 1e-6, kw, nh + nkv, nh)
    want = torch.cat([_torch_rms_norm(qk[:, :nh], qw, 1e-6), _torch_rms_norm(qk[:, nh:], kw, 1e-6)], 1)
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()
    assert (got != want).float().mean().item() <= 0.02
    assert kernels.rms_norm(qk[:, :, ::2], qw[::2].contiguous(), 1e-6) is None          # not contiguous
    assert kernels.rms_norm(qk, qw.to(torch.float16), 1e-6) is None                    # another 16-bit weight
    assert kernels.rms_norm(torch.randn(300, 4096).to(torch.bfloat16), torch.ones(4096), 1e-6) is None  # a prompt


@needs_kernel
def test_sixteen_bit_matrices_go_native_from_a_lower_size_than_float32():
    """PyTorch's one-row bf16 matmul is slower than the pool at every size measured (a router matrix, a
    135M model's projections), its float32 one faster below a few million weights."""
    x16, w16 = torch.randn(1, 576).to(torch.bfloat16), torch.randn(1536, 576).to(torch.bfloat16)
    assert kernels.usable(x16, w16) and kernels.usable(x16[:, :512], w16[:128, :512])
    assert not kernels.usable(x16[:, :64], w16[:64, :64])                  # 4k weights: PyTorch
    assert not kernels.usable(x16.float(), w16.float())                    # float32 below MIN_WEIGHTS
    assert kernels.usable(torch.randn(1, 2048), torch.randn(2048, 2048))
    y = kernels.linear(x16, w16)
    assert y is not None and torch.allclose(y.float(), (x16.float() @ w16.float().T), rtol=2e-2, atol=2e-2)


needs_tiles = pytest.mark.skipif(not kernels.tiles(), reason=f"no AMX tiles here: {kernels.status()}")


@needs_tiles
@pytest.mark.parametrize("n, k", [(48, 64), (1544, 2048), (40, 96), (16, 32), (33, 48)])
def test_many_row_bf16_jobs_on_the_tiles_match_a_float64_reference(n, k):
    """Experts of more than 16 rows in one `linear_stacked` job run on the AMX tiles (where k is a multiple
    of 32; the rest, and the rows past the last block of 16, on the vector path): each output within one
    bf16 rounding of the exact product, nearly all of them the exact product rounded once, whatever the
    token count (blocks of 32, a partial last one) and the thread count."""
    g = torch.Generator().manual_seed(n * k)
    stack = (torch.randn(4, n, k, generator=g) * 0.1).to(torch.bfloat16)
    counts = [17, 70, 1, 33]
    x = torch.randn(sum(counts), k, generator=g).to(torch.bfloat16)
    picks = [(0, 2), (0, 0), (0, 3), (0, 0)]
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            y = kernels.linear_stacked(x, [stack], picks, min_weights=0, counts=counts)
            assert y is not None and y.shape == (sum(counts), n)
            at = 0
            for (_, j), c in zip(picks, counts):
                ref = x[at:at + c].double() @ stack[j].double().T
                got = y[at:at + c].double()
                assert ((got - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6).all(), (t, j, c)
                exact = (got == ref.to(torch.bfloat16).double()).double().mean().item()
                assert exact > 0.98, (t, j, c, exact)
                at += c
    finally:
        torch.set_num_threads(threads)


@needs_tiles
def test_the_tiles_take_past_sixteen_rows_and_the_environment_turns_them_off(tmp_path):
    """Past 16 rows an expert job stays native only on the tiles: `max_rows_stacked` is open-ended for
    bf16 there and `max_rows_many` elsewhere; SLIPSTREAM_CPU_AMX=0 turns the tiles off (the status says
    which path runs)."""
    assert kernels.max_rows_stacked(torch.bfloat16) > 1000
    assert kernels.max_rows_stacked(torch.float16) == kernels.max_rows_stacked(torch.float32) == kernels.MAX_ROWS
    assert "AMX tiles" in kernels.status()
    env = {**os.environ, "SLIPSTREAM_CPU_AMX": "0", "SLIPSTREAM_KERNEL_CACHE": str(tmp_path)}
    code = ("import torch; from engine import kernels; print(kernels.status(wait=True)); "
            "print(kernels.max_rows_stacked(torch.bfloat16)); x = torch.ones(40, 64).to(torch.bfloat16); "
            "w = torch.ones(2, 32, 64).to(torch.bfloat16); "
            "print(kernels.linear_stacked(x, [w], [(0, 0), (0, 1)], min_weights=0, counts=[20, 20]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=300).stdout.splitlines()
    assert "AMX" not in out[0] and out[0].startswith("native")
    assert out[1] == str(kernels.MAX_ROWS) and out[2] == "None"


@needs_kernel
@pytest.mark.parametrize("k", [4096, 4100, 14336])
def test_prefetch_distances_change_no_bits(k):
    """The native matmuls prefetch a long row's reads ahead (`kernels.set_prefetch`, elements; 0: off):
    every distance, one running past the rows' ends included, gives the same bits for bf16, float32 and a
    transfer-coded bf16 matrix; the distance set is the one in use."""
    from engine.sharding import transfer_code as tc

    g = torch.Generator().manual_seed(k)
    n = 37
    w16 = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    w32 = torch.randn(n, k, generator=g)
    coded = None
    if kernels.coded_ready():
        raw = w16.view(-1).view(torch.uint8)
        layout = tc.plan(raw, chunk_words=8 * k, segments=[(0, n * k, k)])
        buf = tc.encode_into(raw, layout, torch.empty(tc.coded_size(*layout[1:]), dtype=torch.uint8))
        coded = tc.CpuMatrix(buf, 0, n, k)
    kernels.status(wait=True)
    before = kernels.prefetch()
    try:
        outs = []
        for pf in (0, 64, 512, 1 << 20):
            assert kernels.set_prefetch(pf) == pf and kernels.prefetch() == pf
            got = []
            for m in (1, 4):
                x16, x32 = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16), \
                    torch.randn(m, k, generator=torch.Generator().manual_seed(m + 9))
                got += [kernels.linear(x16, w16, min_weights=0, rows=m), kernels.linear(x32, w32, min_weights=0, rows=m)]
                if coded is not None:
                    got.append(kernels.linear_coded(x16, coded, n, k))
            assert all(y is not None for y in got)
            outs.append(got)
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    finally:
        kernels.set_prefetch(before)
    assert kernels.prefetch() == before == 512


@needs_kernel
def test_the_environment_sets_the_prefetch_distance_and_a_bad_value_is_named_and_ignored(tmp_path):
    """SLIPSTREAM_KERNEL_PREFETCH sets the distance when the library loads; a value that is no count of
    elements is named in a warning and the default kept."""
    code = ("import logging; logging.basicConfig(); from engine import kernels; "
            "kernels.status(wait=True); print('distance', kernels.prefetch())")
    for value, want in (("0", "distance 0"), ("2048", "distance 2048"), ("lots", "distance 512")):
        env = {**os.environ, "SLIPSTREAM_KERNEL_PREFETCH": value}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                           check=False)
        assert r.returncode == 0, r.stderr
        assert want in r.stdout
        assert ("SLIPSTREAM_KERNEL_PREFETCH='lots'" in r.stderr) == (value == "lots")
