"""Sampling draws tokens with the probabilities the logits give, and top-p keeps exactly the nucleus a
full sort would: the fast paths (a top-k search for the nucleus, an inverse-CDF draw) change the cost, not
the distribution."""

from __future__ import annotations

import torch

from engine.generation import NUCLEUS_FIRST, Sampler, SamplingParams, draw, nucleus


def _nucleus_by_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, idx = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
    keep[0] = True
    return torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])


def test_nucleus_matches_a_full_sort_inside_and_beyond_the_first_candidates():
    g = torch.Generator().manual_seed(0)
    for scale, top_p in ((8.0, 0.9), (3.0, 0.95), (0.1, 0.95), (0.0, 0.5), (5.0, 0.999)):
        probs = torch.softmax(torch.randn(5000, generator=g) * scale, 0)
        got, want = nucleus(probs, top_p), _nucleus_by_sort(probs, top_p)
        assert torch.equal(got.sort().values, want.sort().values), (scale, top_p)
        if scale > 0:                               # no ties: the very same tokens
            assert torch.equal(got > 0, want > 0)
        assert torch.equal(got[got > 0], probs[got > 0])
    flat = torch.full((5000,), 1 / 5000)            # the nucleus is far beyond the first candidates
    assert int((nucleus(flat, 0.9) > 0).sum()) > 8 * NUCLEUS_FIRST


def test_draw_follows_the_probabilities_and_never_draws_a_zero():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0]) * 7      # any total
    n = 20000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=6).float() / n
    assert counts[0] == counts[2] == counts[5] == 0
    assert torch.allclose(counts, probs / probs.sum(), atol=0.015)


def test_sampler_with_top_p_draws_only_from_the_nucleus_and_repeats_with_a_seed():
    logits = torch.tensor([4.0, 3.5, 1.0, 0.0, -1.0, -2.0] + [-6.0] * 200)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    allowed = set(torch.nonzero(_nucleus_by_sort(torch.softmax(logits, 0), 0.9)).flatten().tolist())
    a = Sampler(params)
    drawn = [a(logits) for _ in range(400)]
    assert set(drawn) == allowed
    b = Sampler(params)
    assert [b(logits) for _ in range(400)] == drawn


def test_a_wide_nucleus_over_a_large_vocabulary_matches_a_full_sort():
    """Past the first candidates the nucleus's edge is found by log-probability bins: the tokens a sort over
    a 150k vocabulary keeps, for flat and peaked distributions (5 ms per token on a 2-core host against 20
    for the sort), and all of them when the top tokens hold all the mass there is."""
    g = torch.Generator().manual_seed(7)
    for scale, top_p in ((1.0, 0.95), (2.5, 0.9), (0.3, 0.5), (4.0, 0.999)):
        probs = torch.softmax(torch.randn(151936, generator=g) * scale, 0)
        got, want = nucleus(probs, top_p), _nucleus_by_sort(probs, top_p)
        assert (got > 0).sum() > NUCLEUS_FIRST, scale
        # the same tokens, but for the one at the edge where the sort's float32 running sum and the bins'
        # float64 sums round apart (scale 4: 7.8e-8 of mass)
        assert int(((got > 0) ^ (want > 0)).sum()) <= 1, (scale, top_p)
        assert abs(float(got.double().sum() - want.double().sum())) < 1e-6
        assert torch.equal(got[got > 0], probs[got > 0])
    few = torch.zeros(1000)
    few[:10] = torch.softmax(torch.randn(10, generator=g), 0)
    assert torch.equal(nucleus(few, 1.0 - 1e-9) > 0, few > 0)
    assert torch.equal(nucleus(few * 0.5, 0.9) > 0, few > 0)      # (a mass below top_p: all of it)
