"""Branch holders: at most one live run writes a branch.

A run (a Checkpointer) holds its branch by a record `holders/<branch>/<seq>.json` in the
repository's persistent store, created exclusively with the next seq, so two runs racing
for a branch cannot both win. The highest seq is the holder. A holder is live while its
process runs: on the same host, by pid, boot id and the process's start time (a pid reused
after the holder died or the machine rebooted does not count); on another host, while the
record is younger than HOLD_EXPIRY seconds (the holder refreshes it every HOLD_REFRESH s).
A dead holder's branch is taken over without any manual step.
"""

import datetime
import json
import os
import socket
import threading
import time
from dataclasses import dataclass

from ..errors import BranchHeldError, ConflictError
from ..format.refs import seq_of
from ..storage import Store

HOLDERS = "holders"
HOLD_EXPIRY = 120.0
HOLD_REFRESH = 30.0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def boot_id() -> str:
    """This machine's boot id (Linux), '' where the system does not tell."""
    return _read("/proc/sys/kernel/random/boot_id")


def start_ticks(pid: int) -> str:
    """The start time of process `pid` in clock ticks since boot (Linux), '' if unknown."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def process_alive(pid: int, boot: str = "", start: str = "") -> bool:
    """Whether process `pid` of this host runs and, where they were recorded, has the same
    boot id and start time (a pid reused after the recorded process died is another one)."""
    here = boot_id()
    if boot and here and boot != here:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = start_ticks(pid) if start else ""
    return not (now and now != start)


@dataclass
class Holder:
    """Who holds a branch: the record a run wrote, and where it was found."""

    branch: str
    host: str
    pid: int
    boot: str
    start: str
    since: float
    run: str
    seq: int
    age: float = 0.0

    def describe(self) -> str:
        when = datetime.datetime.fromtimestamp(self.since).strftime("%Y-%m-%d %H:%M:%S")
        return f"run {self.run!r} (pid {self.pid} on {self.host}, since {when})"

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid() and self.boot == boot_id()

    def alive(self) -> bool:
        """True while the holding process may still run (see the module's rule)."""
        if self.host != socket.gethostname():
            return self.age < HOLD_EXPIRY
        return process_alive(self.pid, self.boot, self.start)


def run_name() -> str:
    """A name for this run: the scheduler's job id where there is one, else host-pid."""
    for var in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return f"job{os.environ[var]}".replace("/", "-")[:64]
    return f"{socket.gethostname()}-{os.getpid()}"


def _key(branch: str, seq: int) -> str:
    return f"{HOLDERS}/{branch}/{seq:016d}.json"


def _seqs(store: Store, branch: str) -> list[int]:
    return sorted(s for s in map(seq_of, store.list(f"{HOLDERS}/{branch}")) if s is not None)


def current_holder(store: Store, branch: str) -> Holder | None:
    """The newest holder record of `branch`, alive or not; None when there is none (or it is
    released or unreadable: a damaged record must not lock a branch forever)."""
    seqs = _seqs(store, branch)
    if not seqs:
        return None
    key = _key(branch, seqs[-1])
    try:
        record = json.loads(store.read(key))
        age = time.time() - store.mtime(key)
        return Holder(branch, str(record["host"]), int(record["pid"]), str(record.get("boot", "")),
                      str(record.get("start", "")), float(record["since"]), str(record.get("run", "")),
                      seqs[-1], age)
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def held_error(holder: Holder, url: str) -> BranchHeldError:
    return BranchHeldError(
        f"branch {holder.branch!r} of {url} is held by {holder.describe()}, which is still running: "
        "two runs on one branch would interleave their versions. Save on another branch "
        "(branch=...), pass on_conflict='fork' to continue on a new branch named after this run, "
        "or, if that run is in fact dead (on another host its hold expires "
        f"{HOLD_EXPIRY:.0f} s after its last refresh), take_over=True")


class BranchHolds:
    """The branches this process holds in one store, refreshed in the background."""

    def __init__(self, store: Store):
        self.store = store
        self.held: dict[str, int] = {}
        self.lost: set[str] = set()
        self._checked: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self, branch: str) -> None:
        """Raise BranchHeldError when another live process holds `branch` (looked up at most
        once per HOLD_REFRESH seconds per branch: a run starting meanwhile holds its branch
        before its first save, so a plain saver notices within that time)."""
        if branch in self.lost:
            holder = current_holder(self.store, branch)
            raise BranchHeldError(f"this process's hold of branch {branch!r} of {self.store.url} was taken over"
                                  + (f" by {holder.describe()}" if holder else "") + ": save on another branch")
        if branch in self.held or time.monotonic() - self._checked.get(branch, -HOLD_REFRESH) < HOLD_REFRESH:
            return
        holder = current_holder(self.store, branch)
        if holder is not None and not holder.is_this_process() and holder.alive():
            raise held_error(holder, self.store.url)
        self._checked[branch] = time.monotonic()

    def hold(self, branch: str, run: str, take_over: bool = False) -> None:
        """Become the holder of `branch` (again, if this process holds it already); a dead
        holder is replaced, a live one raises BranchHeldError unless `take_over`."""
        for _ in range(8):
            holder = current_holder(self.store, branch)
            if holder is not None and not holder.is_this_process() and holder.alive() and not take_over:
                raise held_error(holder, self.store.url)
            seq = max(_seqs(self.store, branch), default=-1) + 1
            record = {"host": socket.gethostname(), "pid": os.getpid(), "boot": boot_id(),
                      "start": start_ticks(os.getpid()), "since": time.time(), "run": run}
            if self.store.create_exclusive(_key(branch, seq), json.dumps(record).encode()):
                with self._lock:
                    self.held[branch] = seq
                    self.lost.discard(branch)
                for old in range(max(0, seq - 8), seq):
                    self._forget(branch, old)
                self._start_refresh()
                return
        raise ConflictError(f"could not hold branch {branch!r} in {self.store.url}: too many runs racing for it")

    def release(self, branch: str) -> None:
        """Stop holding `branch` (no-op when another run took it over meanwhile)."""
        with self._lock:
            seq = self.held.pop(branch, None)
        if seq is not None and max(_seqs(self.store, branch), default=-1) == seq:
            self._forget(branch, seq)

    def release_all(self) -> None:
        self._stop.set()
        for branch in list(self.held):
            try:
                self.release(branch)
            except Exception:  # best effort at close: a dead holder is detected anyway
                pass

    def _forget(self, branch: str, seq: int) -> None:
        try:
            self.store.delete(_key(branch, seq))
        except FileNotFoundError:
            pass

    def _start_refresh(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._refresh, name="forkpoint-holds", daemon=True)
            self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(HOLD_REFRESH):
            self.refresh()

    def refresh(self) -> None:
        """Keep this process's holds young for runs on other hosts (they judge by age); a hold
        whose record is gone was taken over, and later saves on that branch raise."""
        with self._lock:
            held = list(self.held.items())
        for branch, seq in held:
            try:
                self.store.touch(_key(branch, seq))
            except FileNotFoundError:  # another run took the branch over
                with self._lock:
                    if self.held.get(branch) == seq:
                        self.held.pop(branch)
                        self.lost.add(branch)
            except Exception:  # a missed refresh only ages the hold; the next try may work
                pass
