"""Writer leases: which processes may have a save in flight on a store.

A process keeps a small record, `writers/<writer id>.json`, on each store it writes objects
or manifests to: written before its first write there, rewritten before a later one once it
is LEASE_REFRESH seconds old, removed when the repository is closed. gc's grace period exists
for other processes' saves in flight; when no other process's lease on a store is younger
than the grace period, gc there keeps only what was written in the last QUIET_MARGIN seconds
(a writer that starts afterwards writes its lease first, so everything it writes or touches
is newer), and removes at once what its own pruning freed.
"""

import json
import os
import socket
import threading
import time
import weakref

from ..storage import Store
from .holders import boot_id, process_alive, start_ticks

LEASES = "writers"
LEASE_REFRESH = 60.0
QUIET_MARGIN = 5.0


class Leases:
    """This process's writer leases on a repository's `stores` (writer `writer_id`); released
    by `release()`, or when collected or at interpreter exit (a program that never closes its
    repository)."""

    def __init__(self, stores: list[Store], writer_id: str):
        self.stores, self.writer_id = stores, writer_id
        self._held: dict[str, float] = {}  # store URL -> when this process last wrote its lease there
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, release_leases, list(stores), self.key(), self._held, self._lock)

    def key(self) -> str:
        """The storage key of this process's lease."""
        return f"{LEASES}/{self.writer_id.replace(':', '-')}.json"

    def _write(self, store: Store) -> None:
        record = {"writer": self.writer_id, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                  "boot": boot_id(), "start": start_ticks(os.getpid())}
        store.write(self.key(), [json.dumps(record).encode()])

    def hold(self, store: Store) -> None:
        """Call before writing objects or manifests to `store`: write this process's lease
        there unless it wrote it less than LEASE_REFRESH seconds ago."""
        now = time.monotonic()
        with self._lock:
            last = self._held.get(store.url)
            if last is not None and now - last < LEASE_REFRESH:
                return
            self._held[store.url] = now
        self._write(store)

    def others_alive(self, store: Store, young: float = 600.0, ignore=frozenset()) -> bool:
        """True when another running process may write to `store` (see live_writer), leaving
        out the leases whose keys are in `ignore`."""
        own = self.key()
        return any(live_writer(store, key, own, young) for key in store.list(LEASES) if key not in ignore)

    def release(self) -> None:
        """Remove this process's leases (at close: it writes nothing more)."""
        self._finalizer()

    def quiet_since(self, store: Store, grace: float, dry_run: bool) -> float | None:
        """The time (the store's clock where it tells) before which nothing on `store` can
        belong to another process's save in flight, or None while another process's lease
        there is younger than `grace`. Removes leases older than the grace period."""
        now = time.time()
        own = self.key()
        if not dry_run:
            with self._lock:
                held = store.url in self._held
            try:
                self._write(store)
                now = min(now, store.mtime(own))
                if held:
                    with self._lock:
                        self._held[store.url] = time.monotonic()
                else:
                    store.delete(own)  # written for the store's clock only
            except OSError:
                return None
        quiet, stale = True, []
        for key in store.list(LEASES):
            if key == own:
                continue
            try:
                age = now - store.mtime(key)
            except FileNotFoundError:
                continue
            if age > max(grace, 2 * LEASE_REFRESH) or _dead_here(store, key):
                stale.append(key)
            elif age < grace:
                quiet = False
        if not dry_run:
            for key in stale:
                try:
                    store.delete(key)
                except FileNotFoundError:
                    pass
        return now - QUIET_MARGIN if quiet else None


def _dead_here(store: Store, key: str) -> bool:
    """True when lease `key` is of a process of this host that is no longer running."""
    try:
        record = json.loads(store.read(key))
    except (FileNotFoundError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    return not _process_alive(record)


def _process_alive(record: dict) -> bool:
    return process_alive(record["pid"], str(record.get("boot", "")), str(record.get("start", "")))


def live_writer(store: Store, key: str, own: str, young: float) -> bool:
    """True when lease `key` may belong to a running process other than this one: a process
    of this host that is alive, or one of another host whose lease is younger than `young` s."""
    if key == own:
        return False
    try:
        record = json.loads(store.read(key))
        age = time.time() - store.mtime(key)
    except (FileNotFoundError, ValueError):
        return False
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        return _process_alive(record)
    return age < young


def release_leases(stores: list[Store], key: str, leases: dict, lock) -> None:
    """Delete lease `key` from the stores whose URL `leases` holds, and forget them."""
    with lock:
        urls = set(leases)
        leases.clear()
    for store in stores:
        if store.url in urls:
            try:
                store.delete(key)
            except Exception:  # best effort: at exit the store may be gone; the lease then ages out
                pass
