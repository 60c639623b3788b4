"""codec="auto": learn, per store, whether saves write faster with their chunks encoded or raw,
by timing both on the saves themselves (no model of the disk, the cores or the codec)."""

import threading
import time
from dataclasses import dataclass, field

MIN_MEASURED_BYTES = 8 << 20
EXPLORE_FIRST, EXPLORE_MAX = 8, 64
SMOOTHING = 0.5


@dataclass
class BusyMeter:
    """Bytes written over busy time: the time at least one measured write was in progress
    (gaps, such as waiting for a capture, do not count)."""

    nbytes: int = 0
    busy: float = 0.0
    active: int = 0
    since: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self) -> None:
        """A measured write begins."""
        with self.lock:
            if self.active == 0:
                self.since = time.perf_counter()
            self.active += 1

    def finish(self, nbytes: int) -> None:
        """A measured write that began with `start` ended, having written `nbytes` (0: failed)."""
        with self.lock:
            self.active -= 1
            self.nbytes += nbytes
            if self.active == 0:
                self.busy += time.perf_counter() - self.since


@dataclass
class AutoChoice:
    """Per store: the write rate (decoded bytes per busy second, smoothed) of saves whose
    auto chunks were encoded and of saves whose auto chunks were raw. An untried way is
    tried first (raw, then encoded; encoded first where the store is known to be slow); then
    each save takes the faster way, except that every `interval`-th save tries the other:
    8, doubling up to 64 while it stays slower, back to 8 when it wins."""

    rates: dict = field(default_factory=dict)
    interval: int = EXPLORE_FIRST
    since: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def faster(self) -> bool | None:
        """True when encoding measured faster, False when raw did, None until both measured."""
        if len(self.rates) < 2:
            return None
        return self.rates[True] > self.rates[False]

    def pick(self, slow_store: bool = False) -> bool:
        """Whether the next save encodes its auto chunks."""
        with self.lock:
            for encoded in ((True, False) if slow_store else (False, True)):
                if encoded not in self.rates:
                    return encoded
            best = self.faster()
            self.since += 1
            if self.since >= self.interval:
                self.since = 0
                return not best
            return best

    def record(self, encoded: bool, nbytes: int, seconds: float) -> None:
        """Fold one save's measured writing (auto chunks only) into the rates."""
        if nbytes < MIN_MEASURED_BYTES or seconds <= 0:
            return
        with self.lock:
            before = self.faster()
            last = self.rates.get(encoded)
            rate = nbytes / seconds
            self.rates[encoded] = rate if last is None else SMOOTHING * last + (1 - SMOOTHING) * rate
            after = self.faster()
            if before is not None and encoded != before:
                self.interval = EXPLORE_FIRST if after != before else min(EXPLORE_MAX, 2 * self.interval)


def choice_for(store) -> AutoChoice:
    """The one AutoChoice of `store` (kept on the store object, shared by every save to it)."""
    choice = store.__dict__.get("_auto_choice")
    if choice is None:
        choice = store.__dict__.setdefault("_auto_choice", AutoChoice())
    return choice
