"""Encoding paced by the store: a chunk is encoded only while every I/O slot has a write.

A save is bound either by the store or by its own CPU work (copies, hashing, the store's
system calls). Where every I/O slot holds a write, the store is the bound, and encoding takes
work off it. Where a slot is free, the CPU side is the bound: encoding would add to it, and on
a machine with few cores it slows the store's own path too (`benchmarks/codecs.py
--raw-under-load` measures how much). Where the process keeps all its cores busy, the CPU is short even though
the slots are full (their writes wait for a core); other processes and a hypervisor's steal
take from the same cores, so they count too (engine.cpuload). The pacer tells each chunk's
capture which holds (as zstd --adapt lowers its level when output stalls).

Neither rule sees what encoding costs the store's own path where both share a few cores, so
a repository also times its paced saves against saves it writes raw, now and then, and writes
raw while those measure faster (engine.autocodec's AutoChoice, with a margin for the paced way).
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from . import scheduler
from .autocodec import AutoChoice
from .cpuload import CORES, CoreLoad

CPU_BUSY = 0.9
"""The share of its cores a process uses at which the pacer takes the CPU for short."""
CPU_WINDOW = 0.01
"""Seconds over which the pacer measures the process's CPU use."""
STORE_BOUND_SHARE = 0.9
"""The share of chunks past its start-up a save must encode for the next to count the store as
its bound: high, since a save on a fast disk that encodes most of its chunks is not bound by it,
and priming the next would slow that one."""
PACED_MARGIN = 0.15
"""How much faster (as a share of the paced way's rate) saves written raw must measure before a
repository writes its lossless saves raw: within it, the smaller checkpoint wins."""
PACED_WINDOW = 5
"""The saves of each way (the last ones) whose median rate it is judged by."""


def process_clocks() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds), the clocks the pacer reads."""
    return time.perf_counter(), time.process_time()


@dataclass
class PaceMemory:
    """What a repository's paced saves found, for the next one: `store_bound` where, past its
    start-up (its first twice the slots' chunks), the last one encoded STORE_BOUND_SHARE of the
    chunks it paced (the store bound it nearly throughout); `ways`, the rates (bytes a second,
    start to last write, the median of each way's last PACED_WINDOW saves) of saves paced and
    of saves written raw, which picks each save's way: the process's first save, which pays
    for warming up (the codec chooses its layouts), is paced and not timed; the second is paced
    and the third written raw, each timed (a way never timed, as in saves too small to time,
    is not taken)."""

    store_bound: bool = False
    ways: AutoChoice = field(default_factory=lambda: AutoChoice(margin=PACED_MARGIN, window=PACED_WINDOW))
    warm: bool = False


@dataclass
class EncodePacer:
    """The chunks of one save that may be encoded before their write: `slots`, the store's
    I/O slots; a chunk whose turn comes while fewer than that many chunks wait for or are in
    their write, or while the process used CPU_BUSY of its `cores` over the last CPU_WINDOW
    (or all processes, steal included, kept them that busy by `load`), is written raw. Saves
    of fewer than `least` such chunks always encode (a few chunks' encodes cost little, and the
    first of them would find nothing waiting);
    `enabled=False` encodes every chunk. With a `memory` of a save the store bound, the first
    `slots` chunks need nothing waiting (they never find any; on a slow disk they went raw for
    nothing), and up to twice that many, chunks still in their capture count as waiting (they
    soon will: else the encodes of the first chunks left the next ones finding too few; later
    on, counting them made saves on a fast disk encode ever more chunks, each save teaching the
    next that the store bound it); `finish` records this save in it. The rule counts waiting
    chunks, not waiting bytes against measured rates: by bytes the store never looks idle, so
    nearly every chunk would be encoded while the CPU is the bound. Where the memory's `ways`
    pick raw for this save (`paced` False), every such chunk is written raw."""

    slots: int
    enabled: bool = True
    least: int = 0
    chunks: int = 0
    waiting: int = 0
    capturing: int = 0
    encoded: int = 0
    steady: int = 0
    steady_encoded: int = 0
    raw: int = 0
    cores: int = 0
    memory: PaceMemory | None = None
    cpu_mark: tuple | None = None
    cpu_short: bool = False
    load: CoreLoad = field(default_factory=lambda: CORES)
    paced: bool = True
    nbytes: int = 0
    clock: Callable[[], tuple[float, float]] = field(default=None, repr=False)
    """(wall seconds, this process's CPU seconds) now; the real clocks unless a test sets them."""
    started: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.clock = self.clock or process_clocks
        self.started = self.clock()[0] if self.started is None else self.started
        self.least = self.least or 2 * self.slots
        self.cores = self.cores or scheduler.usable_cores()
        if self.enabled and self.memory is not None and self.memory.warm:
            self.paced = self.memory.ways.pick(encoded_first=True)
        if self.enabled:
            self.load.measure()

    def add(self, nbytes: int = 0) -> None:
        """Count one more chunk (of `nbytes`) of the save that may be encoded ahead of its write."""
        with self.lock:
            self.chunks += 1
            self.nbytes += nbytes

    def encodes(self) -> bool:
        """Whether the chunk whose capture starts now is encoded (else it is written raw)."""
        with self.lock:
            decided = self.encoded + self.raw
            primed = self.memory is not None and self.memory.store_bound and decided < 2 * self.slots
            backlog = self.waiting + (self.capturing if primed else 0)
            encode = not self.enabled or self.chunks < self.least or self.paced and (
                (backlog >= self.slots or primed and decided < self.slots) and not self._cpu_is_short())
            self.capturing += 1
            if encode:
                self.encoded += 1
            else:
                self.raw += 1
            if decided >= 2 * self.slots:
                self.steady += 1
                self.steady_encoded += encode
            return encode

    def _cpu_is_short(self) -> bool:
        """Whether the process used CPU_BUSY of its cores since the last measure (taken at
        least CPU_WINDOW before; until then, the last verdict), or all processes did by `load`'s
        last measure (one begun before this save counts this process's use since the last
        measure, not the spell's: a training step between saves is not the save's load)."""
        now, cpu = self.clock()
        if self.cpu_mark is None:
            self.cpu_mark = (now, cpu)
        elif now - self.cpu_mark[0] >= CPU_WINDOW:
            own = (cpu - self.cpu_mark[1]) / (now - self.cpu_mark[0])
            seen = self.load.measure()
            busy = seen.total if seen.start >= self.started else own + seen.others
            self.cpu_short = max(own, busy) >= CPU_BUSY * self.cores
            self.cpu_mark = (now, cpu)
        return self.cpu_short

    def ready(self) -> None:
        """A chunk is captured (and encoded or not): it now waits for its write."""
        with self.lock:
            self.capturing -= 1
            self.waiting += 1

    def written(self) -> None:
        """A ready chunk's write ended (done or failed)."""
        with self.lock:
            self.waiting -= 1

    def finish(self) -> None:
        """Record in `memory` (where this save was paced or written raw by its choice) whether
        the store bound it, and its rate, unless it is the process's first."""
        memory = self.memory
        if memory is None or not self.enabled or self.chunks < self.least:
            return
        if self.paced:
            memory.store_bound = self.steady_encoded >= STORE_BOUND_SHARE * self.steady > 0
        if memory.warm:
            memory.ways.record(self.paced, self.nbytes, self.clock()[0] - self.started, keep=False)
        memory.warm = True
