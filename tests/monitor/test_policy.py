"""The budget policy as a pure state machine: the formula, fast down, slow up, modes, user changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.budget import BudgetPolicy

GiB, MiB = 1 << 30, 1 << 20
TOTAL = 16 * GiB


def feed(policy: BudgetPolicy, others: list[int], dt: float = 0.1, gaming: list[bool] | None = None):
    """Run samples; returns (budgets, events) with one budget per sample."""
    budgets, events = [], []
    for i, o in enumerate(others):
        ev = policy.update(i * dt, TOTAL, o, gaming=bool(gaming and gaming[i]), gaming_reason="game.exe",
                           cause=f"sample {i}")
        budgets.append(policy.budget)
        if ev:
            events.append(ev)
    return budgets, events


def test_first_sample_applies_the_formula_less_the_slack():
    p = BudgetPolicy(reserve=GiB, slack=128 * MiB)
    ev = p.update(0.0, TOTAL, 3 * GiB)
    assert ev is not None and ev.previous is None and ev.budget == TOTAL - 3 * GiB - GiB - 128 * MiB
    assert "first sample" in ev.reason and ev.mode == "auto" and not ev.paused


def test_growth_drops_the_budget_at_the_same_sample_with_the_cause():
    p = BudgetPolicy()
    p.update(0.0, TOTAL, 1 * GiB)
    ev = p.update(0.1, TOTAL, 9 * GiB, cause="game.exe grew to 9.0 GiB")
    assert ev is not None and ev.budget <= TOTAL - 9 * GiB - GiB
    assert ev.reason == "game.exe grew to 9.0 GiB"


def test_small_creep_within_the_slack_emits_nothing():
    p = BudgetPolicy(slack=128 * MiB)
    p.update(0.0, TOTAL, 4 * GiB)
    assert all(p.update(0.1 * i, TOTAL, 4 * GiB + i * MiB) is None for i in range(1, 100))


def test_rise_waits_for_the_hold_and_takes_the_lowest_room_seen():
    p = BudgetPolicy(hold_s=3.0, hysteresis=512 * MiB, slack=0)
    p.update(0.0, TOTAL, 9 * GiB)
    low = p.budget
    # The game exits: others fall to 1 GiB, with one blip at 2 GiB during the hold.
    others = [GiB] * 10 + [2 * GiB] + [GiB] * 30
    for i, o in enumerate(others, start=1):
        ev = p.update(i * 0.1, TOTAL, o, cause="game.exe exited")
        t = i * 0.1
        if t < 0.1 + 3.0 - 1e-9:
            assert ev is None and p.budget == low
        else:
            assert ev is not None and ev.budget == TOTAL - 2 * GiB - GiB   # the lowest room in the hold
            assert "game.exe exited" in ev.reason and "3 s" in ev.reason
            break
    else:
        pytest.fail("the budget never rose")


def test_a_rise_smaller_than_the_hysteresis_is_ignored():
    p = BudgetPolicy(hysteresis=512 * MiB, slack=0)
    p.update(0.0, TOTAL, 8 * GiB)
    assert all(p.update(0.1 * i, TOTAL, 8 * GiB - 400 * MiB) is None for i in range(1, 200))


def test_loading_screen_spikes_cost_one_drop_and_one_rise():
    p = BudgetPolicy(hold_s=3.0)
    spikes = ([7 * GiB] * 20 + ([10 * GiB] * 3 + [7 * GiB] * 5) * 10 + [7 * GiB] * 60)
    budgets, events = feed(p, spikes)
    assert len(events) == 3                         # first sample, the first spike, back after the spikes
    assert events[1].budget < events[0].budget == events[2].budget   # dropped, then back where it was
    assert budgets.index(events[1].budget) == 20    # at the first spike's own sample
    last_spike = max(i for i, o in enumerate(spikes) if o == 10 * GiB)
    assert events[2].time >= last_spike * 0.1 + 3.0 - 1e-9


def test_never_negative_even_when_others_exceed_the_card():
    p = BudgetPolicy()
    budgets, _ = feed(p, [20 * GiB, 16 * GiB, 15.5 * GiB, 0])
    assert all(b is not None and b >= 0 for b in budgets)


def test_user_cap_bounds_auto_and_applies_at_the_next_sample_without_a_hold():
    p = BudgetPolicy(user_cap=4 * GiB)
    p.update(0.0, TOTAL, GiB)
    assert p.budget == 4 * GiB
    p.set_user_cap(6 * GiB)
    ev = p.update(0.1, TOTAL, GiB)
    assert ev is not None and ev.budget == 6 * GiB and ev.reason.startswith("user cap set to 6.0 GiB")
    p.set_user_cap(None)
    ev = p.update(0.2, TOTAL, GiB)
    assert ev is not None and ev.budget > 6 * GiB and "user cap removed" in ev.reason


def test_fixed_mode_keeps_the_cap_whatever_others_use():
    p = BudgetPolicy(mode="fixed", user_cap="6GiB")
    budgets, events = feed(p, [GiB, 12 * GiB, 14 * GiB, GiB])
    assert budgets == [6 * GiB] * 4 and len(events) == 1
    big = BudgetPolicy(mode="fixed", user_cap=100 * GiB)
    big.update(0.0, TOTAL, 0)
    assert big.budget == TOTAL - GiB            # never more than the card minus the reserve
    nocap = BudgetPolicy(mode="fixed")
    nocap.update(0.0, TOTAL, 0)
    assert nocap.budget == TOTAL - GiB


def test_pause_when_gaming_pauses_at_once_and_resumes_after_the_hold():
    p = BudgetPolicy(mode="pause_when_gaming", hold_s=3.0)
    gaming = [False] * 10 + [True] * 20 + [False] * 40
    budgets, events = feed(p, [GiB] * 70, gaming=gaming)
    assert budgets[9] > 0 and budgets[10] == 0 and all(b == 0 for b in budgets[10:30])
    paused = [e for e in events if e.paused]
    assert len(paused) == 1 and paused[0].reason == "paused while gaming: game.exe"
    resume = next(i for i in range(30, 70) if budgets[i] > 0)
    assert (resume - 30) * 0.1 >= 3.0 - 1e-9
    assert events[-1].reason.startswith("resumed") and not events[-1].paused


def test_mode_change_and_reserve_change_apply_at_the_next_sample():
    p = BudgetPolicy(reserve=GiB, slack=0)
    p.update(0.0, TOTAL, GiB)
    p.set_reserve(3 * GiB)
    ev = p.update(0.1, TOTAL, GiB)
    assert ev.budget == TOTAL - 4 * GiB and "reserve set to 3.0 GiB" in ev.reason
    p.set_reserve(512 * MiB)                         # a lower reserve: up at once, no hold
    ev = p.update(0.2, TOTAL, GiB)
    assert ev.budget == TOTAL - GiB - 512 * MiB
    p.set_mode("pause_when_gaming")
    ev = p.update(0.3, TOTAL, GiB, gaming=True, gaming_reason="x")
    assert ev.paused and ev.budget == 0 and ev.mode == "pause_when_gaming" and "mode set to" in ev.reason
    p.set_mode("auto")
    ev = p.update(0.4, TOTAL, GiB, gaming=True)
    assert not ev.paused and ev.budget > 0


def test_no_gpu_gives_none_once_and_starts_fresh_when_back():
    p = BudgetPolicy()
    p.update(0.0, TOTAL, GiB)
    ev = p.no_gpu(0.1, "no NVIDIA GPU: GPU is lost")
    assert ev.budget is None and ev.reason == "no NVIDIA GPU: GPU is lost"
    assert p.no_gpu(0.2, "no NVIDIA GPU: GPU is lost") is None
    ev = p.update(0.3, TOTAL, GiB)
    assert ev.budget is not None and ev.previous is None


def test_bad_settings_are_refused_with_the_value():
    with pytest.raises(ValueError, match="'turbo'"):
        BudgetPolicy(mode="turbo")
    with pytest.raises(ValueError, match="'lots'"):
        BudgetPolicy().set_user_cap("lots")


others_seq = st.lists(st.integers(min_value=0, max_value=20 * GiB), min_size=1, max_size=150)


@settings(max_examples=200, deadline=None)
@given(others=others_seq, dt=st.sampled_from([0.05, 0.1, 0.5]), hold=st.sampled_from([0.0, 1.0, 3.0]))
def test_properties_auto_mode(others, dt, hold):
    """Never negative; never above the room (so every drop lands within one sample); a rise only after
    the room stayed above the new budget for the whole hold; rises bounded by time / hold."""
    p = BudgetPolicy(hold_s=hold)
    rooms, rises = [], 0
    for i, o in enumerate(others):
        ev = p.update(i * dt, TOTAL, o)
        room = max(0, TOTAL - o - GiB)
        rooms.append(room)
        assert 0 <= p.budget <= room
        if ev is not None and ev.previous is not None and ev.budget > ev.previous:
            rises += 1
            window = [r for j, r in enumerate(rooms) if j * dt >= i * dt - hold - 1e-9]
            assert min(window) >= ev.budget
    if hold:
        assert rises <= len(others) * dt / hold + 1


@settings(max_examples=100, deadline=None)
@given(others=others_seq, gaming=st.lists(st.booleans(), min_size=150, max_size=150),
       cap=st.one_of(st.none(), st.integers(min_value=0, max_value=20 * GiB)))
def test_properties_pause_mode(others, gaming, cap):
    p = BudgetPolicy(mode="pause_when_gaming", user_cap=cap)
    for i, o in enumerate(others):
        p.update(i * 0.1, TOTAL, o, gaming=gaming[i])
        assert 0 <= p.budget <= max(0, TOTAL - o - GiB)
        assert p.budget <= (cap if cap is not None else TOTAL)
        if gaming[i]:
            assert p.paused and p.budget == 0
