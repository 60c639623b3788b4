"""Coordination of a distributed save through the process group's key-value store.

Each rank publishes its part (the chunks it wrote, its rank-local leaves) under the save's
id; the coordinator (rank 0) waits for every part with a timeout, commits, and announces
the outcome, which the other ranks wait for. Nothing here blocks forever.

A c10d store client runs one call at a time: a `wait` on it holds up every other thread's
`set` and `get` until it returns. Waits therefore go through clients of their own (clones,
pooled), so that one save's wait never delays what another save in flight tells its peers.
"""

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from ..errors import ForkpointError

ERROR_ACK_SECONDS = 10.0
"""How long the coordinator waits for the other ranks to read a failed save's outcome."""


class DistSaveError(ForkpointError):
    """A distributed save did not commit: a rank failed, died or timed out. No version appeared."""


@dataclass
class Coordinator:
    """Exchanges save parts and outcomes between `world` ranks over a c10d Store."""

    store: object
    rank: int
    world: int
    timeout: float
    _idle_waiters: list = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self, keys: list[str], seconds: float) -> None:
        """Block until every key of `keys` is set; raise (the store's error) after `seconds`.
        Runs on a pooled clone of the store, never on the client other threads share."""
        with self._lock:
            waiter = self._idle_waiters.pop() if self._idle_waiters else None
        if waiter is None:
            waiter = _clone(self.store)
        if waiter is None:
            return self._poll(keys, seconds)
        waiter.wait(keys, timedelta(seconds=seconds))  # a waiter that raised is dropped
        with self._lock:
            self._idle_waiters.append(waiter)

    def _poll(self, keys: list[str], seconds: float) -> None:
        """`wait` for a store that cannot be cloned: short checks with a growing pause."""
        deadline, pause = time.monotonic() + seconds, 0.001
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"keys {keys} not set within {seconds:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def close(self) -> None:
        """Drop the store and the waiters' connections."""
        with self._lock:
            self._idle_waiters.clear()
        self.store = None

    def publish(self, sid: str, part: dict) -> None:
        """Make this rank's part of save `sid` available to the coordinator."""
        self.store.set(f"{sid}/part/{self.rank}", json.dumps(part, separators=(",", ":")))

    def gather(self, sid: str) -> list[dict]:
        """(Coordinator) every rank's part, in rank order; DistSaveError naming the ranks that
        failed or did not report within the timeout."""
        keys = [f"{sid}/part/{r}" for r in range(self.world)]
        start = time.monotonic()
        try:
            self.wait(keys, self.timeout)
        except Exception:
            missing = [r for r, k in enumerate(keys) if not self._has(k)]
            raise DistSaveError(
                f"save {sid}: rank(s) {missing} did not finish writing within {self.timeout:.0f} s "
                f"(waited {time.monotonic() - start:.1f} s); they may have died. No version was "
                "committed; objects already written are removed by gc") from None
        parts = [json.loads(self.store.get(k)) for k in keys]
        for k in keys:
            self.store.delete_key(k)
        failed = [(r, p["error"]) for r, p in enumerate(parts) if "error" in p]
        if failed:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise DistSaveError(f"save {sid} failed on {len(failed)} rank(s), no version was committed: {detail}")
        return parts

    def announce(self, sid: str, outcome: dict, extras: dict | None = None, cleanup=()) -> None:
        """(Coordinator) tell every rank how save `sid` ended, with `extras` ({key: value}) for
        them to fetch; wait (up to the timeout after a commit, ERROR_ACK_SECONDS after a failure)
        until every rank has read what it needs, so that the store, which rank 0 may host,
        outlives their reads; then remove the save's keys (and the `cleanup` keys other ranks set)."""
        if self.world == 1:
            return
        for key, value in (extras or {}).items():
            self.store.set(f"{sid}/{key}", value)
        self.store.set(f"{sid}/outcome", json.dumps(outcome))
        try:
            # after a failure, wait briefly: a rank that died never reads it, but a process
            # exiting right after raising would take the store (which rank 0 may host) with it
            self.wait([f"{sid}/done"], min(self.timeout, ERROR_ACK_SECONDS) if "error" in outcome else self.timeout)
            for key in ("outcome", "read", "done", *(extras or {}), *cleanup):
                self.store.delete_key(f"{sid}/{key}")
        except Exception:
            pass

    def outcome(self, sid: str, fetch=None) -> dict:
        """(Other ranks) wait for the outcome of save `sid`: the coordinator needs up to the
        timeout to gather parts, so this waits twice as long before giving up. `fetch(outcome)`
        runs before this rank acknowledges it (reads of the save's other keys go there)."""
        key = f"{sid}/outcome"
        try:
            self.wait([key], 2 * self.timeout)
            outcome = json.loads(self.store.get(key))
        except Exception as e:
            raise DistSaveError(
                f"save {sid}: no outcome from the coordinator (rank 0) within {2 * self.timeout:.0f} s "
                f"({type(e).__name__}: {e}); it may have died. No version is known to have been committed"
            ) from None
        try:
            if fetch is not None and "error" not in outcome:
                fetch(outcome)
        finally:
            self.acknowledge(sid)
        return outcome

    def acknowledge(self, sid: str) -> None:
        """(Other ranks) say this rank needs nothing more of save `sid` (it read the outcome,
        or refused the save and will not wait for one)."""
        try:
            if self.store.add(f"{sid}/read", 1) == self.world - 1:
                self.store.set(f"{sid}/done", "1")
        except Exception:
            pass

    def get(self, sid: str, key: str, wait: bool = False) -> bytes:
        """The value of a key of save `sid` (waiting up to the timeout for it with `wait`)."""
        if wait:
            try:
                self.wait([f"{sid}/{key}"], self.timeout)
            except Exception:
                raise DistSaveError(f"save {sid}: {key} did not appear within {self.timeout:.0f} s; "
                                    "the rank that sets it may have died") from None
        return self.store.get(f"{sid}/{key}")

    def set(self, sid: str, key: str, value) -> None:
        """Set a key of save `sid` for other ranks to read."""
        self.store.set(f"{sid}/{key}", value)

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False


def _clone(store):
    """A new client of the same store (None when the store type cannot be cloned)."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
