"""In-process memory store (`mem://name`): fast, volatile, shared by name within a process."""

import mmap
import sys
import threading
import time
from typing import Iterable, Sequence

import numpy as np

from .base import Store
from .streamcopy import stream_copy


LARGE_BYTES = 1 << 20


def _available_bytes() -> int | None:
    """Memory the system can still give processes (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def drop_free(free: dict, total: int, keep: int) -> int:
    """Drop buffers from `free` ({size: [buffers]}), largest first, until `total` (the bytes
    it counts, the dropped ones included) is at most `keep`; return the new total."""
    for size in sorted(free, reverse=True):
        bucket = free[size]
        while bucket and total > keep:
            bucket.pop()
            total -= size
    return total


def aligned_buffer(nbytes: int, huge_pages: bool = False) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous memory mapping: direct I/O can write it), in huge
    pages where asked and the kernel has them (fewer faults on first touch)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.uint8)


def _aligned(size: int) -> np.ndarray:
    return aligned_buffer(size, huge_pages=True)


SPARE_BYTES = 4 << 30


class MemoryStore(Store):
    """A dict of bytes (page-aligned numpy buffers above 1 MiB) guarded by a lock. Trusted: an object enters only through forkpoint's
    writers, which hash what they store, or through a tier copy, which verifies it first."""

    trusted = True
    adopts_buffers = True
    paces_encoding = False

    _named: dict[str, "MemoryStore"] = {}
    _named_lock = threading.Lock()

    def __init__(self, name: str = ""):
        self.url = f"mem://{name}"
        self._data: dict[str, bytes] = {}
        self._mtime: dict[str, float] = {}
        self._lock = threading.Lock()
        self._spare: dict[int, list[np.ndarray]] = {}
        self._spare_bytes = 0
        self._held = 0
        self._peak = 0
        self._reserved = 0
        self._opens = 0

    @classmethod
    def named(cls, name: str) -> "MemoryStore":
        """Return the process-wide store called `name`, creating it on first use; each call
        counts as one open, which `close` ends."""
        with cls._named_lock:
            if name not in cls._named:
                cls._named[name] = cls(name)
            store = cls._named[name]
            store._opens += 1
            return store

    @classmethod
    def discard(cls, name: str) -> None:
        """Forget the process-wide store called `name`: a later `mem://name` starts empty, and
        its objects are freed once no open repository holds the store."""
        with cls._named_lock:
            cls._named.pop(name, None)

    def close(self) -> None:
        """End one open; after the last, drop the spare buffers kept for saves (the objects
        stay, for the next repository opened on the same name)."""
        with self._named_lock:
            self._opens = max(0, self._opens - 1)
            if self._opens:
                return
        with self._lock:
            self._spare.clear()
            self._spare_bytes = 0
            self._reserved = 0
            self._peak = self._held

    def _get(self, key: str) -> bytes:
        try:
            return self._data[key]
        except KeyError:
            raise FileNotFoundError(f"{self.url}/{key}") from None

    def read(self, key: str) -> bytes | memoryview:
        data = self._get(key)
        return memoryview(data) if isinstance(data, np.ndarray) else data

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        data = np.frombuffer(self._get(key), np.uint8)[offset:offset + buf.nbytes]
        stream_copy(np.frombuffer(buf, np.uint8)[:data.nbytes], data)
        return data.nbytes

    def size(self, key: str) -> int:
        return self._get(key).__len__()

    def write(self, key: str, parts: Sequence, durable: bool = True) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        if total < LARGE_BYTES:
            self._put(key, b"".join(views))
            return
        blob = self._recycled(total)
        pos = 0
        for v in views:
            stream_copy(blob[pos:pos + v.nbytes], np.frombuffer(v, np.uint8))
            pos += v.nbytes
        self._put(key, blob)

    def object_buffer(self, nbytes: int) -> np.ndarray | None:
        return self._recycled(nbytes) if nbytes >= LARGE_BYTES else None

    def adopt(self, key: str, buffer: np.ndarray) -> None:
        self._put(key, buffer)

    def release_buffer(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._keep_spare(buffer)

    def reserve(self, sizes: Iterable[int]) -> int:
        """Fault in buffers of these sizes, while they fit in half of the memory the system
        has available (a reservation must not be what pushes the machine into swap or the
        OOM killer); return the bytes reserved."""
        available = _available_bytes()
        room = float("inf") if available is None else available // 2
        buffers = []
        for n in sizes:
            if LARGE_BYTES <= n <= room:
                buffers.append(_aligned(n))
                buffers[-1].fill(0)
                room -= n
        reserved = sum(b.nbytes for b in buffers)
        with self._lock:
            self._reserved += reserved
            for buffer in buffers:
                self._add_spare(buffer)
        return reserved

    def _put(self, key: str, blob) -> None:
        if isinstance(blob, np.ndarray):
            blob.flags.writeable = False
        with self._lock:
            old = self._data.get(key)
            self._data[key] = blob
            self._mtime[key] = time.time()
            if isinstance(blob, np.ndarray):
                self._held += blob.nbytes
                self._peak = max(self._peak, self._held)
            if isinstance(old, np.ndarray):
                self._held -= old.nbytes

    def create_exclusive(self, key: str, data: bytes) -> bool:
        with self._lock:
            if key in self._data:
                return False
            self._data[key] = bytes(data)
            self._mtime[key] = time.time()
            return True

    def exists(self, key: str) -> bool:
        return key in self._data

    def list(self, prefix: str) -> list[str]:
        with self._lock:
            keys = list(self._data)
        p = prefix.rstrip("/") + "/" if prefix else ""
        return sorted(k for k in keys if k.startswith(p))

    def delete(self, key: str) -> None:
        with self._lock:
            blob = self._data.pop(key, None)
            self._mtime.pop(key, None)
            if isinstance(blob, np.ndarray):
                self._held -= blob.nbytes
                if sys.getrefcount(blob) <= 2:
                    self._keep_spare(blob)

    def _keep_spare(self, blob: np.ndarray) -> None:
        """Keep a freed buffer for reuse (call with the lock held) while the spare buffers stay
        within 4 GiB, the store's peak or what was reserved, whichever is more."""
        if self._spare_bytes + blob.nbytes <= max(SPARE_BYTES, self._peak - self._held, self._reserved):
            self._add_spare(blob)

    def _add_spare(self, blob: np.ndarray) -> None:
        self._spare.setdefault(blob.nbytes, []).append(blob)
        self._spare_bytes += blob.nbytes

    def _recycled(self, size: int) -> np.ndarray:
        """A writable buffer of `size` bytes: one freed by delete (already faulted in, so
        storing a version every step does not pay for fresh pages), else a new one. Freed
        buffers are kept up to 4 GiB, or up to what the store held at its peak, whichever is
        more: reusing them never takes the store above that peak."""
        with self._lock:
            free = self._spare.get(size)
            if free:
                self._spare_bytes -= size
                blob = free.pop()
                blob.flags.writeable = True
                return blob
        return _aligned(size)

    def mtime(self, key: str) -> float:
        self._get(key)
        return self._mtime[key]

    def signature(self, key: str) -> tuple:
        with self._lock:
            blob = self._get(key)
            return id(blob), len(blob), self._mtime[key]

    def touch(self, key: str) -> None:
        with self._lock:
            if key in self._data:
                self._mtime[key] = time.time()
