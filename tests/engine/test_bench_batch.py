"""The batched rows' decode figure: the streams' tokens after every stream has its first one, over the
time to the last token (what llama-batched-bench's decode figure counts), beside the wall-time figure."""

from __future__ import annotations

from types import SimpleNamespace

from engine.bench.batch_throughput import decode_aggregate, open_engine, run_streams


def _req(times):
    return SimpleNamespace(token_times=list(times), t_first=times[0], t_last=times[-1])


def test_decode_aggregate_counts_from_the_last_first_token():
    a = _req([1.0, 1.5, 2.5, 3.0])          # its first token early: 1.5 is before the window
    b = _req([2.0, 3.0, 4.0])               # the last stream's first token opens the window at 2.0
    assert decode_aggregate([a, b]) == 4 / 2.0
    assert decode_aggregate([_req([1.0]), _req([2.0])]) is None      # nothing after the window opens


def test_run_streams_records_both_figures():
    eng = open_engine("tiny", "sim", 64 << 20, 96, 4 * 96)
    try:
        r = run_streams(eng, 4, 16, 6, seed=1)
        assert r["generated_tokens"] == 24
        assert r["decode_aggregate_tokens_per_s"] > 0 and r["aggregate_tokens_per_s"] > 0
        handles = [eng.submit(p, max_new_tokens=5) for p in ("one two", "three four five")]
        for h in handles:
            h.result()
            times = h.request.token_times
            assert len(times) == h.request.generated == 5 and times == sorted(times)
            assert (times[0], times[-1]) == (h.request.t_first, h.request.t_last)
    finally:
        eng.close()
