"""Replay a schedule and refuse it unless it is valid.

Valid: every restore finds a snapshot that was taken; slots per level are never exceeded;
each adjoint step runs exactly once, in reverse order, with its forward state present.
"""

from .schedule import ADJOINT, ADVANCE, END_FORWARD, END_REVERSE, FREE, RESTORE, TAKE, Schedule


class InvalidSchedule(ValueError):
    """A schedule that cannot be executed as written."""


def check(schedule: Schedule) -> dict:
    """Replay `schedule`; return its counts or raise InvalidSchedule naming the action."""
    held = {level: set() for level in range(len(schedule.snapshots))}
    current, expected, advances = 0, schedule.n_steps - 1, 0
    ended = False
    for pos, act in enumerate(schedule.actions):
        where = f"action {pos} ({act})"
        if ended:
            raise InvalidSchedule(f"{where} after end of reverse")
        if act.kind == ADVANCE:
            if current != act.a or act.b <= act.a or act.b > schedule.n_steps - 1:
                raise InvalidSchedule(f"{where}: current state is {current}")
            advances += act.b - act.a
            current = act.b
        elif act.kind == TAKE:
            if current != act.a:
                raise InvalidSchedule(f"{where}: cannot store state {act.a}, current is {current}")
            if act.level not in held or len(held[act.level]) >= schedule.snapshots[act.level]:
                raise InvalidSchedule(f"{where}: level {act.level} is full")
            held[act.level].add(act.a)
        elif act.kind == RESTORE:
            if act.a not in held.get(act.level, ()):
                raise InvalidSchedule(f"{where}: state {act.a} was not taken at level {act.level}")
            current = act.a
        elif act.kind == FREE:
            if act.a not in held.get(act.level, ()):
                raise InvalidSchedule(f"{where}: nothing to free")
            held[act.level].discard(act.a)
        elif act.kind == ADJOINT:
            if act.a != expected or current != act.a:
                raise InvalidSchedule(f"{where}: expected adjoint {expected} with its state present "
                                      f"(current {current})")
            expected -= 1
            current = None
        elif act.kind == END_REVERSE:
            ended = True
        elif act.kind != END_FORWARD:
            raise InvalidSchedule(f"{where}: unknown action")
    if expected != -1:
        raise InvalidSchedule(f"schedule ends with adjoints {expected}..0 not run")
    return {"advances": advances}
