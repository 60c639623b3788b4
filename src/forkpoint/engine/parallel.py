"""Helper threads for the data-parallel part of one scheduler task: hashing a chunk's blocks,
encoding or decoding its segments. The pure layers below (format/) take a `pmap` argument
and never start threads; the engine passes `parallel_map`.

The calling thread works through the items too, so a call never waits for helpers busy
with other calls, and nested calls cannot deadlock. Helpers are daemon threads: nothing at
interpreter exit waits for them, and they keep serving the saves a repository finishes then.
"""

import os
import queue
import threading

HELPERS = max(0, min(8, os.cpu_count() or 1) - 1)
"""Helper threads in this process (with the caller, at most 8 threads work on one call)."""


class _Batch:
    """One call's items, taken one at a time by whichever thread is free."""

    def __init__(self, fn, items: list):
        self.fn, self.items = fn, items
        self.results: list = [None] * len(items)
        self.taken = 0
        self.left = len(items)
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.done = threading.Event()

    def work(self) -> None:
        while True:
            with self.lock:
                i = self.taken
                if i >= len(self.items):
                    return
                self.taken += 1
            try:
                result = self.fn(self.items[i])
            except BaseException as e:  # the caller re-raises it
                result = None
                self.error = self.error or e
            with self.lock:
                self.results[i] = result
                self.left -= 1
                if self.left == 0:
                    self.done.set()


class HelperThreads:
    """`count` daemon threads started on first use; `map(fn, items)` is `list(map(fn, items))`
    computed by the caller and up to `width` helpers at once."""

    def __init__(self, count: int):
        self.count = count
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def map(self, fn, items, width: int | None = None) -> list:
        items = list(items)
        helpers = min(self.count if width is None else width - 1, len(items) - 1)
        if helpers <= 0:
            return [fn(x) for x in items]
        self._start()
        batch = _Batch(fn, items)
        for _ in range(helpers):
            self._queue.put(batch)
        batch.work()
        batch.done.wait()
        if batch.error is not None:
            raise batch.error
        return batch.results

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            for i in range(self.count):
                threading.Thread(target=self._serve, name=f"forkpoint-helper-{i}", daemon=True).start()
            self._started = True

    def _serve(self) -> None:
        while True:
            self._queue.get().work()


_HELPERS = HelperThreads(HELPERS)


def parallel_map(fn, items, width: int | None = None) -> list:
    """`list(map(fn, items))` computed by this thread and the process's helper threads (at
    most `width` threads in all)."""
    return _HELPERS.map(fn, items, width)


def pmap_of(threads: int | None):
    """The `pmap` argument of format/'s functions for work on at most `threads` threads (None
    or 1: serial; None is also what they take for serial)."""
    if threads is None or threads <= 1:
        return None
    return lambda fn, items: parallel_map(fn, items, width=threads)
