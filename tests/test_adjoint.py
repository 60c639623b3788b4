"""Checkpoint schedules: optimal advance counts, validity by replay, torch checkpoint_sequential."""

import random

import pytest

from forkpoint.adjoint import InvalidSchedule, check, optimal_advances, revolve
from forkpoint.adjoint.schedule import ADJOINT, RESTORE, TAKE, Action, Schedule


@pytest.mark.parametrize("l, s, t", [(10, 2, 20), (20, 3, 45), (50, 5, 122), (100, 10, 222), (1000, 3, 12155)])
def test_worked_examples(l, s, t):
    assert optimal_advances(l, s) == t
    sched = revolve(l, s)
    assert sched.advances == t and check(sched)["advances"] == t


def test_closed_form_matches_an_independent_dynamic_program():
    L, S = 200, 12
    inf = float("inf")
    F = [[inf] * (S + 1) for _ in range(L + 1)]
    for s in range(S + 1):
        F[1][s] = 0
    for s in range(1, S + 1):
        for l in range(2, L + 1):
            F[l][s] = min(m + F[l - m][s - 1] + F[m][s] for m in range(1, l))
    for s in range(1, S + 1):
        for l in range(1, L + 1):
            assert optimal_advances(l, s) == F[l][s], (l, s)


def test_every_schedule_is_valid_and_optimal_up_to_200_by_12():
    for s in range(1, 13):
        for l in range(1, 201):
            sched = revolve(l, s)
            assert check(sched)["advances"] == optimal_advances(l, s), (l, s)
            assert sched.stats()["adjoints"] == l


def test_sample_up_to_ten_thousand_steps():
    rnd = random.Random(3)
    for _ in range(6):
        l, s = rnd.randint(201, 10_000), rnd.randint(1, 12)
        if s == 1 and l > 3000:
            continue
        assert check(revolve(l, s))["advances"] == optimal_advances(l, s)
    assert check(revolve(10_000, 12))["advances"] == optimal_advances(10_000, 12)


def test_checker_refuses_invalid_schedules():
    with pytest.raises(InvalidSchedule, match="was not taken"):
        check(Schedule(2, [1], [Action(RESTORE, 1)]))
    with pytest.raises(InvalidSchedule, match="level 0 is full"):
        check(Schedule(3, [1], [Action(TAKE, 0), Action("advance", 0, 1), Action(TAKE, 1)]))
    with pytest.raises(InvalidSchedule, match="expected adjoint 1"):
        check(Schedule(2, [1], [Action(ADJOINT, 0)]))
    with pytest.raises(InvalidSchedule, match="not run"):
        check(Schedule(2, [1], [Action(TAKE, 0)]))
    with pytest.raises(ValueError, match="snapshots must be >= 1"):
        revolve(10, 0)


def test_schedule_sizes_must_be_ints():
    """A float step count made revolve loop forever; sizes must be ints (numpy ints taken)."""
    import numpy as np

    from forkpoint.adjoint import Level, multilevel, online, two_level

    for make in (lambda: revolve(10.5, 2), lambda: revolve(10, 2.0), lambda: revolve("10", 2),
                 lambda: two_level(10.0, 2, 5), lambda: online(2.5), lambda: multilevel(7.5, [Level(2)]),
                 lambda: Level(1.5), lambda: revolve(True, 2)):
        with pytest.raises(TypeError, match="must be an int"):
            make()
    with pytest.raises(ValueError, match="write_cost must be a finite number >= 0"):
        Level(2, write_cost=-1)
    with pytest.raises(ValueError, match="forward_cost"):
        multilevel(5, [Level(2)], forward_cost=float("nan"))
    assert check(revolve(np.int64(20), np.int32(3)))["advances"] == optimal_advances(20, 3)


def _net(n, dropout):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(n):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
        if dropout:
            layers.append(torch.nn.Dropout(0.2))
    return torch.nn.Sequential(*layers).double()


@pytest.mark.parametrize("snapshots", [1, 2, 4, 60])
@pytest.mark.parametrize("dropout", [False, True])
def test_checkpoint_sequential_gradients_match_plain_backprop(snapshots, dropout):
    import torch

    import forkpoint as fp

    net = _net(12, dropout)
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    plain = net(x).pow(2).sum()
    plain.backward()
    ref_x, ref_p = x.grad.clone(), [p.grad.clone() for p in net.parameters()]
    x.grad = None
    net.zero_grad()
    torch.manual_seed(7)
    out = fp.adjoint.checkpoint_sequential(net, x, snapshots).pow(2).sum()
    assert torch.equal(out, plain.detach())
    out.backward()
    assert torch.equal(x.grad, ref_x)
    for p, r in zip(net.parameters(), ref_p):
        assert torch.equal(p.grad, r)


def _heat():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "adjoint_heat.py")
    spec = importlib.util.spec_from_file_location("adjoint_heat", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _store_all_reference(heat, u0, n):

    us = [u0]
    for _ in range(n):
        us.append(heat.step(us[-1]))
    lam = us[-1]
    for i in reversed(range(n)):
        lam = heat.step_adjoint(lam)
    return lam


def test_executor_with_revolve_matches_store_all_adjoint():
    import numpy as np

    import forkpoint as fp

    heat = _heat()
    u0 = np.random.default_rng(1).standard_normal(64)
    grad, stats = heat.gradient(u0, 300, fp.adjoint.revolve(300, 5))
    assert np.array_equal(grad, _store_all_reference(heat, u0, 300))
    assert stats.advances == fp.adjoint.optimal_advances(300, 5) and stats.adjoints == 300
    assert stats.stored == 0


def test_two_level_through_tiers_prefetches_and_checks_against_finite_differences(tmp_path):
    import uuid

    import numpy as np

    import forkpoint as fp

    heat = _heat()
    rng = np.random.default_rng(2)
    u0 = rng.standard_normal(128)
    repo = fp.Repo(tiers=[fp.tier(f"mem://{uuid.uuid4().hex}", keep=3), str(tmp_path / "disk")], create=True)
    sched = fp.adjoint.two_level(1000, 4, 100)
    assert check(sched)
    grad, stats = heat.gradient(u0, 1000, sched, repo)
    assert np.array_equal(grad, _store_all_reference(heat, u0, 1000))
    reads = sched.stats()["reads"][1]  # each segment's first state, read back whenever Revolve needs it
    assert stats.stored == 10 and stats.restored == reads and reads >= 9 and stats.prefetch_hits >= 5
    d = rng.standard_normal(128)
    eps = 1e-6
    fd = (heat.objective(u0 + eps * d, 1000) - heat.objective(u0 - eps * d, 1000)) / (2 * eps)
    assert abs(grad @ d - fd) / abs(fd) < 1e-6
    repo.close()


def test_executor_bad_arguments():
    import forkpoint as fp

    with pytest.raises(ValueError, match="schedule is for 10 steps"):
        fp.adjoint.run(lambda i, x: x, lambda i, x, l: l, 0, 11, fp.adjoint.revolve(10, 2))
    with pytest.raises(ValueError, match="pass repo"):
        fp.adjoint.run(lambda i, x: x, lambda i, x, l: l, 0, 10, fp.adjoint.two_level(10, 2, 5))
    with pytest.raises(ValueError, match="stride"):
        fp.adjoint.two_level(10, 2, 0)


def _fewest_advances(length: int, free: int, memo={}) -> int:
    """Exhaustive search: the fewest advances that reverse `length` steps whose first state can
    be restored at any time, with `free` other snapshot slots (every first checkpoint position
    tried, recursively)."""
    if length == 1:
        return 0
    if free == 0:
        return length * (length - 1) // 2
    key = (length, free)
    if key not in memo:
        memo[key] = min(j + _fewest_advances(length - j, free - 1) + _fewest_advances(j, free)
                        for j in range(1, length))
    return memo[key]


def test_two_level_is_optimal_for_its_model_against_an_exhaustive_search():
    """Each segment between level-1 states is reversed in the fewest advances any schedule with
    that many memory slots needs (its first state is read back from level 1, so it costs no
    slot: with one slot, 51 steps in periods of 25 take 238 advances, not 701 as before)."""
    from forkpoint.adjoint import two_level
    from forkpoint.adjoint.check import check

    for n in range(1, 41):
        for period in (1, 2, 3, 5, 8, 13, 40):
            for slots in range(0, 4):
                sched = two_level(n, slots, period)
                starts = list(range(0, n, period))
                best = starts[-1] + sum(_fewest_advances(min(a + period, n) - a, slots) for a in starts)
                assert check(sched)["advances"] == best, (n, period, slots)
    assert two_level(51, 1, 25).advances == 238
