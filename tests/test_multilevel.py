"""Multi-level schedules: validity by replay, Revolve as the one-level special case, and
makespans equal to an independent brute-force search over every possible action sequence."""

import heapq
import itertools

import pytest

import forkpoint as fp
from forkpoint.adjoint import Level, check, makespan, multilevel, optimal_advances


def brute_force(n: int, levels: list[Level], uf=1.0, ub=1.0) -> float:
    """Dijkstra over (current state, states held per level, next adjoint): every schedule that
    advances one step at a time, stores, restores, frees and runs adjoints is a path."""
    start = (0, frozenset(), n - 1)
    dist = {start: 0.0}
    tie = itertools.count()
    queue = [(0.0, next(tie), start)]
    while queue:
        d, _, state = heapq.heappop(queue)
        if d > dist[state]:
            continue
        current, held, nxt = state
        if nxt < 0:
            return d
        moves = []
        if current is not None and current < nxt:
            moves.append((uf, (current + 1, held, nxt)))
        if current is not None and current == nxt:
            moves.append((ub, (None, held, nxt - 1)))
        for k, lv in enumerate(levels):
            count = sum(1 for _, lk in held if lk == k)
            if current is not None and (current, k) not in held and (lv.slots is None or count < lv.slots):
                moves.append((lv.write_cost, (current, held | {(current, k)}, nxt)))
        for s, k in held:
            if s <= nxt:
                moves.append((levels[k].read_cost, (s, held, nxt)))
            moves.append((0.0, (current, held - {(s, k)}, nxt)))
        for cost, new in moves:
            if d + cost < dist.get(new, float("inf")):
                dist[new] = d + cost
                heapq.heappush(queue, (d + cost, next(tie), new))
    raise AssertionError("no schedule")


CASES = [
    (5, [Level(2, 0, 0)]),
    (6, [Level(1, 0.5, 0.5), Level(2, 2, 3)]),
    (7, [Level(1, 0.1, 0.1), Level(1, 1, 1)]),
    (6, [Level(2, 0.2, 0.2), Level(None, 2, 2)]),
    (7, [Level(1, 0, 0), Level(None, 3, 1)]),
    (5, [Level(0, 0, 0), Level(2, 1, 2)]),
    (6, [Level(1, 0.5, 0.25), Level(1, 1, 1), Level(1, 4, 4)]),
]


@pytest.mark.parametrize("n,levels", CASES)
def test_makespan_equals_brute_force(n, levels):
    sched = multilevel(n, levels)
    check(sched)
    assert sched.makespan == pytest.approx(makespan(sched, levels))
    assert sched.makespan == pytest.approx(brute_force(n, levels))


def test_random_small_cases_against_brute_force():
    import random

    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(2, 6)
        levels = [Level(rng.randint(1, 2) if i == 0 else rng.choice([0, 1, 2, None]),
                        rng.choice([0, 0.5, 1, 3]), rng.choice([0, 0.5, 1, 3])) for i in range(rng.randint(1, 2))]
        uf, ub = rng.choice([1.0, 2.0]), rng.choice([1.0, 3.0])
        sched = multilevel(n, levels, forward_cost=uf, backward_cost=ub)
        check(sched)
        assert sched.makespan == pytest.approx(makespan(sched, levels, uf, ub))
        assert sched.makespan == pytest.approx(brute_force(n, levels, uf, ub)), (n, levels, uf, ub)


def test_one_level_of_free_storage_is_revolve():
    for n, s in itertools.product([2, 10, 37, 100], [1, 2, 3, 5]):
        sched = multilevel(n, [Level(s)])
        check(sched)
        assert sched.stats()["advances"] == optimal_advances(n, s)
        assert sched.makespan == optimal_advances(n, s) + n


def test_stats_and_disk_unlimited():
    levels = [Level(3, 0.1, 0.1), Level(None, 5, 2)]
    sched = multilevel(200, levels)
    stats = sched.stats()
    assert stats["adjoints"] == 200 and stats["writes"].get(1, 0) > 0
    assert sched.makespan < multilevel(200, [Level(3, 0.1, 0.1)]).makespan
    assert fp.adjoint.multilevel is multilevel


def test_refuses_bad_levels():
    with pytest.raises(ValueError):
        multilevel(5, [])
    with pytest.raises(ValueError):
        multilevel(5, [Level(0)])


def test_executor_runs_a_three_level_schedule_over_two_repositories(tmp_path):
    import numpy as np

    def forward(i, x):
        return np.sin(x) + 0.01 * i

    def adjoint(i, x, lam):
        lam = np.ones_like(x) if lam is None else lam
        return lam * np.cos(x)

    x0 = np.linspace(0, 1, 5)
    n = 40
    plain, _ = fp.adjoint.run(forward, adjoint, x0, n, fp.adjoint.revolve(n, n))
    levels = [Level(2, 0, 0), Level(2, 1, 1), Level(None, 4, 4)]
    sched = multilevel(n, levels)
    check(sched)
    assert sched.stats()["writes"].get(1, 0) > 0 and sched.stats()["writes"].get(2, 0) > 0
    repos = {1: fp.Repo(str(tmp_path / "local"), create=True), 2: fp.Repo(str(tmp_path / "pfs"), create=True)}
    lam, stats = fp.adjoint.run(forward, adjoint, x0, n, sched, repo=repos)
    assert np.array_equal(lam, plain)
    assert stats.adjoints == n and stats.stored == sum(sched.stats()["writes"].get(k, 0) for k in (1, 2))
