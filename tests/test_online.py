"""Online schedules (step count unknown until the forward pass ends): valid at every length,
optimal through the repetition-2 range, close to optimal beyond."""

from math import comb

import pytest

import forkpoint as fp
from forkpoint.adjoint import check, optimal_advances


def ended_after(snapshots: int, n_steps: int):
    sched = fp.adjoint.online(snapshots)
    for _ in range(n_steps - 1):
        sched.advance()
    return sched.finish()


@pytest.mark.parametrize("s", [1, 2, 3, 4, 6, 10])
def test_optimal_for_every_length_in_the_repetition_2_range(s):
    for n in range(2, comb(s + 2, 2) + 1):
        sched = ended_after(s, n)
        counts = check(sched)
        assert counts["advances"] == optimal_advances(n, s), (s, n)


def test_graceful_beyond_the_range():
    for s, n in [(2, 40), (3, 100), (5, 500), (10, 3000)]:
        sched = ended_after(s, n)
        check(sched)
        assert sched.advances <= 1.15 * optimal_advances(n, s), (s, n, sched.advances, optimal_advances(n, s))


def test_forward_actions_are_incremental_and_bounded():
    sched = fp.adjoint.online(3)
    held = {0}
    for i in range(30):
        for act in sched.advance():
            if act.kind == "take":
                assert act.a == i, "only the current state can be stored"
                held.add(act.a)
            elif act.kind == "free":
                held.discard(act.a)
            else:
                assert (act.kind, act.a, act.b) == ("advance", i, i + 1)
        assert len(held) <= 3 and 0 in held
    full = sched.finish()
    assert full.n_steps == 31 and check(full)["advances"] >= 30
    assert [a.a for a in full.actions if a.kind == "adjoint"] == list(range(30, -1, -1))


def test_one_step_and_bad_input():
    check(ended_after(2, 1))
    with pytest.raises(ValueError):
        fp.adjoint.online(0)
