"""N-gram speculative decoding: greedy output identical to plain decoding, proposals really verified."""

from __future__ import annotations

import pytest

import engine
from engine.speculative import NgramIndex, accepted_prefix


def test_ngram_index_proposes_what_followed_the_latest_match():
    idx = NgramIndex(max_n=3)
    idx.extend([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert idx.propose(2) == [4, 5]
    idx.extend([7])
    assert idx.propose(3) == []            # "3 7" and "7" never appeared before
    idx.extend([1, 2])
    assert idx.propose(4) == [3, 7, 1, 2]  # the latest earlier "1 2" is followed by 3 7 1 2


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_prefix([4], [3, 1]) == 0
    assert accepted_prefix([], [3]) == 0


@pytest.mark.parametrize("device,arch", [("cpu", "llama"), ("sim", "qwen3"), ("sim", "llama3")])
def test_greedy_output_identical_with_speculation(tiny_model, device, arch):
    path = tiny_model(arch)
    prompt = "one two three four one two three four one two three"
    plain = engine.open_model(path, device=device, backend="torch", speculative=False)
    want = [e.token_id for e in plain.generate(prompt, max_new_tokens=60)]
    spec = engine.open_model(path, device=device, backend="torch", speculative=True,
                             vram_budget=None if device == "cpu" else "2MiB")
    got = [e.token_id for e in spec.generate(prompt, max_new_tokens=60)]
    assert got == want
    stats = spec.stats()
    assert stats["spec_proposed"] > 0
    assert 0 <= stats["spec_accepted"] <= stats["spec_proposed"]
    # A second turn reuses the cached prefix and still matches.
    assert [e.token_id for e in spec.generate(prompt + " four", max_new_tokens=20)] == \
        [e.token_id for e in plain.generate(prompt + " four", max_new_tokens=20)]


def test_repetitive_output_is_accepted(tiny_model):
    """Tiny random models fall into loops: the loop's tokens are proposed and accepted."""
    eng = engine.open_model(tiny_model("qwen2"), device="cpu", backend="torch", speculative=True)
    out = [e.token_id for e in eng.generate("a b c", max_new_tokens=80)]
    assert len(out) > 40
    assert eng.stats()["spec_accepted"] > 0


def test_default_speculates_where_measured_to_pay(tiny_model):
    """speculative=None: the engine times plain and verify steps and proposes while verify steps yield
    more tokens per millisecond; output stays identical to plain greedy decoding."""
    path = tiny_model("qwen2")
    plain = engine.open_model(path, device="cpu", backend="torch", speculative=False)
    want = [e.token_id for e in plain.generate("a b c", max_new_tokens=80)]
    auto = engine.open_model(path, device="cpu", backend="torch")
    got = [e.token_id for e in auto.generate("a b c", max_new_tokens=80)]
    assert got == want
    s = auto.stats()
    assert s["spec_plain_ms"] is not None and s["spec_verify_ms"] is not None
    assert s["spec_tokens_per_verify"] >= 1.0
    # The decision follows the measurements: make verify steps look ten times dearer than what they
    # yield and the engine stops proposing (but for its periodic probe).
    auto._spec_timing.update(plain=1.0, verify=100.0, gain=1.5)
    assert not auto._propose_now(1) and auto._propose_now(16)
    auto._spec_timing.update(plain=10.0, verify=11.0, gain=3.0)
    assert auto._propose_now(1)
