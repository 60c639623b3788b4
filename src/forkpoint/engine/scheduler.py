"""The scheduler: one task DAG with resource budgets, priorities and back-pressure.

Every stage of a save or restore (capture, write, commit, flush, prefetch, evict, gc) is a
task. A task starts when its dependencies are done and the resources it `needs` fit the
budget; it gives back `frees` when it ends (default: what it took), so a resource such as
staging memory can be held from a capture until the write that empties it.
"""

import bisect
import os
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable


class Priority(IntEnum):
    """Lower runs first among ready tasks."""

    CAPTURE = 0
    RESTORE = 1
    PREFETCH = 2
    WRITE = 3
    COMMIT = 4
    FLUSH = 5
    EVICT = 6
    GC = 7


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class Budget:
    """Limits: staging memory for asynchronous saves, the streaming window of synchronous ones
    (bytes), CPU workers, chunks encoded at once, chunks encoded and not yet written (each holds
    its payload; 0: twice the default I/O slots plus the encoders, so that encoders keep working
    while every slot writes and as many chunks wait for one, the backlog at which a paced save
    encodes, see engine.pacing), and I/O slots per tier."""

    staging_bytes: int = 4 << 30
    window_bytes: int = 256 << 20
    cpu_workers: int = 2
    encoders: int = 2
    io_slots: dict[str, int] = field(default_factory=dict)
    default_io_slots: int = 4
    encoded_ahead: int = 0

    def capacity(self) -> dict[str, int]:
        caps = {"staging": self.staging_bytes, "window": self.window_bytes, "cpu": self.cpu_workers,
                "encode": self.encoders, "encoded": self.encoded_ahead or 2 * self.default_io_slots + self.encoders}
        caps.update({f"io:{tier}": n for tier, n in self.io_slots.items()})
        return caps


@dataclass
class StageStats:
    """Counters of one stage."""

    queued: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    bytes_in_flight: int = 0
    bytes_done: int = 0
    seconds: float = 0.0


class Task:
    """A unit of work in the DAG; `future` holds its result."""

    __slots__ = ("stage", "priority", "fn", "needs", "frees", "deps", "after", "nbytes", "tier", "seq",
                 "future", "failed", "background", "finished", "pending", "dependents", "kind", "owner")

    def __init__(self, stage, priority, fn, needs, frees, deps, after, nbytes, tier, seq, background=False):
        self.stage, self.priority, self.fn = stage, priority, fn
        self.background = background
        self.needs, self.frees, self.deps, self.after = needs, frees, deps, after
        self.nbytes, self.tier, self.seq = nbytes, tier, seq
        self.future: Future = Future()
        self.failed: Task | None = None
        self.finished = False
        self.pending = 0
        self.dependents: list[Task] = []
        self.kind: tuple = ()
        self.owner = None

    def done(self) -> bool:
        """True once the future holds the result (a flag, read without the future's lock)."""
        return self.finished

    def forget(self) -> None:
        """Drop what a finished task no longer needs (its function and the tasks it waited
        for), so that finished work does not stay reachable through later tasks' `after`."""
        self.fn, self.deps, self.after, self.failed = None, [], [], None

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)


def _order(task: Task) -> tuple[int, int]:
    return task.priority, task.seq


def _blocked(kind: tuple, used_up: set) -> bool:
    """True when tasks of `kind` need one of the `used_up` resources (none of them can start)."""
    return any(positive and r in used_up for r, positive in kind)


class _Lane:
    """The ready tasks of one lane (ordinary or background) and the condition its workers sleep
    on. Tasks are kept by the resources they need (`Task.kind`), each kind in priority order,
    so that a pick skips at once every task of a kind whose resource is used up."""

    def __init__(self, lock: threading.Lock):
        self.kinds: dict[tuple, list[Task]] = {}
        self.count = 0
        self.wakeup = threading.Condition(lock)

    def add(self, task: Task) -> None:
        bisect.insort(self.kinds.setdefault(task.kind, []), task, key=_order)
        self.count += 1

    def remove(self, task: Task) -> None:
        tasks = self.kinds[task.kind]
        del tasks[bisect.bisect_left(tasks, _order(task), key=_order)]
        if not tasks:
            del self.kinds[task.kind]
        self.count -= 1

    def may_run(self, used_up: set) -> bool:
        """True when some ready task needs none of the `used_up` resources (one may fit)."""
        return any(not _blocked(kind, used_up) for kind in self.kinds)

    def holds(self, task: Task) -> bool:
        tasks = self.kinds.get(task.kind, ())
        i = bisect.bisect_left(tasks, _order(task), key=_order)
        return i < len(tasks) and tasks[i] is task


class Scheduler:
    """Runs tasks on a fixed set of threads under a Budget. Tasks submitted as `background`
    run only on the background lane, `background_threads` threads of their own, so that such
    work (encoding after a commit) never takes more cores than that, nor a thread a save needs.

    A task waits off the queues until its dependencies finish (each finish releases its own
    dependents), so a pick scans only ready tasks. An event wakes one worker of a lane where a
    ready task may fit, and a worker that takes a task while more may fit wakes the next (not
    every worker per event)."""

    def __init__(self, budget: Budget | None = None, threads: int = 8, name: str = "forkpoint",
                 background_threads: int = 1):
        self.budget = budget or Budget()
        self.capacity = self.budget.capacity()
        self.used: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.stages: dict[str, StageStats] = {}
        self.tiers: dict[str, dict[str, int]] = {}
        self.lock = threading.Lock()
        self.lanes = {False: _Lane(self.lock), True: _Lane(self.lock)}
        self.holders: dict[str, threading.Condition] = {}
        self.idle = threading.Condition(self.lock)
        self.queued = 0
        self.active = 0
        self.seq = 0
        self.batching = 0
        self.closed = False
        self.threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                        for i in range(threads)]
        self.threads += [threading.Thread(target=self._work, args=(True,), name=f"{name}-background-{i}",
                                          daemon=True) for i in range(background_threads)]
        for t in self.threads:
            t.start()

    def _cap(self, resource: str) -> int:
        if resource in self.capacity:
            return self.capacity[resource]
        if resource.startswith("io:"):
            return self.budget.default_io_slots
        raise ValueError(f"unknown resource {resource!r}: use staging, window, cpu, encode, encoded or io:<tier>")

    def limit(self, resource: str) -> int:
        """How much of `resource` tasks may hold at once (ValueError for an unknown one)."""
        return self._cap(resource)

    def submit(self, stage: str, fn: Callable, *, priority: int, needs: dict | None = None,
               frees: dict | None = None, deps=(), after=(), nbytes: int = 0,
               tier: str | None = None, background: bool = False) -> Task:
        """Queue `fn()`; it runs once `deps` succeeded, `after` finished (either way) and `needs` fit
        (on the background lane when `background`).

        A failed dependency fails the task with the same exception without running it.
        """
        needs = dict(needs or {})
        for resource in set(needs) | set(frees or {}):
            self._cap(resource)
        with self.lock:
            if self.closed:
                raise RuntimeError("scheduler is shut down")
            self.seq += 1
            task = Task(stage, int(priority), fn, needs, needs if frees is None else dict(frees),
                        [d for d in deps if d is not None], [a for a in after if a is not None],
                        nbytes, tier, self.seq, background)
            task.owner = self
            foreign = []
            for waited in (*task.deps, *task.after):
                if waited.finished:
                    continue
                task.pending += 1
                if waited.owner is self:
                    waited.dependents.append(task)
                else:
                    foreign.append(waited)
            self.queued += 1
            self.stages.setdefault(stage, StageStats()).queued += 1
            if not task.pending:
                self._make_ready(task)
        for waited in foreign:
            waited.future.add_done_callback(lambda _, task=task: self._settled_elsewhere(task))
        return task

    def _settled_elsewhere(self, task: Task) -> None:
        """One of `task`'s dependencies, a task of another scheduler, finished."""
        with self.lock:
            task.pending -= 1
            if not task.pending:
                self._make_ready(task)

    def _make_ready(self, task: Task) -> None:
        """Queue `task`, whose dependencies have all finished, on its lane (under the lock)."""
        task.failed = next((d for d in task.deps if d.future.exception() is not None), None)
        task.kind = () if task.failed else tuple(sorted((r, n > 0) for r, n in task.needs.items()))
        lane = self.lanes[task.background]
        lane.add(task)
        if not self.batching and not _blocked(task.kind, self._used_up()):
            lane.wakeup.notify()

    @contextmanager
    def batch(self):
        """Submit several tasks and wake the workers once, when the batch ends."""
        with self.lock:
            self.batching += 1
        try:
            yield self
        finally:
            with self.lock:
                self.batching -= 1
                if not self.batching:
                    self._wake_lanes()

    def _wake_lanes(self) -> None:
        """Wake one worker of each lane where a ready task may fit (under the lock)."""
        used_up = self._used_up()
        for lane in self.lanes.values():
            if lane.count and lane.may_run(used_up):
                lane.wakeup.notify()

    def _used_up(self) -> set:
        """The resources of which nothing is left (a task needing any of one cannot start)."""
        return {r for r, n in self.used.items() if n > 0 and n >= self._cap(r)}

    @contextmanager
    def hold(self, resource: str, n: int = 1):
        """Inside a running task: wait until `n` of `resource` fit, hold them for the block
        (a part of a task that needs a resource the rest does not, such as encoding inside
        a write)."""
        self._cap(resource)
        with self.lock:
            freed = self.holders.setdefault(resource, threading.Condition(self.lock))
            while not self._fits({resource: n}):
                freed.wait(0.5)
            self.used[resource] = self.used.get(resource, 0) + n
            self.peak[resource] = max(self.peak.get(resource, 0), self.used[resource])
        try:
            yield
        finally:
            self.release({resource: n})

    def promote(self, tasks) -> None:
        """Move queued background `tasks` to the ordinary lane (something urgent waits for them)."""
        with self.lock:
            for task in tasks:
                if not task.background:
                    continue
                if self.lanes[True].holds(task):
                    self.lanes[True].remove(task)
                    self.lanes[False].add(task)
                task.background = False
            self._wake_lanes()

    def release(self, resources: dict) -> None:
        """Give back resources held beyond a task (e.g. staging after a failed write)."""
        with self.lock:
            self._give_back(resources)

    def _give_back(self, resources: dict) -> None:
        """Return `resources` to the budget and wake those that may now fit (under the lock)."""
        for r, n in resources.items():
            self.used[r] = self.used.get(r, 0) - n
        for r in resources:
            if r in self.holders:
                self.holders[r].notify_all()
        if resources:
            self._wake_lanes()

    def _fits(self, needs: dict) -> bool:
        for r, n in needs.items():
            used, cap = self.used.get(r, 0), self._cap(r)
            if used + n > cap and not (used == 0 and n > cap):
                return False
        return True

    def _pick(self, lane: _Lane) -> Task | None:
        """Take the first ready task, in priority order, that failed or whose needs fit."""
        used_up = self._used_up()
        best = None
        for kind, tasks in lane.kinds.items():
            if _blocked(kind, used_up):
                continue
            for task in tasks:
                if best is not None and _order(task) > _order(best):
                    break
                if task.failed is not None or self._fits(task.needs):
                    best = task
                    break
        if best is not None:
            lane.remove(best)
        return best

    def _work(self, background: bool = False) -> None:
        lane = self.lanes[background]
        while True:
            with self.lock:
                task = None
                while task is None:
                    if self.closed and not self.queued:
                        return
                    task = self._pick(lane)
                    if task is None:
                        # with nothing queued, sleep until a task is: a timed wait would wake
                        # every idle worker of every open repository twice a second
                        lane.wakeup.wait(0.5 if lane.count else None)
                self.queued -= 1
                self.active += 1
                failed = task.failed
                st = self.stages[task.stage]
                st.queued -= 1
                if failed is None:
                    for r, n in task.needs.items():
                        self.used[r] = self.used.get(r, 0) + n
                        self.peak[r] = max(self.peak.get(r, 0), self.used[r])
                    st.running += 1
                    st.bytes_in_flight += task.nbytes
                    if task.tier:
                        tier = self.tiers.setdefault(task.tier, {"bytes_in_flight": 0, "bytes_done": 0})
                        tier["bytes_in_flight"] += task.nbytes
                if lane.count and lane.may_run(self._used_up()):
                    lane.wakeup.notify()
            if failed is not None:
                with self.lock:
                    extra = {r: n - task.needs.get(r, 0) for r, n in task.frees.items()}
                    self._give_back({r: n for r, n in extra.items() if n > 0})
                    st.failed += 1
                task.forget()
                self._finish(task, None, failed.future.exception())
                continue
            start = time.perf_counter()
            try:
                result, error = task.fn(), None
            except BaseException as e:  # delivered through the future
                result, error = None, e
            elapsed = time.perf_counter() - start
            with self.lock:
                self._give_back(task.frees)
                st.running -= 1
                st.bytes_in_flight -= task.nbytes
                st.seconds += elapsed
                if error is None:
                    st.done += 1
                    st.bytes_done += task.nbytes
                else:
                    st.failed += 1
                if task.tier:
                    tier = self.tiers[task.tier]
                    tier["bytes_in_flight"] -= task.nbytes
                    if error is None:
                        tier["bytes_done"] += task.nbytes
            task.forget()
            self._finish(task, result, error)

    def _finish(self, task: Task, result, error) -> None:
        """Settle `task`'s future, then release the dependents it held back (a dependent is
        ready only once its dependencies' futures are set)."""
        if error is None:
            task.future.set_result(result)
        else:
            task.future.set_exception(error)
        with self.lock:
            task.finished = True
            for dependent in task.dependents:
                dependent.pending -= 1
                if not dependent.pending:
                    self._make_ready(dependent)
            task.dependents = []
            self.active -= 1
            if not self.queued and not self.active:
                self.idle.notify_all()
                if self.closed:
                    for lane in self.lanes.values():
                        lane.wakeup.notify_all()

    def stats(self) -> dict:
        """Return queue depths, bytes in flight and time per stage and per tier, and resource use."""
        with self.lock:
            return {
                "stages": {name: vars(st).copy() for name, st in self.stages.items()},
                "tiers": {name: dict(t) for name, t in self.tiers.items()},
                "resources": {r: {"used": self.used.get(r, 0), "peak": self.peak.get(r, 0),
                                  "capacity": self._cap(r)}
                              for r in set(self.capacity) | set(self.used)},
                "queued": self.queued,
            }

    def drain(self) -> None:
        """Block until no task is queued or running (tasks may queue more while it waits)."""
        with self.lock:
            while self.queued or self.active:
                self.idle.wait(0.5)

    def shutdown(self, wait: bool = True) -> None:
        """Finish queued tasks (and those they queue), then stop the threads."""
        if wait:
            self.drain()
        with self.lock:
            self.closed = True
            for lane in self.lanes.values():
                lane.wakeup.notify_all()
            for freed in self.holders.values():
                freed.notify_all()
        if wait:
            for t in self.threads:
                t.join()
