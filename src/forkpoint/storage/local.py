"""Local POSIX store: temp file + fsync + rename, directory fsync as the durability barrier."""

import errno
import itertools
import mmap
import os
import re
import threading
import time
import uuid
from typing import Callable, Iterable, Sequence

import numpy as np

from ..errors import StorageFullError, UnsafePathError
from .base import Store

_FULL = (errno.ENOSPC, errno.EDQUOT)
BLOCK = 4096
DIRECT_PIECE = 16 << 20
DIRECT_VIEWS = 64  # views per pwritev (well under IOV_MAX)
DIRECT_BOUNCE = 4 << 20
DIRECT_MIN = 1 << 20


def _address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view, np.uint8).__array_interface__["data"][0] if view.nbytes else 0


def direct_eligible(parts) -> bool:
    """True when `parts` are worth writing with O_DIRECT: at least 1 MiB in all (smaller
    files gain nothing from bypassing the page cache)."""
    return sum(memoryview(p).nbytes for p in parts) >= DIRECT_MIN


_BOUNCE = threading.local()


def _bounce() -> memoryview:
    """This thread's page-aligned buffer for parts that cannot go to disk from where they lie
    (reused: fresh pages cost more than the copy)."""
    buf = getattr(_BOUNCE, "buf", None)
    if buf is None:
        buf = _BOUNCE.buf = memoryview(mmap.mmap(-1, DIRECT_BOUNCE))
    return buf


def _copy(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src, by numpy, which lets go of the GIL for the copy (a slice assignment of
    memoryviews holds it: the encoded objects of a save all pass through the bounce buffer,
    and the codec's threads waited for the GIL meanwhile)."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class _DirectFile:
    """Bytes appended to a file opened with O_DIRECT. Block-aligned runs of page-aligned memory
    at block-aligned file offsets go to disk as they lie; everything else is gathered through
    this thread's aligned bounce buffer. Both are queued and written by one pwritev per file
    stretch of up to DIRECT_PIECE bytes (a few large requests, not one per part); the last
    block is zero-padded and the file then cut to its length."""

    def __init__(self, fd: int):
        self.fd = fd
        self.bounce = _bounce()
        self.pos = self.written = 0
        self.start = self.fill = 0  # bounce[start:start + fill] is gathered, not yet queued
        self.queued: list[memoryview] = []
        self.queued_at = self.queued_bytes = 0

    def add(self, view: memoryview) -> None:
        while view.nbytes:
            whole = view.nbytes - view.nbytes % BLOCK
            if whole and self.pos % BLOCK == 0 and _address(view) % BLOCK == 0:
                self._queue_gathered()
                self._queue(view[:whole], self.pos)
            else:
                if self.start + self.fill == self.bounce.nbytes:
                    self._queue_gathered()
                    self._flush()
                    self.start = 0
                at = self.start + self.fill
                whole = min(view.nbytes, self.bounce.nbytes - at)
                _copy(self.bounce[at:at + whole], view[:whole])
                self.fill += whole
            view = view[whole:]
            self.pos += whole

    def finish(self) -> None:
        """Write what is queued and gathered (the last block zero-padded, the file cut back)."""
        tail = self.fill % BLOCK
        if tail:
            at = self.start + self.fill
            self.bounce[at:at + BLOCK - tail] = bytes(BLOCK - tail)
            self.fill += BLOCK - tail
            self.pos += BLOCK - tail
        self._queue_gathered()
        self._flush()
        if tail:
            os.ftruncate(self.fd, self.pos - BLOCK + tail)

    def _queue_gathered(self) -> None:
        """Queue the gathered bounce bytes (whole blocks: they began at an aligned offset)."""
        if self.fill:
            self._queue(self.bounce[self.start:self.start + self.fill], self.pos - self.fill)
            self.start += self.fill
            self.fill = 0

    def _queue(self, view: memoryview, offset: int) -> None:
        if self.queued and (offset != self.queued_at + self.queued_bytes or len(self.queued) >= DIRECT_VIEWS
                            or self.queued_bytes + view.nbytes > DIRECT_PIECE):
            self._flush()
        if not self.queued:
            self.queued_at = offset
        while view.nbytes:
            piece = view[:DIRECT_PIECE - self.queued_bytes]
            self.queued.append(piece)
            self.queued_bytes += piece.nbytes
            view = view[piece.nbytes:]
            if view.nbytes:
                self._flush()
                self.queued_at = offset = offset + piece.nbytes

    def _flush(self) -> None:
        done = 0
        views = self.queued
        while done < self.queued_bytes:
            done += os.pwritev(self.fd, views, self.queued_at + done)
            views = _after(self.queued, done)
        self.written += done
        self.queued, self.queued_bytes = [], 0


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """`views` less their first `skip` bytes."""
    for i, view in enumerate(views):
        if skip < view.nbytes:
            return [view[skip:], *views[i + 1:]]
        skip -= view.nbytes
    return []


_TEMP_RUN = uuid.uuid4().hex[:16]
_TEMP_COUNT = itertools.count()


TEMP_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]+-[0-9a-f]+")
"""What _temp_name gives: a file under tmp/ not of this form is not a writer's temp file."""


def _temp_name() -> str:
    """A temporary file name unique across processes and hosts: this import's random run id,
    the process id (forked children share the run id) and a counter (no syscall for
    randomness per object)."""
    return f"{_TEMP_RUN}-{os.getpid():x}-{next(_TEMP_COUNT):x}"


_INFLIGHT: set[str] = set()
_INFLIGHT_LOCK = threading.Lock()


def _settled(tmp: str) -> None:
    with _INFLIGHT_LOCK:
        _INFLIGHT.discard(tmp)


class LocalStore(Store):
    """Objects are files under `root`; temp files live in `root/tmp`."""

    def __init__(self, root: str, direct_io: bool = True):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self._real_root: str | None = None
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._made_dirs: set[str] = set()

    @property
    def aligned_writes(self) -> bool:
        return self.direct_io

    def _in_dir(self, directory: str, action: Callable):
        """`action()` with `directory` made (once per store); run once more, with the directory
        made again, when it fails because something it needs is gone (the directory wiped by
        another process; another thread may have made it again already)."""
        if directory not in self._made_dirs:
            self._make_dir(directory)
        try:
            return action()
        except FileNotFoundError:
            self._made_dirs.discard(directory)
            self._make_dir(directory)
            return action()

    def _make_dir(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self._made_dirs.add(directory)

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"refusing unsafe storage key {key!r}")
        return os.path.join(self.root, key)

    def _contained(self, path: str) -> str:
        """`path` when the directory it names a file in resolves inside the root (no symlink
        leads out of the repository); else UnsafePathError. Deletes and replacing writes go
        through here, so that no maintenance pass removes or overwrites files elsewhere."""
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        where = os.path.realpath(os.path.dirname(path))
        if where != self._real_root and not where.startswith(self._real_root + os.sep):
            raise UnsafePathError(
                f"{path} lies outside the repository {self.root} (a symlink in the path leads to {where}); "
                "forkpoint does not write or delete there: replace the symlink by a directory")
        return path

    def read(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        fd = os.open(self._path(key), os.O_RDONLY)
        try:
            done = 0
            while done < buf.nbytes:
                n = os.preadv(fd, [buf[done:]], offset + done)
                if n == 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        return os.stat(self._path(key)).st_size

    def map(self, key: str, offset: int, length: int | None) -> memoryview | None:
        """A copy-on-write memory map of part of a file (the page cache, or /dev/shm, shared)."""
        with open(self._path(key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = size - offset if length is None else length
            if size < offset + length or length <= 0:
                return None
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return memoryview(mapped)[offset:offset + length]

    def _write_direct(self, tmp: str, parts: Sequence) -> bool:
        """Write `parts` with O_DIRECT and fsync; False if the file system refuses O_DIRECT
        (see _DirectFile; one fsync makes data and length durable)."""
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno == errno.EINVAL:
                self.direct_io = False
                return False
            raise
        out = _DirectFile(fd)
        try:
            for part in parts:
                out.add(memoryview(part).cast("B"))
            out.finish()
            os.fsync(fd)
        except OSError as e:
            if e.errno != errno.EINVAL or out.written:
                raise
            os.close(fd)
            fd = -1
            os.unlink(tmp)
            self.direct_io = False
            return False
        finally:
            if fd >= 0:
                os.close(fd)
        return True

    def _write_temp(self, parts: Sequence, durable: bool) -> str:
        """Write `parts` to a new temp file and return its path, registered as in flight
        (the caller unregisters it with `_settled` once renamed or removed)."""
        tmp_dir = os.path.join(self.root, "tmp")
        return self._in_dir(tmp_dir, lambda: self._write_temp_in(tmp_dir, parts, durable))

    def _write_temp_in(self, tmp_dir: str, parts: Sequence, durable: bool) -> str:
        tmp = os.path.join(tmp_dir, _temp_name())
        with _INFLIGHT_LOCK:
            _INFLIGHT.add(tmp)
        try:
            if self.direct_io and durable and direct_eligible(parts) and self._write_direct(tmp, parts):
                return tmp
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view.nbytes:
                        view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            _remove_quietly(tmp)
            _settled(tmp)
            if e.errno in _FULL:
                raise StorageFullError(
                    f"no space left on the device holding {self.root}; nothing was committed. "
                    "Free space (or run `forkpoint gc`) and save again"
                ) from e
            raise
        return tmp

    def write(self, key: str, parts: Sequence, durable: bool = True) -> None:
        path = self._contained(self._path(key))
        tmp = self._write_temp(parts, durable)
        try:
            self._in_dir(os.path.dirname(path), lambda: os.replace(tmp, path))
        finally:
            _settled(tmp)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._write_temp([data], True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            _remove_quietly(tmp)
            _settled(tmp)
        self.barrier([key])
        return True

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if prefix and os.path.lexists(base):
            self._contained(os.path.join(base, "."))
        out = []
        for dirpath, _, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            for name in files:
                out.append(name if rel == "." else f"{rel}/{name}")
        return sorted(k.replace(os.sep, "/") for k in out)

    def delete(self, key: str) -> None:
        """Remove `key`; a temp file this process is still writing is left alone (gc with a
        short grace period runs beside saves of the same process)."""
        path = self._path(key)
        with _INFLIGHT_LOCK:
            if path in _INFLIGHT:
                return
        self._contained(path)
        _remove_quietly(path)

    def mtime(self, key: str) -> float:
        return os.stat(self._path(key)).st_mtime

    def signature(self, key: str) -> tuple:
        st = os.stat(self._path(key))
        return st.st_mtime_ns, st.st_size, st.st_ino

    def touch(self, key: str) -> None:
        now = time.time()
        os.utime(self._path(key), (now, now))

    def barrier(self, keys: Iterable[str]) -> None:
        dirs = {os.path.dirname(self._path(k)) for k in keys}
        for d in sorted(dirs, key=len, reverse=True):
            _fsync_dir(d)
        for d in {os.path.dirname(d) for d in dirs}:
            _fsync_dir(d)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
