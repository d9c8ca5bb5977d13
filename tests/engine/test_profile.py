"""The profile database: synthetic sim profile, queries, the file, fingerprints, and a tiny real measure."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, replace

import pytest
import torch

from engine.sharding import measure, profile_store
from engine.sharding import profile as profile_mod
from engine.sharding.profile import ProfileDatabase, sim_profile_dict


def test_sim_profile_is_synthetic_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_DATA_DIR", str(tmp_path))
    a = ProfileDatabase.for_device("sim")
    assert a.to_dict() == sim_profile_dict() == ProfileDatabase.sim().to_dict()
    assert a.has_gpu and a.link["h2d_gbps"] == 25.0
    assert a.gemm_gflops("gpu", "bfloat16", "ffn", 4096) == pytest.approx(20000.0)
    assert a.gemm_gflops("gpu", "bfloat16", "ffn", 1) == pytest.approx(400.0)   # 400 GB/s of bf16 weights
    assert not list(tmp_path.iterdir())                                             # nothing written


def test_tables_interpolate_and_never_get_cheaper_with_more_tokens():
    data = sim_profile_dict()
    data["cpu"]["gemm"]["bfloat16"]["ffn"] = [[1, 10.0], [16, 500.0], [64, 100.0], [256, 2000.0]]
    prof = ProfileDatabase(data)
    assert prof.gemm_gflops("cpu", "bfloat16", "ffn", 1) == pytest.approx(10.0)
    times = [prof.gemm_ms("cpu", "bfloat16", "ffn", 1e9, n) for n in range(1, 600)]
    assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(times))
    flat = prof.gemm_gflops("cpu", "bfloat16", "ffn", 256)
    assert prof.gemm_gflops("cpu", "bfloat16", "ffn", 10**6) == flat


def test_missing_dtype_falls_back():
    data = sim_profile_dict()
    del data["gpu"]["gemm"]["float16"]
    prof = ProfileDatabase(data)
    assert prof.gemm_gflops("gpu", "float16", "attn", 16) == prof.gemm_gflops("gpu", "bfloat16", "attn", 16)


def _fake_profile(device: str) -> dict:
    data = sim_profile_dict()
    data.update(device=device, quick=True, created="test", gpu=None, link=None)
    return data


@pytest.fixture
def fake_measure(monkeypatch):
    calls = []

    def fake(device, quick=True, progress=None):
        calls.append((device, quick))
        data = _fake_profile(device)
        data["quick"] = quick
        return data

    monkeypatch.setattr(profile_mod, "measure_profile", fake)
    return calls


def test_cached_until_the_fingerprint_changes(tmp_path, monkeypatch, fake_measure):
    db = tmp_path / "profile.json"
    fp = {"schema": 1, "device": "cpu", "cpu": "A", "torch": "2.13"}
    monkeypatch.setattr(profile_store, "fingerprint", lambda device: dict(fp))
    ProfileDatabase.for_device("cpu", path=db)
    ProfileDatabase.for_device("cpu", path=db)
    assert len(fake_measure) == 1                       # second call: from the file
    fp["torch"] = "2.14"                                 # an upgrade: the old profile no longer applies
    ProfileDatabase.for_device("cpu", path=db)
    assert len(fake_measure) == 2
    ProfileDatabase.for_device("cpu", path=db, remeasure=True)
    assert len(fake_measure) == 3
    ProfileDatabase.for_device("cpu", path=db, quick=False)   # a quick entry does not satisfy a full request
    assert fake_measure[-1] == ("cpu", False)
    ProfileDatabase.for_device("cpu", path=db, quick=True)    # a full entry satisfies a quick one
    assert len(fake_measure) == 4


def test_file_round_trips_and_stays_small(tmp_path):
    db = tmp_path / "sub" / "profile.json"
    entries = {}
    for i in range(profile_store.MAX_ENTRIES + 5):
        data = _fake_profile("cpu")
        data["fingerprint"] = {"n": i}
        key = profile_store.fingerprint_key(data["fingerprint"])
        profile_store.save_profile(db, key, data)
        entries[key] = data
    loaded = profile_store.load_db(db)["profiles"]
    assert len(loaded) == profile_store.MAX_ENTRIES
    newest = profile_store.fingerprint_key({"n": profile_store.MAX_ENTRIES + 4})
    assert loaded[newest] == entries[newest]
    assert ProfileDatabase(loaded[newest]).to_dict() == entries[newest]
    assert db.stat().st_size < 1 << 20
    assert not [p for p in db.parent.iterdir() if ".tmp" in p.name]


def test_corrupt_file_is_moved_aside_and_remeasured(tmp_path, monkeypatch, fake_measure):
    db = tmp_path / "profile.json"
    db.write_text("{not json")
    monkeypatch.setattr(profile_store, "fingerprint", lambda device: {"device": device})
    ProfileDatabase.for_device("cpu", path=db)
    assert len(fake_measure) == 1
    assert (tmp_path / "profile.json.corrupt").read_text() == "{not json"
    assert json.loads(db.read_text())["schema"] == profile_store.SCHEMA


def test_real_fingerprint_on_this_machine():
    fp = profile_store.fingerprint("cpu")
    assert fp["device"] == "cpu" and fp["cpu_threads"] and fp["torch"]
    assert profile_store.fingerprint_key(fp) == profile_store.fingerprint_key(dict(fp))


def test_tiny_measure(tmp_path, monkeypatch):
    tiny = measure.Sizes(hidden=64, ffn=128, vocab=256, heads=2, head_dim=16, ctx=64, tokens=(1, 4, 16),
                         min_time_s=0.001, rotate_bytes=256 * 1024)
    monkeypatch.setattr(measure, "CPU_QUICK", tiny)
    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda: 32 * 1024)   # tiny sizes, a tiny cache
    seen = []
    data = profile_mod.measure_profile("cpu", quick=True, progress=lambda f, m: seen.append(f))
    assert data["gpu"] is None and data["link"] is None
    assert set(data["cpu"]["gemm"]) == set(measure.DTYPES)
    assert all(len(rows) == 3 for cls in data["cpu"]["gemm"].values() for rows in cls.values())
    assert data["cpu"]["threads_gbps"] and data["cpu"]["op_overhead_us"] > 0
    assert set(data["cpu"]["block_factor"]) == {"1", "16"}
    assert set(data["cpu"]["attn_block_factor"]) == {"1", "16"}
    idle = data["cpu"]["ffn_block_idle"]
    assert idle["hot_ms"] > 0 and idle["after_idle_ms"] > 0 and idle["block_bytes"] == 3 * 64 * 128 * 2
    assert seen == sorted(seen) and seen[-1] == 1.0
    prof = ProfileDatabase(data)
    assert prof.gemm_ms("cpu", "bfloat16", "ffn", 1e6, 8) > 0
    assert "cpu" in "\n".join(prof.describe())
    db = tmp_path / "p.json"
    profile_store.save_profile(db, "k", data)
    assert profile_store.load_db(db)["profiles"]["k"] == data


def test_data_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SLIPSTREAM_PROFILE_DB", raising=False)
    assert profile_store.db_path() == tmp_path / "profile.json"


def test_sim_with_a_measured_cpu():
    data = _fake_profile("cpu")
    data["cpu"] = dict(data["cpu"], name="measured")
    prof = ProfileDatabase.sim(cpu=ProfileDatabase(data))
    assert prof.cpu["name"] == "measured" and prof.gpu == sim_profile_dict()["gpu"]


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    import torch

    from engine.errors import BadInputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BadInputError, match="no CUDA GPU"):
        ProfileDatabase.for_device("cuda")
    with pytest.raises(BadInputError, match="device="):
        ProfileDatabase.for_device("tpu")


def test_block_factor_scales_the_cpu_tables():
    base = ProfileDatabase(sim_profile_dict())
    data = sim_profile_dict()
    data["cpu"]["block_factor"] = {"1": 2.0, "256": 1.0}
    prof = ProfileDatabase(data)
    def ms(p, n):
        return p.gemm_ms("cpu", "bfloat16", "ffn", 1e9, n)

    assert ms(prof, 1) == pytest.approx(2 * ms(base, 1))
    assert ms(prof, 1024) == pytest.approx(ms(base, 1024))
    times = [prof.gemm_ms("cpu", "bfloat16", "ffn", 1e9, n) for n in range(1, 300)]
    assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(times))
    assert prof.gemm_ms("gpu", "bfloat16", "ffn", 1e9, 1) == base.gemm_ms("gpu", "bfloat16", "ffn", 1e9, 1)


def test_cpu_rate_beside_copies_is_priced_against_the_block_rate():
    """A profile with the FFN block measured beside copies prices CPU work beside copies at that absolute
    rate over the one-token FFN rate the tables give; older profiles keep their GEMV ratio."""
    data = sim_profile_dict()
    old = ProfileDatabase(data)
    assert old.cpu_with_copy_factor == data["link"]["cpu_with_copy_factor"]
    priced = old.gemm_gflops("cpu", "bfloat16", "ffn", 1)
    data = sim_profile_dict()
    data["link"]["cpu_block_with_copy_gbps"] = priced / 4
    assert ProfileDatabase(data).cpu_with_copy_factor == pytest.approx(0.25)
    data["link"]["cpu_block_with_copy_gbps"] = priced * 3          # never above 1
    assert ProfileDatabase(data).cpu_with_copy_factor == 1.0


def test_cpu_wake_up_is_charged_at_every_gpu_to_cpu_crossing():
    from engine.config import ModelConfig
    from engine.sharding.estimator import step_costs
    from engine.sharding.spec import ModelSpec

    cfg = ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    spec = ModelSpec.from_config(cfg)
    base = ProfileDatabase(sim_profile_dict())
    assert base.cpu_wake_ms == 0.0
    data = sim_profile_dict()
    data["cpu"]["ffn_block_idle"] = {"hot_ms": 1.0, "after_idle_ms": 1.75, "idle_s": 0.002, "block_bytes": 1}
    woken = ProfileDatabase(data)
    assert woken.cpu_wake_ms == pytest.approx(0.75)
    a, b = step_costs(spec, base, 1, 64), step_costs(spec, woken, 1, 64)
    assert b.to_cpu_ms == pytest.approx(a.to_cpu_ms + 0.75)
    assert (b.cpu_ms == a.cpu_ms).all() and (b.to_gpu_ms == a.to_gpu_ms).all()


def test_last_level_cache_read_from_sysfs(tmp_path):
    from engine.sharding.measure import last_level_cache_bytes

    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "300M"), ("index9", "junk")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(str(tmp_path)) == 300 << 20
    assert last_level_cache_bytes(str(tmp_path / "missing")) is None


def test_rotations_span_four_last_level_caches():
    """A rotation no larger than the cache reads back partly from it (the H200 host's 300 MiB L3 made a
    352 MB FFN block look 1.5x faster than decode ever sees it)."""
    from engine.sharding.measure import CPU_FULL, CPU_QUICK, beyond_caches

    assert beyond_caches(CPU_FULL, 300 << 20).rotate_bytes == 1200 << 20
    assert beyond_caches(CPU_FULL, 32 << 20).rotate_bytes == CPU_FULL.rotate_bytes     # already beyond
    assert beyond_caches(CPU_QUICK, 32 << 20).rotate_bytes == 128 << 20
    assert beyond_caches(CPU_QUICK, 0) == CPU_QUICK


TINY = measure.Sizes(hidden=64, ffn=128, vocab=256, heads=4, head_dim=16, ctx=64, tokens=(1, 4, 16),
                     min_time_s=0.001, rotate_bytes=256 * 1024, kv_heads=2)


def _slow_cpu_section() -> dict:
    """The sim CPU section with an "attn" table slow enough that TINY's projections take ~2.5 ms."""
    sec = sim_profile_dict()["cpu"]
    sec["gemm"]["bfloat16"]["attn"] = [[1, 0.01], [16, 0.16], [256, 2.56]]
    sec["block_factor"] = {"1": 1.5, "16": 1.5}          # the FFN factor: not used by the attention solve
    return sec


def test_attention_block_measured_on_a_tiny_shape():
    """The engine's own attention block (fused qkv, paged KV gather) runs and gives sane, clamped factors."""
    out = measure.attn_block_factors(TINY, sim_profile_dict()["cpu"], ctx=32)
    assert set(out["factor"]) == {"1", "16"} and all(measure.ATTN_FACTOR_FLOOR <= f <= 3.0 for f in out["factor"].values())
    d = out["detail"]
    assert d["ctx"] == 32 and d["kv_heads"] == 2
    assert all(d["measured_ms"][n] > 0 and d["predicted_ms"][n] > 0 for n in ("1", "16"))
    # kv heads that do not divide the query heads (a default of 8 on a 4-head shape) fall back to a divisor
    cfg, run, nbytes, *_ = measure._attention_blocks(replace(TINY, kv_heads=8), ctx=32)
    assert cfg.num_kv_heads == 4 and nbytes == 2 * (64 + 4 * 64 * 64) and cfg.num_layers == 256 * 1024 // nbytes
    assert run(3, torch.randn(16, 64, dtype=torch.bfloat16)).shape == (16, 64)


def test_attention_factor_makes_the_estimator_match_the_block(monkeypatch):
    """The stored factor is the CPU "attn" table's scale at which the estimator's attention sub-layer
    takes the measured time (a faked 4 ms), at one and at 16 new tokens over the measured context."""
    from engine.config import ModelConfig
    from engine.sharding.estimator import step_costs
    from engine.sharding.spec import ModelSpec

    monkeypatch.setattr(measure, "time_host", lambda fn, t, min_reps=3: (fn(0), fn(1), 0.004)[-1])
    sec = _slow_cpu_section()
    out = measure.attn_block_factors(TINY, sec, ctx=32)
    assert 1.2 < out["factor"]["1"] < 2.0            # (4 ms - ~0.06 ms) / ~2.46 ms
    assert out["detail"]["measured_ms"] == {"1": 4.0, "16": 4.0}
    data = sim_profile_dict()
    data["cpu"] = dict(sec, attn_block_factor=out["factor"])
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    spec = ModelSpec.from_config(cfg)
    attn = [s.kind for s in spec.sublayers].index("attn")
    for n in (1, 16):
        assert step_costs(spec, ProfileDatabase(data), n, 32 + n).cpu_ms[attn] == pytest.approx(4.0, rel=1e-3)
    monkeypatch.setattr(measure, "time_host", lambda fn, t, min_reps=3: 1.0)     # a second: clamped
    assert measure.attn_block_factors(TINY, sec, ctx=32)["factor"] == {"1": 3.0, "16": 3.0}


def test_the_one_token_attention_block_is_measured_as_the_executor_runs_it(monkeypatch):
    """A one-token step of the measured block takes the executor's one native call where it applies (the
    tensor path's bits), a 16-token one the tensor path; `native=False` (or SLIPSTREAM_CPU_ATTENTION_CALL=0,
    the executor's switch) measures the tensor path. Before session 17 the one-token block always took the
    tensor path, about twice the call's time on the H200 host."""
    from engine import kernels

    sizes = replace(TINY, hidden=256, head_dim=64, kv_heads=2)     # (TINY's 64 wide: too small for the call)
    if not kernels.attention_ready():
        pytest.skip("no native attention kernel here: the block takes the tensor path either way")
    calls = []
    real = kernels.attention_decode

    def counted(*a, **k):
        y = real(*a, **k)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(kernels, "attention_decode", counted)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    torch.manual_seed(5)                                  # (the blocks' random weights and cache: the same twice)
    native = measure._attention_blocks(sizes, ctx=32).run(0, x)
    assert calls == [True] and native.shape == (1, 256)
    n_native = len(calls)
    torch.manual_seed(5)
    tensor = measure._attention_blocks(sizes, ctx=32, native=False).run(0, x)
    assert len(calls) == n_native and torch.equal(native, tensor)
    measure._attention_blocks(sizes, ctx=32).run(0, torch.randn(16, 256, dtype=torch.bfloat16))
    assert len(calls) == n_native
    monkeypatch.setenv("SLIPSTREAM_CPU_ATTENTION_CALL", "0")
    measure._attention_blocks(sizes, ctx=32).run(0, x)
    assert len(calls) == n_native


def test_attention_factor_replaces_the_ffn_factor_for_the_attn_table_only():
    data = sim_profile_dict()
    data["cpu"]["block_factor"] = {"1": 1.5, "1024": 1.2}
    ffn_only = ProfileDatabase(data)
    data = sim_profile_dict()
    data["cpu"]["block_factor"] = {"1": 1.5, "1024": 1.2}
    data["cpu"]["attn_block_factor"] = {"1": 2.0, "16": 3.0}
    both = ProfileDatabase(data)
    raw = ProfileDatabase(sim_profile_dict())

    def rate(p, cls, n, where="cpu"):
        return p.gemm_gflops(where, "bfloat16", cls, n)

    for n in (1, 4, 16, 64, 256, 1024, 4096):
        assert rate(both, "ffn", n) == rate(ffn_only, "ffn", n)           # FFN and head: the FFN factor
        assert rate(both, "head", n) == rate(ffn_only, "head", n)
        assert rate(ffn_only, "attn", n) == rate(ffn_only, "ffn", n)      # without the key: as before
        assert rate(both, "attn", n, "gpu") == rate(raw, "attn", n, "gpu")
    assert rate(both, "attn", 1) == pytest.approx(rate(raw, "attn", 1) / 2.0)
    assert rate(both, "attn", 16) == pytest.approx(rate(raw, "attn", 16) / 3.0)
    # past the measured token counts the curve joins the FFN factor's points (1.2 at 1024 tokens)
    assert rate(both, "attn", 64) == pytest.approx(rate(raw, "attn", 64) / 2.4)     # log-linear 3 -> 1.2
    assert rate(both, "attn", 1024) == pytest.approx(rate(raw, "attn", 1024) / 1.2)
    assert rate(both, "attn", 4096) == rate(ffn_only, "attn", 4096)
    assert "attention projections' table scaled by x1 tokens 2.00" in "\n".join(both.describe())


def _profile_db(path, entries: dict) -> None:
    path.write_text(json.dumps({"schema": profile_store.SCHEMA, "profiles": entries}, indent=1))


def test_update_cli_adds_the_attention_factor_to_a_stored_profile(tmp_path):
    """`python -m engine.sharding.measure --attn-block --update PATH` measures with the stored shapes (a
    profile from before kv_heads existed loads with the default) and writes the factor into that entry in
    place; the other entries, their order and the rest of the entry stay as they were."""
    old_shapes = {k: v for k, v in asdict(replace(TINY, heads=8)).items() if k != "kv_heads"}
    first = sim_profile_dict()
    first["cpu"] = dict(first["cpu"], shapes=json.loads(json.dumps(old_shapes)), threads=1)
    second = sim_profile_dict()
    second["created"] = "older"
    path = tmp_path / "copy.json"
    _profile_db(path, {"new": first, "old": second})
    before = json.loads(path.read_text())
    assert measure.main(["--attn-block", "--update", str(path)]) == 0
    after = json.loads(path.read_text())
    assert list(after["profiles"]) == ["new", "old"] and after["profiles"]["old"] == before["profiles"]["old"]
    cpu = after["profiles"]["new"]["cpu"]
    assert set(cpu["attn_block_factor"]) == {"1", "16"} and cpu["attn_block"]["kv_heads"] == 8
    assert {k: v for k, v in cpu.items() if not k.startswith("attn_block")} == before["profiles"]["new"]["cpu"]
    assert {k: v for k, v in after["profiles"]["new"].items() if k != "cpu"} == \
        {k: v for k, v in before["profiles"]["new"].items() if k != "cpu"}
    ProfileDatabase(after["profiles"]["new"])
    # --key picks another entry, which keeps its place
    second_cpu = dict(second["cpu"], shapes=json.loads(json.dumps(old_shapes)))
    _profile_db(path, {"new": after["profiles"]["new"], "old": dict(second, cpu=second_cpu)})
    measure.main(["--attn-block", "--update", str(path), "--key", "old"])
    again = json.loads(path.read_text())
    assert list(again["profiles"]) == ["new", "old"] and "attn_block_factor" in again["profiles"]["old"]["cpu"]
    assert again["profiles"]["new"] == after["profiles"]["new"]
    with pytest.raises(SystemExit):
        measure.main(["--update", str(path)])              # the measurement must be named


def test_the_expert_job_table_covers_the_rows_the_kernel_takes(monkeypatch):
    """The CPU section's expert-job table (`measure.experts_table`) has a rate per rows-per-expert count
    for each dtype the native kernel runs, while the busiest expert of a Poisson draw about it stays within
    16 rows, and past them only for bf16 on AMX tiles."""
    from engine import kernels
    from engine.sharding import measure

    sizes = measure.Sizes(64, 128, 256, 2, 32, 64, (1,), 0.01, 4 << 20, dtypes=("bfloat16", "float32"))
    table = measure.experts_table(sizes, measure._Steps(2, None), shape=(64, 96))
    if kernels._load() is None:
        assert table == {}
        return
    assert set(table) == {"bfloat16", "float32"}
    for dtype, rows in table.items():
        counts = [r for r, _ in rows]
        assert counts == sorted(counts) and all(g > 0 for _, g in rows)
        top = 256 if dtype == "bfloat16" and kernels.tiles() else 4     # (Poisson about 16 passes 16)
        assert counts[-1] == top, (dtype, counts)
    monkeypatch.setattr(kernels, "_amx_tiles", False)
    assert [r for r, _ in measure.experts_table(sizes, measure._Steps(2, None), shape=(64, 96))["bfloat16"]][-1] == 4
