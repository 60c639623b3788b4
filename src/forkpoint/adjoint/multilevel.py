"""Makespan-optimal checkpoint schedules over several storage levels (H-Revolve style).

Each level (memory, node-local disk, parallel file system) has a number of slots (None for
unlimited) and a cost to write and to read one state. A dynamic program over (steps to
reverse, free slots per level, level holding the segment's first state) picks where to
split each segment and where to keep the split state, and whether to copy a
segment's first state to a level that is cheaper to read before reversing the segment,
minimising the total time: forward advances, adjoint steps, writes and reads. With one level of zero costs it reduces to
Revolve; with an unlimited last level it gives the disk-unlimited optimum.
"""

import itertools
from dataclasses import dataclass

import numpy as np

from .schedule import ADJOINT, ADVANCE, END_FORWARD, END_REVERSE, FREE, RESTORE, TAKE, Action, Schedule, count


@dataclass(frozen=True)
class Level:
    """A storage level: `slots` states (None: unlimited), and the time to write / read one."""

    slots: int | None
    write_cost: float = 0.0
    read_cost: float = 0.0

    def __post_init__(self):
        if self.slots is not None:
            object.__setattr__(self, "slots", count("Level.slots", self.slots, least=0))
        for name in ("write_cost", "read_cost"):
            cost = getattr(self, name)
            if isinstance(cost, bool) or not (isinstance(cost, (int, float)) and 0 <= cost < float("inf")):
                raise ValueError(f"Level.{name} must be a finite number >= 0, got {cost!r}")


class _Table:
    """F[c][k][l]: least time to reverse l steps whose first state is held at level k and is
    the current state, with free slots c (one entry per limited level); and the choices."""

    def __init__(self, n_steps: int, levels: list[Level], uf: float, ub: float):
        self.n, self.levels, self.uf, self.ub = n_steps, levels, uf, ub
        self.limited = [i for i, lv in enumerate(levels) if lv.slots is not None]
        ranges = [range(levels[i].slots + 1) for i in self.limited]
        self.cost: dict[tuple, np.ndarray] = {}
        self.split: dict[tuple, np.ndarray] = {}
        self.where: dict[tuple, np.ndarray] = {}
        for c in sorted(itertools.product(*ranges), key=sum):
            self._fill(c)

    def minus(self, c: tuple, level: int) -> tuple | None:
        """Free slots after taking one at `level` (None when it is full)."""
        if level not in self.limited:
            return c
        i = self.limited.index(level)
        if c[i] == 0:
            return None
        return c[:i] + (c[i] - 1,) + c[i + 1:]

    def _fill(self, c: tuple) -> None:
        n, K = self.n, len(self.levels)
        cost = np.full((K, n + 1), np.inf)
        split = np.zeros((K, n + 1), dtype=np.int64)
        where = np.full((K, n + 1), -1, dtype=np.int64)
        cost[:, 1] = self.ub
        self.cost[c], self.split[c], self.where[c] = cost, split, where
        for length in range(2, n + 1):
            j = np.arange(1, length)
            for k in range(K):
                left = cost[k, 1:length] + self.levels[k].read_cost
                best = (j[-1] * self.uf + self.ub + left[-1], length - 1, -1)
                for k2, lv in enumerate(self.levels):
                    c2 = self.minus(c, k2)
                    if c2 is None:
                        continue
                    right = self.cost[c2][k2, length - j] if c2 != c else cost[k2, length - j]
                    total = j * self.uf + lv.write_cost + right + left
                    total[-1] = np.inf
                    m = int(np.argmin(total))
                    if total[m] < best[0]:
                        best = (float(total[m]), m + 1, k2)
                cost[k, length], split[k, length], where[k, length] = best
            for k in sorted(range(K), key=lambda k: -self.levels[k].read_cost):
                for k2, lv in enumerate(self.levels):
                    c2 = self.minus(c, k2)
                    if c2 is None or c2 == c or lv.read_cost >= self.levels[k].read_cost:
                        continue
                    total = lv.write_cost + self.cost[c2][k2, length]
                    if total < cost[k, length]:
                        cost[k, length], split[k, length], where[k, length] = total, 0, k2


def multilevel(n_steps: int, levels: list[Level], forward_cost: float = 1.0,
               backward_cost: float = 1.0) -> Schedule:
    """The schedule of least makespan reversing `n_steps` steps over `levels`.

    `schedule.makespan` is its total time; `schedule.stats()` its advances, writes and reads
    per level. Slots of a level with `slots=None` are unlimited."""
    n_steps = count("n_steps", n_steps)
    if not levels:
        raise ValueError("levels must be a non-empty list of fp.adjoint.Level with slots >= 0 or None")
    levels = [lv if isinstance(lv, Level) else Level(*lv) for lv in levels]
    for name, cost in (("forward_cost", forward_cost), ("backward_cost", backward_cost)):
        if not (isinstance(cost, (int, float)) and 0 <= cost < float("inf")):
            raise ValueError(f"{name} must be a finite number >= 0, got {cost!r}")
    table = _Table(n_steps, levels, forward_cost, backward_cost)
    full = tuple(levels[i].slots for i in table.limited)
    sched = Schedule(n_steps, [lv.slots if lv.slots is not None else n_steps for lv in levels])
    acts = sched.actions
    if n_steps == 1:
        acts += [Action(END_FORWARD), Action(ADJOINT, 0), Action(END_REVERSE)]
        sched.makespan = backward_cost
        return sched
    options = [(lv.write_cost + table.cost[table.minus(full, k)][k, n_steps], k)
               for k, lv in enumerate(levels) if table.minus(full, k) is not None]
    if not options:
        raise ValueError("no level has a slot for the initial state")
    sched.makespan, k0 = min(options)
    acts.append(Action(TAKE, 0, level=k0))
    forward_done = False
    stack = [("reverse", 0, n_steps, table.minus(full, k0), k0, False)]
    while stack:
        op, start, length, c, k, restore = stack.pop()
        if op == "free":
            acts.append(Action(FREE, start, level=k))
            continue
        if restore:
            acts.append(Action(RESTORE, start, level=k))
        if length == 1:
            if not forward_done:
                acts.append(Action(END_FORWARD))
                forward_done = True
            acts.append(Action(ADJOINT, start))
            continue
        j, k2 = int(table.split[c][k, length]), int(table.where[c][k, length])
        if j == 0:
            acts.append(Action(TAKE, start, level=k2))
            stack.append(("free", start, 0, c, k2, False))
            stack.append(("reverse", start, length, table.minus(c, k2), k2, False))
            continue
        acts.append(Action(ADVANCE, start, start + j))
        stack.append(("reverse", start, j, c, k, True))
        if k2 < 0:
            stack.append(("reverse", start + j, 1, c, k, False))
        else:
            acts.append(Action(TAKE, start + j, level=k2))
            stack.append(("free", start + j, 0, c, k2, False))
            stack.append(("reverse", start + j, length - j, table.minus(c, k2), k2, False))
    acts.append(Action(FREE, 0, level=k0))
    acts.append(Action(END_REVERSE))
    return sched


def makespan(schedule: Schedule, levels: list[Level], forward_cost: float = 1.0,
             backward_cost: float = 1.0) -> float:
    """The total time of any schedule under `levels`' costs (to compare schedules)."""
    levels = [lv if isinstance(lv, Level) else Level(*lv) for lv in levels]
    total = 0.0
    for act in schedule.actions:
        if act.kind == ADVANCE:
            total += (act.b - act.a) * forward_cost
        elif act.kind == ADJOINT:
            total += backward_cost
        elif act.kind == TAKE:
            total += levels[act.level].write_cost
        elif act.kind == RESTORE:
            total += levels[act.level].read_cost
    return total
