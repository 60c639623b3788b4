"""How busy this process's cores are: its own use, other processes', the hypervisor's steal.

The pacer's CPU rule reads this process's own CPU time, which cannot see a data loader, a
neighbouring job or a hypervisor's steal on the same cores. The kernel's per-core counters
can, in ticks of 10 ms: fine enough over a twentieth of a second.
"""

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

LOAD_WINDOW = 0.05
"""Seconds over which the use of the cores is measured (the kernel counts in 10 ms
ticks per core: a measure of two cores over 50 ms may be off by about a quarter of a core)."""


def _affinity() -> tuple[int, ...]:
    """The cores this process may run on (all of them where the system does not say)."""
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()


def idle_seconds(cpus: tuple[int, ...]) -> tuple[float, int] | None:
    """Seconds the `cpus` (every core where empty, or where the system numbers them otherwise)
    spent idle or waiting on I/O since boot, and how many cores that counts; None where the
    system keeps no such count."""
    try:
        times = psutil.cpu_times(percpu=True)
    except (OSError, NotImplementedError, AttributeError):
        return None
    if cpus and max(cpus) < len(times):
        times = [times[c] for c in cpus]
    return sum(t.idle + getattr(t, "iowait", 0.0) for t in times), len(times)


@dataclass(frozen=True)
class LoadMeasure:
    """One measure of the cores over a window from `start` (perf_counter seconds): `others`,
    the cores kept busy by anything but this process; `total`, by anything."""

    start: float = 0.0
    others: float = 0.0
    total: float = 0.0


@dataclass
class CoreLoad:
    """How busy this process's cores were (the window's length less their idle time, and the
    same less this process's CPU time) over the last window of at least LOAD_WINDOW, on the
    cores of the process's affinity at each measure; a measure of nothing where the system
    keeps no count. One per process: its mark carries from save to save, so a save's first look
    covers the spell before it."""

    mark: tuple | None = None
    last: LoadMeasure = LoadMeasure()
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    idle: Callable[[], tuple[float, int] | None] = field(default=lambda: idle_seconds(_affinity()), repr=False)
    """The cores' idle seconds since boot and their count (the system's counters, or a test's)."""
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    cpu: Callable[[], float] = field(default=time.process_time, repr=False)

    def measure(self) -> LoadMeasure:
        """The last measure, taking a new one where it is due."""
        with self.lock:
            now = self.clock()
            if self.mark is not None and now - self.mark[0] < LOAD_WINDOW:
                return self.last
            counted = self.idle()
            if counted is None:
                return self.last
            (idle, ncores), own = counted, self.cpu()
            if self.mark is not None and own >= self.mark[2] and idle >= self.mark[1]:
                spell = now - self.mark[0]
                total = max(0.0, ncores - (idle - self.mark[1]) / spell)
                others = max(0.0, total - (own - self.mark[2]) / spell)
                self.last = LoadMeasure(self.mark[0], others, total)
            self.mark = (now, idle, own)
            return self.last


CORES = CoreLoad()
"""The process's measure, shared by every save's pacer."""
