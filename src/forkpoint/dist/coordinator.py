"""Coordination of a distributed save through the process group's key-value store.

Each rank publishes its part (the chunks it wrote, its rank-local leaves) under the save's
id; the coordinator (rank 0) waits for every part with a timeout, commits, and announces
the outcome, which the other ranks wait for. Nothing here blocks forever.
"""

import json
import time
from dataclasses import dataclass
from datetime import timedelta

from ..errors import ForkpointError


class DistSaveError(ForkpointError):
    """A distributed save did not commit: a rank failed, died or timed out. No version appeared."""


@dataclass
class Coordinator:
    """Exchanges save parts and outcomes between `world` ranks over a c10d Store."""

    store: object
    rank: int
    world: int
    timeout: float

    def publish(self, sid: str, part: dict) -> None:
        """Make this rank's part of save `sid` available to the coordinator."""
        self.store.set(f"{sid}/part/{self.rank}", json.dumps(part, separators=(",", ":")))

    def gather(self, sid: str) -> list[dict]:
        """(Coordinator) every rank's part, in rank order; DistSaveError naming the ranks that
        failed or did not report within the timeout."""
        keys = [f"{sid}/part/{r}" for r in range(self.world)]
        start = time.monotonic()
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
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
        them to fetch; after a commit, wait (up to the timeout) until every rank has read what
        it needs, so that the store, which rank 0 may host, outlives their reads; then remove
        the save's keys (and the `cleanup` keys other ranks set)."""
        if self.world == 1:
            return
        for key, value in (extras or {}).items():
            self.store.set(f"{sid}/{key}", value)
        self.store.set(f"{sid}/outcome", json.dumps(outcome))
        if "error" in outcome:
            return
        try:
            self.store.wait([f"{sid}/done"], timedelta(seconds=self.timeout))
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
            self.store.wait([key], timedelta(seconds=2 * self.timeout))
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
            try:
                if self.store.add(f"{sid}/read", 1) == self.world - 1:
                    self.store.set(f"{sid}/done", "1")
            except Exception:
                pass
        return outcome

    def get(self, sid: str, key: str, wait: bool = False) -> bytes:
        """The value of a key of save `sid` (waiting up to the timeout for it with `wait`)."""
        if wait:
            try:
                self.store.wait([f"{sid}/{key}"], timedelta(seconds=self.timeout))
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
