"""Device-to-host capture: accelerator tensors are copied into reused pinned host buffers on a
side stream, so neither the host nor the caller's stream waits for the copy.

A `DeviceCopy` is the copy of one leaf in flight. Its reader calls `wait()` (the host blocks
until the bytes are on the host); a hook about to overwrite the live tensor calls `order()`
(work queued afterwards on the caller's stream runs after the copy, nothing blocks). A
deferred copy is launched later in the same save with the byte ranges the process will
read (a rank of a distributed save writes only part of each replicated tensor).
"""

import threading

from ..storage.memory import drop_free


class PinnedPool:
    """Page-locked uint8 host tensors under one byte limit, kept by exact size and reused
    (pinning memory costs far more than copying into it)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.free: dict[int, list] = {}
        self.held = 0
        self.lock = threading.Lock()

    def get(self, nbytes: int):
        """A pinned buffer of exactly `nbytes`, or None when the limit does not allow one."""
        import torch

        with self.lock:
            bucket = self.free.get(nbytes)
            if bucket:
                return bucket.pop()
            if self.held + nbytes > self.limit:
                self._trim(self.limit - nbytes)
                if self.held + nbytes > self.limit:
                    return None
            self.held += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buf) -> None:
        """Return a buffer for reuse."""
        with self.lock:
            self.free.setdefault(buf.numel(), []).append(buf)

    def _trim(self, keep: int) -> None:
        self.held = drop_free(self.free, self.held, keep)

    def clear(self) -> None:
        """Drop every free buffer."""
        with self.lock:
            self._trim(0)


class DeviceCopy:
    """One tensor's copy to a pinned host buffer, queued on a side stream (`launch`)."""

    def __init__(self, host, source, stream, pool: PinnedPool):
        self.host, self.source, self.stream, self.pool = host, source, stream, pool
        self.device = source.device
        self.event = None
        self._released = False

    def launch(self, ranges=None) -> None:
        """Queue the copy of byte ranges [(lo, hi)] of the source (all of it when None) after
        the work already queued on its device's current stream."""
        import torch

        src, self.source = self.source, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            whole = src.reshape(-1).view(torch.uint8)
            for lo, hi in [(0, whole.numel())] if ranges is None else ranges:
                if hi > lo:
                    self.host[lo:hi].copy_(whole[lo:hi], non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        src.record_stream(self.stream)

    @property
    def launched(self) -> bool:
        return self.event is not None

    def done(self) -> bool:
        """True once the bytes are on the host."""
        return self.event.query()

    def wait(self) -> None:
        """Block the calling thread until the bytes are on the host."""
        self.event.synchronize()

    result = wait

    def order(self) -> None:
        """Make work queued later on the device's current stream wait for this copy (the host
        does not block)."""
        import torch

        torch.cuda.current_stream(self.device).wait_event(self.event)

    def release(self) -> None:
        """Give the host buffer back to the pool once the copy is over (idempotent; a copy
        never launched copies nothing)."""
        if not self._released:
            self._released = True
            if self.event is None:
                self.launch([])
            self.wait()
            self.pool.give(self.host)


class DeviceCapture:
    """Copies CUDA tensors to pinned host memory on one side stream per device."""

    def __init__(self, limit: int):
        self.pool = PinnedPool(limit)
        self._streams: dict = {}

    def copy(self, src, deferred: bool = False) -> DeviceCopy | None:
        """Queue the copy of contiguous CUDA tensor `src` after the work already queued on its
        device's current stream (`deferred`: leave it to the caller's `launch`, with ranges);
        None when it is not a CUDA tensor or no pinned buffer fits."""
        import torch

        if src.device.type != "cuda" or not src.numel():
            return None
        host = self.pool.get(src.numel() * src.element_size())
        if host is None:
            return None
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = torch.cuda.Stream(src.device)
        copy = DeviceCopy(host, src, stream, self.pool)
        if not deferred:
            copy.launch()
        return copy

    def deferring(self) -> "DeferredCapture":
        """A stand-in for this capture whose copies wait for `launch` (see launch_selected)."""
        return DeferredCapture(self)

    def clear(self) -> None:
        """Drop the pinned buffers not in use."""
        self.pool.clear()


class DeferredCapture:
    """Passed to flatten in place of a DeviceCapture: allocates each copy, launches none."""

    def __init__(self, capture: DeviceCapture):
        self.capture = capture

    def copy(self, src) -> DeviceCopy | None:
        return self.capture.copy(src, deferred=True)
