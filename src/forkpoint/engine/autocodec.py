"""codec="auto": learn, per store, whether saves write faster with their chunks encoded or raw,
by timing both on the saves themselves (no model of the disk, the cores or the codec). What
was learnt is kept in the store (STATE_KEY), so that the next job of a chain starts from it."""

import collections
import json
import logging
import math
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field

MIN_MEASURED_BYTES = 8 << 20
EXPLORE_FIRST, EXPLORE_MAX = 8, 64
SMOOTHING = 0.5
STATE_KEY = "stats/auto-codec.json"
STATE_FORMAT = "forkpoint.auto-codec"
WAYS = {False: "raw", True: "encoded"}

log = logging.getLogger("forkpoint")
_CHOICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CHOICES_LOCK = threading.Lock()


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
    8, doubling up to 64 while it stays slower, back to 8 when it wins. With a `margin`,
    encoded counts as the faster way unless raw's rate is more than (1 + margin) times its.
    A way's rate is smoothed over its saves, or with a `window`, the median of its last
    `window` saves (one slow or fast save then moves nothing)."""

    rates: dict = field(default_factory=dict)
    margin: float = 0.0
    window: int = 0
    samples: dict = field(default_factory=dict, repr=False)
    interval: int = EXPLORE_FIRST
    since: int = 0
    store: object = field(default=None, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, store) -> "AutoChoice":
        """The choice kept in `store` by an earlier process, or a fresh one (none kept, or a
        record that is unreadable or not one of these: it is only advice)."""
        try:
            record = json.loads(store.read(STATE_KEY))
            rates = {way: float(record["rates"][name]) for way, name in WAYS.items() if name in record["rates"]}
            interval = int(record["interval"])
            if record.get("format") != STATE_FORMAT or int(record["format_version"][0]) > 1:
                raise ValueError("not an auto-codec record this forkpoint reads")
            if not all(math.isfinite(r) and r > 0 for r in rates.values()):
                raise ValueError(f"bad rates {record['rates']}")
        except FileNotFoundError:
            return cls(store=store)
        except Exception as e:  # a damaged record only costs relearning
            log.warning("ignoring %s in %s: %s", STATE_KEY, getattr(store, "url", store), e)
            return cls(store=store)
        return cls(rates=rates, interval=min(EXPLORE_MAX, max(EXPLORE_FIRST, interval)), store=store)

    def faster(self) -> bool | None:
        """True when encoding measured faster, False when raw did, None until both measured."""
        if len(self.rates) < 2:
            return None
        return self.rates[True] * (1 + self.margin) >= self.rates[False]

    def pick(self, encoded_first: bool = False) -> bool:
        """Whether the next save encodes its auto chunks (`encoded_first`: try that way first)."""
        with self.lock:
            for encoded in ((True, False) if encoded_first else (False, True)):
                if encoded not in self.rates:
                    return encoded
            best = self.faster()
            self.since += 1
            if self.since >= self.interval:
                self.since = 0
                return not best
            return best

    def record(self, encoded: bool, nbytes: int, seconds: float, keep: bool = True) -> None:
        """Fold one save's measured writing (auto chunks only) into the rates, and (`keep`)
        write them to the store."""
        if nbytes < MIN_MEASURED_BYTES or seconds <= 0:
            return
        with self.lock:
            before = self.faster()
            last = self.rates.get(encoded)
            rate = nbytes / seconds
            if self.window:
                recent = self.samples.setdefault(encoded, collections.deque(maxlen=self.window))
                recent.append(rate)
                self.rates[encoded] = statistics.median(recent)
            else:
                self.rates[encoded] = rate if last is None else SMOOTHING * last + (1 - SMOOTHING) * rate
            after = self.faster()
            if before is not None and encoded != before:
                self.interval = EXPLORE_FIRST if after != before else min(EXPLORE_MAX, 2 * self.interval)
            record = {"format": STATE_FORMAT, "format_version": [1, 1], "interval": self.interval,
                      "rates": {WAYS[way]: rate for way, rate in self.rates.items()}}
        if keep:
            self._keep(record)

    def _keep(self, record: dict) -> None:
        """Write `record` to the store (not durably: it is advice; a failure is only logged)."""
        if self.store is None:
            return
        try:
            self.store.write(STATE_KEY, [json.dumps(record).encode()], durable=False)
        except Exception as e:
            log.warning("could not keep %s in %s: %s", STATE_KEY, getattr(self.store, "url", self.store), e)


def choice_for(store) -> AutoChoice:
    """The one AutoChoice of `store` in this process (shared by every save to it while the
    store object lives), loaded from the store the first time."""
    with _CHOICES_LOCK:
        choice = _CHOICES.get(store)
        if choice is None:
            choice = _CHOICES[store] = AutoChoice.load(store)
        return choice
