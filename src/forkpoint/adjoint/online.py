"""Online checkpointing: the number of steps is not known until the forward pass ends.

During the forward pass the schedule keeps at most `snapshots` states. Before each step it
may store the current state in place of an older one: among the choices that are optimal
if the pass ended right after this step, it takes the one that stays optimal for the
longest run of further steps. When the pass ends after l steps, each segment between kept
states is reversed with Revolve in the slots then free. For l up to C(s+2, 2) (repetition
number 2) the total number of advances equals the offline optimum t(l, s) (checked for
every l in that range for s up to 20); beyond it, it stays within a few percent of t(l, s)
(at most 12% for s = 2, under 6% for s >= 3 through the repetition-3 range), in the spirit
of Stumm and Walther's online algorithms.
"""

from functools import lru_cache

from .schedule import (ADJOINT, ADVANCE, END_FORWARD, END_REVERSE, FREE, RESTORE, TAKE, Action, Schedule,
                       _cost, count, revolve)

HORIZON_MAX = 256


_t = lru_cache(maxsize=1 << 16)(_cost)


class OnlineSchedule:
    """Drive it step by step: `advance()` before each forward step returns that step's
    actions (the advance, and any store or free); `finish()` when the pass has ended returns
    the whole Schedule, reverse sweep included."""

    def __init__(self, snapshots: int):
        self.s = count("snapshots", snapshots, why=" (one holds the initial state)")
        self.kept = (0,)
        self.current = 0
        self.schedule = Schedule(0, [snapshots], [Action(TAKE, 0)])

    def _cost(self, kept: tuple, n: int) -> float:
        """Advances to reverse n steps in all, with states `kept` stored during the pass."""
        k, s = len(kept), self.s
        total = n - 1 + _t(n - 1 - kept[-1], s - k + 1)
        return total + sum(_t(kept[j + 1] - kept[j], s - j) for j in range(k - 1))

    def _horizon(self, kept: tuple, n: int) -> int:
        """How many pass lengths from n on `kept` stays optimal for."""
        count = 0
        while count < HORIZON_MAX and self._cost(kept, n + count) == _t(n + count, self.s):
            count += 1
        return count

    def advance(self) -> list[Action]:
        """The actions of the next forward step (from the current state to the next one)."""
        i, kept = self.current, self.kept
        options = [kept]
        if i > kept[-1]:
            if len(kept) < self.s:
                options.append(kept + (i,))
            options += [tuple(sorted(set(kept) - {p} | {i})) for p in kept[1:]]
        n = i + 2
        best = min(self._cost(c, n) for c in options)
        choice = max((c for c in options if self._cost(c, n) == best),
                     key=lambda c: (self._horizon(c, n), -len(c)))
        acts = [Action(FREE, p) for p in kept if p not in choice]
        acts += [Action(TAKE, p) for p in choice if p not in kept]
        acts.append(Action(ADVANCE, i, i + 1))
        self.kept, self.current = choice, i + 1
        self.schedule.actions += acts
        return acts

    def finish(self) -> Schedule:
        """End the forward pass (the current state is x_{l-1}); return the full schedule."""
        n = self.current + 1
        sched = self.schedule
        sched.n_steps = n
        acts = sched.actions
        acts += [Action(END_FORWARD), Action(ADJOINT, n - 1)]
        end = n - 1
        for j in reversed(range(len(self.kept))):
            start = self.kept[j]
            if end == start:
                acts.append(Action(FREE, start))
                continue
            acts.append(Action(RESTORE, start))
            for act in revolve(end - start, self.s - j):
                if act.kind in (END_FORWARD, END_REVERSE) or (act.kind == TAKE and act.a == 0):
                    continue
                if act.kind == ADVANCE:
                    acts.append(Action(ADVANCE, act.a + start, act.b + start))
                else:
                    acts.append(Action(act.kind, act.a + start))
            end = start
        acts.append(Action(END_REVERSE))
        return sched


def online(snapshots: int) -> OnlineSchedule:
    """An online checkpoint schedule keeping at most `snapshots` states (see OnlineSchedule)."""
    return OnlineSchedule(snapshots)
