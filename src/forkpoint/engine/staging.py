"""Staging buffers: host memory that captures copy into, reused across saves.

Fresh memory costs page faults that are slower than the copy itself, so buffers are kept
by exact size and handed out again. Buffers handed out plus buffers kept never exceed
`limit` bytes (the scheduler's staging budget bounds what is handed out).
"""

import threading

import numpy as np

from ..storage.memory import aligned_buffer, drop_free


class StagingPool:
    """Reusable uint8 buffers under one byte limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.free: dict[int, list[np.ndarray]] = {}
        self.kept = 0
        self.outstanding = 0
        self.lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        """Return a buffer of exactly `nbytes`, reusing a free one of that size if any."""
        with self.lock:
            self.outstanding += nbytes
            bucket = self.free.get(nbytes)
            if bucket:
                self.kept -= nbytes
                return bucket.pop()
            self._trim(max(0, self.limit - self.outstanding))
        return aligned_buffer(nbytes)

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer; it is kept for reuse while the limit allows."""
        with self.lock:
            self.outstanding -= buf.nbytes
            if self.kept + self.outstanding + buf.nbytes <= self.limit:
                self.free.setdefault(buf.nbytes, []).append(buf)
                self.kept += buf.nbytes

    def warm(self, sizes: list[int]) -> int:
        """Allocate and touch buffers of these sizes ahead of use (within the limit); return bytes."""
        bufs, total = [], 0
        for n in sizes:
            if self.kept + self.outstanding + total + n > self.limit:
                break
            buf = self.get(n)
            buf.fill(0)
            bufs.append(buf)
            total += n
        for buf in bufs:
            self.give(buf)
        return total

    def _trim(self, keep: int) -> None:
        self.kept = drop_free(self.free, self.kept, keep)

    def clear(self) -> None:
        """Drop every kept buffer."""
        with self.lock:
            self._trim(0)
