"""Checkpoint schedules as lists of actions, and Griewank–Walther's binomial Revolve.

A schedule reverses `n_steps` forward steps x_{i+1} = F_i(x_i): it advances, takes and
restores snapshots, and runs the adjoint of each step i (which needs x_i) in the order
n-1, ..., 0. The snapshot of x_0 counts among the snapshots; the taping step of each
adjoint is not counted as an advance.
"""

import operator
from dataclasses import dataclass, field
from functools import lru_cache
from math import comb

ADVANCE, TAKE, RESTORE, FREE, ADJOINT, END_FORWARD, END_REVERSE = (
    "advance", "take", "restore", "free", "adjoint", "end_forward", "end_reverse")


@dataclass(frozen=True)
class Action:
    """One schedule step. advance: a -> b; take/restore/free: state a at `level`; adjoint: step a."""

    kind: str
    a: int = 0
    b: int = 0
    level: int = 0


@dataclass
class Schedule:
    """The actions of a schedule and what it costs."""

    n_steps: int
    snapshots: list[int]
    actions: list[Action] = field(default_factory=list)
    makespan: float | None = None

    def __iter__(self):
        return iter(self.actions)

    def __len__(self):
        return len(self.actions)

    @property
    def advances(self) -> int:
        return sum(a.b - a.a for a in self.actions if a.kind == ADVANCE)

    def stats(self) -> dict:
        """Advances, and takes and restores per level."""
        out = {"advances": self.advances, "adjoints": 0, "writes": {}, "reads": {}}
        for act in self.actions:
            if act.kind == ADJOINT:
                out["adjoints"] += 1
            elif act.kind == TAKE:
                out["writes"][act.level] = out["writes"].get(act.level, 0) + 1
            elif act.kind == RESTORE:
                out["reads"][act.level] = out["reads"].get(act.level, 0) + 1
        return out


def repetitions(n_steps: int, snapshots: int) -> int:
    """The smallest r with C(s + r, s) >= l."""
    r = 0
    while comb(snapshots + r, snapshots) < n_steps:
        r += 1
    return r


def optimal_advances(n_steps: int, snapshots: int) -> int:
    """t(l, s) = r l - C(s + r, s + 1), the fewest advances to reverse l steps with s snapshots."""
    if n_steps < 1 or snapshots < 1:
        raise ValueError(f"need n_steps >= 1 and snapshots >= 1, got {n_steps}, {snapshots}")
    r = repetitions(n_steps, snapshots)
    return r * n_steps - comb(snapshots + r, snapshots + 1)


def _cost(length: int, snaps: int) -> float:
    if length == 1:
        return 0
    if snaps == 0:
        return float("inf")
    return optimal_advances(length, snaps)


@lru_cache(maxsize=None)
def best_split(length: int, snaps: int) -> int:
    """An m in [1, length-1] minimising m + t(length-m, snaps-1) + t(m, snaps) (convex in m)."""
    if snaps == 1:
        return length - 1

    def g(m):
        return m + _cost(length - m, snaps - 1) + _cost(m, snaps)

    lo, hi = 1, length - 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if g(m1) <= g(m2):
            hi = m2
        else:
            lo = m1
    return min(range(lo, hi + 1), key=g)


def count(name: str, value, least: int = 1, why: str = "") -> int:
    """`value` as an int of at least `least`: TypeError for what is not an integer (a float, a
    bool, a str), ValueError naming `name` below that."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if value < least:
        raise ValueError(f"{name} must be >= {least}{why}, got {value}")
    return value


def revolve(n_steps: int, snapshots: int) -> Schedule:
    """The offline binomial schedule: exactly t(l, s) advances, at most `snapshots` held."""
    n_steps = count("n_steps", n_steps)
    snapshots = count("snapshots", snapshots, why=" (one holds the initial state)")
    sched = Schedule(n_steps, [snapshots])
    acts = sched.actions
    acts.append(Action(TAKE, 0))
    current = [0]
    forward_done = [False]

    def goto(i):
        if current[0] != i:
            acts.append(Action(RESTORE, i))
            current[0] = i

    def adjoint(i):
        if not forward_done[0]:
            acts.append(Action(END_FORWARD))
            forward_done[0] = True
        acts.append(Action(ADJOINT, i))
        current[0] = None

    stack = [("reverse", 0, n_steps, snapshots)]
    while stack:
        op, start, end, snaps = stack.pop()
        if op == "free":
            acts.append(Action(FREE, start))
            continue
        length = end - start
        goto(start)
        if length == 1:
            adjoint(start)
            continue
        m = best_split(length, snaps)
        acts.append(Action(ADVANCE, start, start + m))
        current[0] = start + m
        stack.append(("reverse", start, start + m, snaps))
        if length - m == 1:
            adjoint(start + m)
        else:
            acts.append(Action(TAKE, start + m))
            stack.append(("free", start + m, 0, 0))
            stack.append(("reverse", start + m, end, snaps - 1))
    acts.append(Action(FREE, 0))
    acts.append(Action(END_REVERSE))
    return sched


def two_level(n_steps: int, memory_slots: int, stride: int) -> Schedule:
    """Disk-unlimited two-level schedule: during the forward sweep every `stride`-th state goes
    to level 1 (storage, unlimited); the reverse sweep reverses each segment, last first, by
    Revolve with the segment's first state read back from level 1 whenever it is needed and
    `memory_slots` level-0 slots for the others: the fewest advances for that model (each
    segment costs t(length, memory_slots + 1), the binomial bound)."""
    n_steps, stride = count("n_steps", n_steps), count("stride", stride)
    memory_slots = count("memory_slots", memory_slots, least=0)
    starts = list(range(0, n_steps, stride))
    sched = Schedule(n_steps, [memory_slots, len(starts)])
    acts = sched.actions
    for k, a in enumerate(starts):
        if k:
            acts.append(Action(ADVANCE, starts[k - 1], a))
        acts.append(Action(TAKE, a, level=1))
    acts.append(Action(END_FORWARD))
    current = starts[-1]
    for k in reversed(range(len(starts))):
        a = starts[k]
        b = starts[k + 1] if k + 1 < len(starts) else n_steps
        if current != a:
            acts.append(Action(RESTORE, a, level=1))
            current = a
        # the segment's first state lives on level 1: Revolve's snapshot of it costs no slot
        for act in revolve(b - a, memory_slots + 1):
            if act.kind in (END_FORWARD, END_REVERSE) or (act.kind in (TAKE, FREE) and act.a == 0):
                continue
            if act.kind == RESTORE and act.a == 0:
                if current != a:
                    acts.append(Action(RESTORE, a, level=1))
                current = a
                continue
            acts.append(Action(act.kind, act.a + a, act.b + a if act.kind == ADVANCE else 0, 0))
            if act.kind == ADVANCE:
                current = act.b + a
            elif act.kind == RESTORE:
                current = act.a + a
            elif act.kind == ADJOINT:
                current = None
        acts.append(Action(FREE, a, level=1))
        current = None
    acts.append(Action(END_REVERSE))
    return sched
