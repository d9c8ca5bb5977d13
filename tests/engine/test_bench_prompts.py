"""The GPU suite's prompts exercise a mixture-of-experts model as text would: its prefill touches every
expert (a prompt of one repeated byte sends nearly every token to a few experts, which made the suite's
MoE prefill rows read above their physical bound, sessions 4-7)."""

from __future__ import annotations

from collections import Counter

from engine.bench.scenarios import DRY_SCENARIOS
from engine.bench.slipstream_runs import _prompt, open_engine
from engine.models import moe


def _experts_of_first_layer(eng, prompt: str, monkeypatch) -> Counter:
    seen: list[list[int]] = []
    real = moe.route

    def spy(cfg, logits, dtype=None):
        w, i = real(cfg, logits, dtype)
        seen.append(i.reshape(-1).tolist())
        return w, i

    monkeypatch.setattr(moe, "route", spy)
    list(eng.generate(prompt, max_new_tokens=1))
    monkeypatch.setattr(moe, "route", real)
    return Counter(seen[0])


def test_suite_prompts_spread_a_moe_prefill_over_every_expert(monkeypatch):
    eng = open_engine(DRY_SCENARIOS["tiny-moe"], 64 << 20, "sim", 2048)
    try:
        spread = _experts_of_first_layer(eng, _prompt(512, 0), monkeypatch)
        repeated = _experts_of_first_layer(eng, "A" + "x" * 511, monkeypatch)
    finally:
        eng.close()
    assert len(spread) == eng.config.num_experts
    assert max(spread.values()) < 0.4 * sum(spread.values())
    assert len(repeated) < len(spread) or max(repeated.values()) > 0.4 * sum(repeated.values())
    assert _prompt(64, 1) != _prompt(64, 2) and len(set(_prompt(64, 1))) > 20


def test_suite_prefills_share_no_cached_prefix_across_lengths_or_budgets():
    """Each measured prefill is a fresh prompt: the 512-token prompt is not the 4096-token one's prefix, and
    one budget's prompts are not the next budget's (session 8's first call read the MoE shape's prefill at
    8 GiB 2.2x above its physical bound, the prefix cache serving what the previous budget had run)."""
    from engine.bench.slipstream_runs import measure_budget
    from engine.bench.vram_poll import VramPoller

    eng = open_engine(DRY_SCENARIOS["tiny-moe"], 64 << 20, "sim", 8192)
    poll = VramPoller(nvml=False)
    try:
        rows = [measure_budget(eng, b, 1, poll) for b in (64 << 20, 96 << 20)]
        # the same prompt again is served from the cache: the hit count is a real measurement
        before = eng.stats()["prefix_hit_tokens"]
        list(eng.generate(_prompt(512, 0, f"b{96 << 20}"), max_new_tokens=1))
        again = eng.stats()["prefix_hit_tokens"] - before
    finally:
        eng.close()
    assert [r["prefill_prefix_hit_tokens"] for r in rows] == [0, 0]
    assert again >= 256
    for r in rows:          # the batched rows: the decode figure (after every prompt) and the wall-time one
        for b in (4, 16):
            assert r[f"decode_batch{b}_tps"] > 0 and r[f"decode_batch{b}_wall_tps"] > 0
        # each decode run's token times beside its tokens/s (the median run is the row's figure)
        assert [d["tps"] for d in r["decode_runs_detail"]] == r["decode_tps_runs"]
        assert all(0 < d["median_ms"] <= d["max_ms"] for d in r["decode_runs_detail"])
    assert not _prompt(4096, 0, "a").startswith(_prompt(512, 0, "a"))
    assert _prompt(512, 0, "a") != _prompt(512, 0, "b")
