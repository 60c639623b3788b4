"""Tiers: flush versions down, evict per tier, prefetch up, report where versions live."""

import logging
import threading
from dataclasses import dataclass, field

from ..engine.autocodec import BusyMeter, choice_for
from ..engine.reencode import copy_encoded
from ..engine.encoding import codec_rules
from ..engine.scheduler import Priority, Task
from ..errors import RefNotFoundError
from ..format.manifest import Manifest, version_from_bytes
from ..format.objects import object_key
from ..storage import Store
from ..tiers import farthest_next_use
from ..tiers.replication import record_key as replica_record_key
from ..engine.parallel import parallel_map
from ..tiers.movement import copy_manifest, copy_object, object_keys, sweep
from .compaction import encodable_objects

log = logging.getLogger("forkpoint")


@dataclass
class FlushWay:
    """How one flush copies its auto objects: {object key: how to encode it}, whether it
    encodes them (the destination's AutoChoice), and the meter timing those copies."""

    items: dict
    encoded: bool
    meter: BusyMeter = field(default_factory=BusyMeter)


class FlushRules:
    """How this process takes part in a flush from tier k to tier k + 1. These defaults: it
    copies the whole version, commits it below, and knows every save that writes to its tiers."""

    def keys(self, vid: str, k: int, m: Manifest) -> list[str]:
        """The object keys this process copies from tier k to tier k + 1 to flush version `vid`."""
        return sorted(object_keys(m))

    def gate(self, vid: str, k: int, failed: BaseException | None) -> bool:
        """Called once this process's copies of a flush are durable (or one `failed`): True when
        this process now commits the version on tier k + 1; raise to fail the flush."""
        if failed is not None:
            raise failed
        return True

    def writes_below(self, k: int) -> bool:
        """True when this process may write records (stubs, refs) to tier k + 1."""
        return True

    def sweep_min_age(self, k: int) -> float:
        """Seconds an unreferenced object of tier k is spared by eviction (0: this process
        knows every save in flight that writes there)."""
        return 0.0


class Placement:
    """Where a repository's versions live across its tiers: the flushes down, each tier's
    eviction (`keep`), prefetches up, and the objects saves and flushes in flight pin. A
    Repo's collaborator, reached as `repo.placement`. `rules` (FlushRules) say how this process
    takes part in a flush; `options` (the Repo's SaveOptions, read when a flush starts) give the
    codec rules; `prune(vid, store)` turns a version into a stub on `store`;
    `evict_lock` guards the pins (saves' writers and flushes) against eviction and gc."""

    def __init__(self, stores: list[Store], tier_specs: list, scheduler, refs, history, leases, compactor,
                 options, evict_lock: threading.Lock, prune, rules: FlushRules | None = None):
        self.stores, self.tier_specs, self.refs, self.history = stores, tier_specs, refs, history
        self.leases, self.compactor, self.options, self.evict_lock = leases, compactor, options, evict_lock
        self.rules = rules or FlushRules()
        self.tier_locks = [threading.Lock() for _ in stores]
        self.writers: set = set()
        """The ObjectWriters of the saves in flight (their objects are pinned)."""
        self._sched, self._prune = scheduler, prune
        self._flushed = [0] * len(stores)
        self._future_order: list[str] = []
        self._flushing: set[str] = set()
        self._flush_errors: list[dict] = []
        self._flush_pins: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def track(self, writer) -> None:
        """Pin the objects `writer` writes or refers to (call with `evict_lock` held)."""
        self.writers.add(writer)

    def forget(self, writer) -> None:
        """Unpin `writer`'s objects (call with `evict_lock` held)."""
        self.writers.discard(writer)

    def flush_errors(self) -> list[dict]:
        """The flushes that failed: {"version", "tier" (index), "error"}."""
        with self._lock:
            return list(self._flush_errors)

    def committed(self, vid: str, k: int) -> None:
        """A version is durable on tier k: flush it on when due, then apply tier k's retention."""
        self._flushed[k] += 1
        if k + 1 < len(self.stores) and self._flushed[k] % self.tier_specs[k].flush_every == 0:
            self.flush(vid, k)
        else:
            self._sched.submit("evict", lambda: self.evict(k), priority=Priority.EVICT)

    def flush(self, vid: str, k: int) -> Task:
        """Queue the flush of version `vid` from tier k to tier k + 1 (this process's share of
        it, as `rules` say); return the task that commits it below."""
        m = self.history.manifest_by_id(vid)
        tier = f"tier{k + 1}"
        src, dst = self.stores[k], self.stores[k + 1]
        keys = self.rules.keys(vid, k, m)
        self.leases.hold(dst)
        with self.evict_lock:
            self._flushing.add(vid)
            self._flush_pins[vid] = {key.rsplit("/", 1)[-1] for key in keys}
            encoding = self.compactor.queued(keys) if k == 0 else {}
        self._sched.promote(encoding.values())
        way = self._flush_encodes(m, dst, keys)
        copies = [self._sched.submit("flush", lambda key=key: self._copy_down(k, dst, key, way),
                                     priority=Priority.FLUSH, needs={f"io:{tier}": 1}, tier=tier,
                                     after=[encoding[key]] if key in encoding else ())
                  for key in keys]

        def finish():
            committed = False
            try:
                failed = next((c.future.exception() for c in copies if c.future.exception()), None)
                if way is not None and failed is None:
                    choice_for(dst).record(way.encoded, way.meter.nbytes, way.meter.busy, keep=self.rules.writes_below(k))
                if failed is None:
                    dst.barrier(keys)
                if self.rules.gate(vid, k, failed):
                    with self.tier_locks[k + 1]:
                        copy_manifest(src, dst, vid)
                        self._stub_ancestors(vid, dst)
                        head = self.refs.state_in(dst, "heads", m.version.branch)[1]
                        if head is None or self._descends(vid, head):
                            self.refs.move(dst, "heads", m.version.branch, vid)
                    committed = True
            except Exception as e:
                with self._lock:
                    self._flush_errors.append({"version": vid, "tier": k + 1, "error": f"{type(e).__name__}: {e}"})
                log.warning("flush of version %s to %s failed: %s", vid, dst.url, e)
                raise
            finally:
                with self.evict_lock:
                    self._flushing.discard(vid)
                    self._flush_pins.pop(vid, None)
            self.evict(k)
            if committed:
                self.committed(vid, k + 1)

        return self._sched.submit("flush", finish, priority=Priority.FLUSH, after=copies,
                                  needs={f"io:{tier}": 1}, tier=tier)

    def finish_flushes(self) -> list[Task]:
        """Schedule the flushes a stopped process left undone (killed or crashed before its
        background flushes ended): on each tier above the last, the committed versions the tier
        below lacks (with flush_every > 1, only branch heads and tagged versions), oldest first.
        Skipped for a tier another running process writes to (its own flushes are in flight).
        Returns the flush tasks. (Collective for fp.dist.Repo.)"""
        undone = [(k, vid) for k in range(len(self.stores) - 1) for vid in self.undone(k)]
        return [self.flush(vid, k) for k, vid in undone]

    def undone(self, k: int, ours: frozenset = frozenset()) -> list[str]:
        """The versions finish_flushes flushes from tier k to tier k + 1, oldest first; none
        while a running process other than this one (and the writers whose lease keys are in
        `ours`) writes to tier k."""
        store, below = self.stores[k], self.stores[k + 1]
        if self.leases.others_alive(store, ignore=ours):
            return []
        present, heads = self._committed_on(store)
        kept = heads | set(self.refs.targets("tags").values())
        undone = []
        for v in reversed(present):
            if v.id in self._flushing or (self.tier_specs[k].flush_every > 1 and v.id not in kept):
                continue
            if not self._holds_in_full(below, v.id):
                log.info("finishing the flush of version %s to %s", v.id, below.url)
                undone.append(v.id)
        return undone

    def _committed_on(self, store: Store) -> tuple[list, set]:
        """(The committed versions `store` holds in full, newest first; its branch heads.)"""
        present = sorted((m.version for m in self.history.manifests_in(store) if not m.version.pruned),
                         key=lambda v: v.time, reverse=True)
        heads = {self.refs.state_in(store, "heads", b)[1] for b in {v.branch for v in present}} - {None}
        committed = self.history.reachable(heads | set(self.refs.targets("tags").values()))
        return [v for v in present if v.id in committed], heads

    def _flush_encodes(self, m: Manifest, dst: Store, keys: list[str]):
        """How a flush of `m` to `dst` copies its objects under codec="auto": (FlushWay, or None
        when no chunk is under "auto"). Where the destination's AutoChoice (learnt from the
        flushes to it) says encoded writes are faster there, raw auto objects are encoded as
        they are copied, so saves into a fast tier stay raw while a slower tier below gets
        them encoded."""
        rules = codec_rules(self.options.codec)
        if not any(policy == "auto" for _, policy in rules):
            return None
        wanted = set(keys)
        items = {key: item for key, item in encodable_objects(m, rules, ("auto",)).items() if key in wanted}
        return FlushWay(items, choice_for(dst).pick(encoded_first=dst.bandwidth_hint is not None))

    def _copy_down(self, k: int, dst: Store, key: str, way) -> int:
        """Copy one object of a flush from tier k (or the tiers below it) to `dst`, encoded
        where `way` says so; auto objects are timed (decoded bytes) for the AutoChoice."""
        item = way.items.get(key) if way is not None else None
        if item is None:
            return copy_object(self.stores[k:], dst, key, parallel_map)
        way.meter.start()
        written = 0
        try:
            done = copy_encoded(self.stores[k:], dst, item, lambda: self._sched.hold("encode")) \
                if way.encoded else None
            copied = done[0] if done is not None else copy_object(self.stores[k:], dst, key, parallel_map)
            written = item.nbytes if copied else 0
            return copied
        finally:
            way.meter.finish(written)

    def _stub_ancestors(self, vid: str, dst: Store) -> None:
        """Give `dst` records (stubs) of the ancestors it lacks, so its history stays walkable."""
        parents = self.history.version_by_id(vid).parents
        while parents and parents[0] not in self._flushing and not dst.exists(f"versions/{parents[0]}.json"):
            try:
                parent = self.history.version_by_id(parents[0])
            except RefNotFoundError:
                return
            self._prune(parent.id, dst)
            parents = parent.parents

    def _descends(self, vid: str, ancestor: str) -> bool:
        """True when `ancestor` is `vid` or on its first-parent line (walked only as far as it)."""
        return any(v.id == ancestor for v in self.history.first_parents(vid, strict=False))

    def pinned(self, digest: str) -> bool:
        """True for objects a save or flush in flight relies on (call with the evict lock held)."""
        return (any(w.holds(digest) for w in self.writers)
                or any(digest in pins for pins in self._flush_pins.values())
                or self.compactor.running(object_key(digest)))

    def evict(self, k: int, spare: str | None = None) -> None:
        """Apply tier k's `keep`: drop versions beyond it (only once safe on the next tier)."""
        if self.tier_specs[k].keep is None:
            return
        with self.tier_locks[k]:
            self._evict_locked(k, spare)

    def _evict_locked(self, k: int, spare: str | None) -> None:
        spec, store = self.tier_specs[k], self.stores[k]
        last = k == len(self.stores) - 1
        if spec.keep is None:
            return
        present, heads = self._committed_on(store)
        pinned = set(heads) | set(self.refs.targets("tags").values()) | {spare}
        busy = set(self._flushing)
        excess = len(present) - spec.keep
        victims = []
        if self._future_order:
            candidates = [v.id for v in present if v.id not in pinned and v.id not in busy]
            while excess > 0 and candidates:
                victim = farthest_next_use(candidates, self._future_order)
                candidates.remove(victim)
                victims.append(victim)
                excess -= 1
        else:
            for v in reversed(present):
                if excess <= 0 or v.id in busy:
                    break
                if v.id not in pinned:
                    victims.append(v.id)
                    excess -= 1
        if not victims:
            return
        for vid in victims:
            if last:
                self._prune(vid, store)
                continue
            nxt = self.stores[k + 1]
            if not nxt.exists(f"versions/{vid}.json"):
                if not self.rules.writes_below(k):
                    # the process that flushes it may be copying it now (a node-local tier
                    # shared with rank 0): it goes once it is below, flushed or a stub
                    continue
                self._prune(vid, nxt)
            store.delete(f"versions/{vid}.json")
            store.delete(replica_record_key(vid))
            self.history.cache.pop(vid)
        with self.evict_lock:
            live = set()
            for m in self.history.manifests_in(store):
                live |= object_keys(m)
            sweep(store, live, self.pinned, self.rules.sweep_min_age(k))

    def where(self, vid: str) -> list[str]:
        """The URLs of the tiers that hold version `vid` in full (its manifest, not the stub of
        a pruned or evicted version), fastest first."""
        return [st.url for st in self.stores if self._holds_in_full(st, vid)]

    def _holds_in_full(self, store: Store, vid: str) -> bool:
        """True when `store` holds version `vid`'s manifest (not the stub of a pruned or evicted one)."""
        key = f"versions/{vid}.json"
        try:
            return not version_from_bytes(store.read(key), f"{store.url}/{key}").pruned
        except FileNotFoundError:
            return False

    def forget_next_use(self, vid: str) -> None:
        """Drop version `vid` from the expected access order (see prefetch): it was just read."""
        with self._lock:
            if vid in self._future_order:
                self._future_order.remove(vid)

    def prefetch(self, vids: list[str], order: list[str] | None = None) -> list[Task]:
        """Copy versions `vids` to the fastest tier in the background; return their tasks.
        `order`, when given, is the expected future access order (version ids); tier 0 then
        evicts the version whose next use is farthest away."""
        if order is not None:
            self._future_order = list(order)
        return [self._sched.submit("prefetch", lambda vid=vid: self._promote(vid), priority=Priority.PREFETCH,
                                   needs={"io:tier0": 1}, tier="tier0") for vid in vids]

    def _promote(self, vid: str) -> None:
        top = self.stores[0]
        if top.exists(f"versions/{vid}.json"):
            return
        source = next((st for st in self.stores[1:] if st.exists(f"versions/{vid}.json")), None)
        if source is None:
            raise RefNotFoundError(f"version {vid} is on no tier of {top.url}")
        m = self.history.manifest_by_id(vid)
        if m.version.pruned:
            return
        keys = sorted(object_keys(m))
        self.leases.hold(top)
        for key in keys:
            copy_object(self.stores[1:], top, key, parallel_map)
        top.barrier(keys)
        copy_manifest(source, top, vid)
        self.evict(0, spare=vid)
