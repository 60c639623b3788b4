"""What a store's raw writes are doing: bytes in flight, and the write bandwidth measured over
the time they were in flight (codec="auto" weighs encoding against it)."""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

MIN_MEASURED_BYTES = 8 << 20
DECAY = 0.9


@dataclass
class WriteMeter:
    """Writes in flight to one store and its bandwidth while busy. A busy period runs while at
    least one write is in flight; its rate is the bytes finished (plus half of those still in
    flight) over its length, once MIN_MEASURED_BYTES were written. `bandwidth` is the best
    rate seen, decaying by DECAY per later period (a save slowed by its own encoders does
    not make the store look slow; a store that did get slower is believed within a few
    saves); None until measured."""

    best: float | None = None
    inflight: int = 0
    active: int = 0
    busy_since: float = 0.0
    busy_bytes: int = 0
    running: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def bandwidth(self) -> float | None:
        """Write bandwidth in bytes/s (None until measured)."""
        rates = [r for r in (self.best, self.running) if r is not None]
        return max(rates) if rates else None

    def start(self, nbytes: int) -> None:
        """Count a write of `nbytes` as in flight."""
        with self.lock:
            if self.active == 0:
                self.busy_since, self.busy_bytes, self.running = time.perf_counter(), 0, None
            self.active += 1
            self.inflight += nbytes

    def finish(self, nbytes: int, done: bool = True) -> None:
        """Count a write started with `start(nbytes)` as over (`done`: its bytes were written)."""
        with self.lock:
            self.active -= 1
            self.inflight -= nbytes
            self.busy_bytes += nbytes if done else 0
            busy = time.perf_counter() - self.busy_since
            if self.busy_bytes >= MIN_MEASURED_BYTES and busy > 0:
                self.running = (self.busy_bytes + self.inflight / 2) / busy
            if self.active == 0 and self.running is not None:
                self.best = self.running if self.best is None else max(self.running, DECAY * self.best)
                self.running = None

    @contextmanager
    def measuring(self, nbytes: int):
        """Count the write in the block as `nbytes` in flight (0: a write that does not measure
        the store, such as an encoded one, whose pace is the encoder's); bytes count as written
        only when the block does not raise."""
        if not nbytes:
            yield
            return
        self.start(nbytes)
        done = False
        try:
            yield
            done = True
        finally:
            self.finish(nbytes, done)


def meter_for(store) -> WriteMeter:
    """The one WriteMeter of `store` (kept on the store object, shared by every save to it)."""
    meter = store.__dict__.get("_write_meter")
    if meter is None:
        meter = store.__dict__.setdefault("_write_meter", WriteMeter())
    return meter
