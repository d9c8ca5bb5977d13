"""BudgetPolicy(total_cap=...): a GPU treated as a smaller card (benchmarks of a client card on a big GPU)."""

from __future__ import annotations

from monitor.budget import BudgetPolicy

GiB, MiB = 1 << 30, 1 << 20


def test_total_cap_bounds_the_total_in_auto_mode():
    p = BudgetPolicy(reserve=GiB, slack=128 * MiB, total_cap="24GiB")
    ev = p.update(0.0, 141 * GiB, 6 * GiB)
    assert ev is not None and ev.budget == 24 * GiB - 6 * GiB - GiB - 128 * MiB
    ev = p.update(0.1, 141 * GiB, 20 * GiB)                 # a level load: the fast path down
    assert ev is not None and ev.budget == 24 * GiB - 20 * GiB - GiB - 128 * MiB


def test_total_cap_bounds_fixed_mode_and_never_raises_a_smaller_total():
    p = BudgetPolicy(mode="fixed", reserve=GiB, total_cap=24 * GiB)
    p.update(0.0, 141 * GiB, 0)
    assert p.budget == 23 * GiB
    q = BudgetPolicy(reserve=GiB, slack=0, total_cap=24 * GiB)
    q.update(0.0, 8 * GiB, 0)                              # a card smaller than the cap keeps its own total
    assert q.budget == 7 * GiB


def test_no_cap_is_the_old_formula():
    p = BudgetPolicy(reserve=GiB, slack=0)
    p.update(0.0, 141 * GiB, 6 * GiB)
    assert p.budget == 134 * GiB and p.total_cap is None
