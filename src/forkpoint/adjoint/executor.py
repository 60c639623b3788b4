"""Drive a schedule with user callbacks: level 0 in memory, deeper levels in a repository.

`forward(i, x)` returns x_{i+1}; `adjoint(i, x_i, lam)` returns the adjoint before step i,
given the one after it (None for the last step). Snapshots at level >= 1 are saved as
versions of `branch`; with a tiered repository the executor prefetches them in the order
the reverse sweep will restore them, so that restores rarely wait on storage.
"""

import time
import uuid
from dataclasses import dataclass

from .schedule import ADJOINT, ADVANCE, FREE, RESTORE, TAKE, Schedule


@dataclass
class RunStats:
    """What a run cost: forward steps recomputed, storage traffic, waiting and prefetch hits."""

    advances: int = 0
    recomputations: int = 0
    adjoints: int = 0
    stored: int = 0
    restored: int = 0
    io_wait_seconds: float = 0.0
    prefetch_hits: int = 0
    prefetch_misses: int = 0


def run(forward, adjoint, state0, n_steps: int, schedule: Schedule, repo=None,
        branch: str | None = None, prefetch_depth: int = 2):
    """Execute `schedule`; return (adjoint of the initial state, RunStats). `repo` holds the
    states of levels >= 1: one Repo for all, or {level: Repo} (e.g. node-local disk for
    level 1 and the parallel file system for level 2, as fp.adjoint.multilevel plans)."""
    if schedule.n_steps != n_steps:
        raise ValueError(f"schedule is for {schedule.n_steps} steps, not {n_steps}")
    levels = sorted({a.level for a in schedule if a.kind == TAKE and a.level > 0})
    if isinstance(repo, dict):
        missing = [lv for lv in levels if lv not in repo]
        if missing:
            raise ValueError(f"no repository for level(s) {missing}: pass repo={{level: fp.Repo(...)}}")
        return _run_levels(forward, adjoint, state0, schedule, repo, branch)
    if levels and repo is None:
        raise ValueError("this schedule stores states at level >= 1: pass repo=fp.Repo(...)")
    branch = branch or f"adjoint-{uuid.uuid4().hex[:8]}"
    stats = RunStats()
    memory: dict[int, object] = {}
    stored: dict[int, str] = {}
    future = [a.a for a in schedule if a.kind == RESTORE and a.level > 0]
    state, lam, computed = state0, None, set()
    for act in schedule:
        if act.kind == ADVANCE:
            state = _advance(forward, state, act, computed, stats)
        elif act.kind == TAKE and act.level == 0:
            memory[act.a] = state
        elif act.kind == TAKE:
            stored[act.a] = repo.save({"x": state}, branch=branch, step=act.a, sync=True).id
            stats.stored += 1
        elif act.kind == RESTORE and act.level == 0:
            state = memory[act.a]
        elif act.kind == RESTORE:
            future.pop(0)
            vid = stored[act.a]
            hit = repo.store.exists(f"versions/{vid}.json")
            stats.prefetch_hits += hit and len(repo.stores) > 1
            stats.prefetch_misses += (not hit) and len(repo.stores) > 1
            start = time.perf_counter()
            state = repo.load(vid)["x"]
            stats.io_wait_seconds += time.perf_counter() - start
            stats.restored += 1
            if len(repo.stores) > 1 and future:
                upcoming = [stored[i] for i in future if i in stored]
                repo.prefetch(upcoming[:prefetch_depth], order=upcoming)
        elif act.kind == FREE and act.level == 0:
            memory.pop(act.a, None)
        elif act.kind == ADJOINT:
            lam = adjoint(act.a, state, lam)
            stats.adjoints += 1
    return lam, stats


def _run_levels(forward, adjoint, state0, schedule: Schedule, repos: dict, branch: str | None):
    """run() with one repository per level >= 1 (no prefetch across them)."""
    branch = branch or f"adjoint-{uuid.uuid4().hex[:8]}"
    stats = RunStats()
    held: dict[tuple[int, int], object] = {}
    state, lam, computed = state0, None, set()
    for act in schedule:
        if act.kind == ADVANCE:
            state = _advance(forward, state, act, computed, stats)
        elif act.kind == TAKE:
            if act.level == 0:
                held[(0, act.a)] = state
            else:
                held[(act.level, act.a)] = repos[act.level].save({"x": state}, branch=branch, step=act.a).id
                stats.stored += 1
        elif act.kind == RESTORE:
            if act.level == 0:
                state = held[(0, act.a)]
            else:
                start = time.perf_counter()
                state = repos[act.level].load(held[(act.level, act.a)])["x"]
                stats.io_wait_seconds += time.perf_counter() - start
                stats.restored += 1
        elif act.kind == FREE:
            held.pop((act.level, act.a), None)
        elif act.kind == ADJOINT:
            lam = adjoint(act.a, state, lam)
            stats.adjoints += 1
    return lam, stats


def _advance(forward, state, act, computed: set, stats: RunStats):
    """Run forward steps act.a .. act.b - 1 from `state`, counting recomputed steps."""
    for i in range(act.a, act.b):
        state = forward(i, state)
        stats.recomputations += i in computed
        computed.add(i)
    stats.advances += act.b - act.a
    return state
