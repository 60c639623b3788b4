"""The scheduler: one task DAG with resource budgets, priorities and back-pressure.

Every stage of a save or restore (capture, write, commit, flush, prefetch, evict, gc) is a
task. A task starts when its dependencies are done and the resources it `needs` fit the
budget; it gives back `frees` when it ends (default: what it took), so a resource such as
staging memory can be held from a capture until the write that empties it.
"""

import bisect
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


@dataclass
class Budget:
    """Limits: staging memory for asynchronous saves, the streaming window of synchronous ones
    (bytes), CPU workers, chunks encoded at once (held inside write tasks, see
    Scheduler.hold), and I/O slots per tier."""

    staging_bytes: int = 4 << 30
    window_bytes: int = 256 << 20
    cpu_workers: int = 2
    encoders: int = 2
    io_slots: dict[str, int] = field(default_factory=dict)
    default_io_slots: int = 4

    def capacity(self) -> dict[str, int]:
        caps = {"staging": self.staging_bytes, "window": self.window_bytes, "cpu": self.cpu_workers,
                "encode": self.encoders}
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
                 "future", "ready", "failed", "background", "finished")

    def __init__(self, stage, priority, fn, needs, frees, deps, after, nbytes, tier, seq, background=False):
        self.stage, self.priority, self.fn = stage, priority, fn
        self.background = background
        self.needs, self.frees, self.deps, self.after = needs, frees, deps, after
        self.nbytes, self.tier, self.seq = nbytes, tier, seq
        self.future: Future = Future()
        self.ready = False
        self.failed: Task | None = None
        self.finished = False

    def done(self) -> bool:
        """True once the future holds the result (a flag: the scheduler asks it of every
        waiting task's dependencies at each pick, where the future's lock cost the GIL)."""
        return self.finished

    def forget(self) -> None:
        """Drop what a finished task no longer needs (its function and the tasks it waited
        for), so that finished work does not stay reachable through later tasks' `after`."""
        self.fn, self.deps, self.after, self.failed = None, [], [], None

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)


class Scheduler:
    """Runs tasks on a fixed set of threads under a Budget. Tasks submitted as `background`
    run only on the background lane, `background_threads` threads of their own, so that such
    work (encoding after a commit) never takes more cores than that, nor a thread a save needs."""

    def __init__(self, budget: Budget | None = None, threads: int = 8, name: str = "forkpoint",
                 background_threads: int = 1):
        self.budget = budget or Budget()
        self.capacity = self.budget.capacity()
        self.used: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.queue: list[Task] = []
        self.stages: dict[str, StageStats] = {}
        self.tiers: dict[str, dict[str, int]] = {}
        self.cond = threading.Condition()
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
        raise ValueError(f"unknown resource {resource!r}: use staging, window, cpu, encode or io:<tier>")

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
        with self.cond:
            if self.closed:
                raise RuntimeError("scheduler is shut down")
            self.seq += 1
            task = Task(stage, int(priority), fn, needs, needs if frees is None else dict(frees),
                        [d for d in deps if d is not None], [a for a in after if a is not None],
                        nbytes, tier, self.seq, background)
            bisect.insort(self.queue, task, key=lambda t: (t.priority, t.seq))
            st = self.stages.setdefault(stage, StageStats())
            st.queued += 1
            if not self.batching:
                self.cond.notify_all()
        return task

    @contextmanager
    def batch(self):
        """Submit several tasks and wake the workers once, when the batch ends (submitting many
        tasks one wake-up at a time makes every worker contend for the queue lock)."""
        with self.cond:
            self.batching += 1
        try:
            yield self
        finally:
            with self.cond:
                self.batching -= 1
                if not self.batching:
                    self.cond.notify_all()

    @contextmanager
    def hold(self, resource: str, n: int = 1):
        """Inside a running task: wait until `n` of `resource` fit, hold them for the block
        (a part of a task that needs a resource the rest does not, such as encoding inside
        a write)."""
        self._cap(resource)
        with self.cond:
            while not self._fits({resource: n}):
                self.cond.wait(0.5)
            self.used[resource] = self.used.get(resource, 0) + n
            self.peak[resource] = max(self.peak.get(resource, 0), self.used[resource])
        try:
            yield
        finally:
            self.release({resource: n})

    def promote(self, tasks) -> None:
        """Move queued background `tasks` to the ordinary lane (something urgent waits for them)."""
        with self.cond:
            for task in tasks:
                task.background = False
            self.cond.notify_all()

    def release(self, resources: dict) -> None:
        """Give back resources held beyond a task (e.g. staging after a failed write)."""
        with self.cond:
            for r, n in resources.items():
                self.used[r] = self.used.get(r, 0) - n
            self.cond.notify_all()

    def _fits(self, needs: dict) -> bool:
        for r, n in needs.items():
            used, cap = self.used.get(r, 0), self._cap(r)
            if used + n > cap and not (used == 0 and n > cap):
                return False
        return True

    def _pick(self, background: bool = False) -> Task | None:
        for i, task in enumerate(self.queue):
            if task.background != background:
                continue
            if not task.ready:
                if any(not d.done() for d in task.deps) or any(not a.done() for a in task.after):
                    continue
                task.ready = True
                task.failed = next((d for d in task.deps if d.future.exception() is not None), None)
            if task.failed is not None or self._fits(task.needs):
                return self.queue.pop(i)
        return None

    def _work(self, background: bool = False) -> None:
        while True:
            with self.cond:
                task = None
                while task is None:
                    if self.closed and not self.queue:
                        return
                    task = self._pick(background)
                    if task is None:
                        self.cond.wait(0.5)
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
            if failed is not None:
                with self.cond:
                    for r, n in task.frees.items():
                        extra = n - task.needs.get(r, 0)
                        if extra > 0:
                            self.used[r] = self.used.get(r, 0) - extra
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
            with self.cond:
                for r, n in task.frees.items():
                    self.used[r] = self.used.get(r, 0) - n
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
        """Settle `task`'s future, then wake the workers (a dependent is ready only once its
        dependencies' futures are set: waking them before left it to the next event)."""
        if error is None:
            task.future.set_result(result)
        else:
            task.future.set_exception(error)
        task.finished = True
        with self.cond:
            self.cond.notify_all()

    def stats(self) -> dict:
        """Return queue depths, bytes in flight and time per stage and per tier, and resource use."""
        with self.cond:
            return {
                "stages": {name: vars(st).copy() for name, st in self.stages.items()},
                "tiers": {name: dict(t) for name, t in self.tiers.items()},
                "resources": {r: {"used": self.used.get(r, 0), "peak": self.peak.get(r, 0),
                                  "capacity": self._cap(r)}
                              for r in set(self.capacity) | set(self.used)},
                "queued": len(self.queue),
            }

    def drain(self) -> None:
        """Block until no task is queued or running (tasks may queue more while it waits)."""
        with self.cond:
            while self.queue or any(st.running for st in self.stages.values()):
                self.cond.wait(0.5)

    def shutdown(self, wait: bool = True) -> None:
        """Finish queued tasks (and those they queue), then stop the threads."""
        if wait:
            self.drain()
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if wait:
            for t in self.threads:
                t.join()
