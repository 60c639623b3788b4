"""Node-local tier 0 of a distributed repository: which ranks share it, the per-node record of
each version, the coordinated flush to the shared tier below, eviction where other processes
write, and a restore that agrees on a version every rank can read.

Each node keeps a whole copy of the replicated state (spread over its ranks) and its ranks'
shards; rank 0 gives each object of a flushed version to one rank that holds it, and commits
the version below once every rank reported its copies durable.
"""

import contextlib
import json
import logging

from ..errors import CorruptObjectError, ForkpointError, MissingObjectError, RefNotFoundError
from ..format.manifest import Manifest, Version
from ..format.objects import object_key
from ..repo.history import check_id
from ..repo.placement import FlushRules

log = logging.getLogger("forkpoint")


def process_private(url: str) -> bool:
    """True for a store only its own process reaches (the in-memory tier)."""
    return url.startswith("mem://")


class NodeLocalMixin:
    """The node-local behaviour of fp.dist.Repo (see the module doc), and its collective
    finish_flushes; the rest is inert when tier 0 is shared by every rank (`node_ranks` is None)."""

    def _node_group(self, host: str) -> list[int] | None:
        """The ranks that share this rank's node-local tier 0 (None when tier 0 is shared by
        all): same host and tier-0 URL; a `mem://` tier is private to its process. Sets
        `node_leaders`, the first rank of every node."""
        spec = self.tier_specs[0]
        private = process_private(spec.url)
        self.node_leaders: list[int] = []
        if not (spec.local or private):
            return None
        key = (host, spec.url, self.rank if private else None)
        keys = self.group.all_gather(key)
        self.node_leaders = sorted({keys.index(k) for k in keys})
        return [r for r, k in enumerate(keys) if k == key]

    @property
    def node_local(self) -> bool:
        """True when tier 0 is local to each node (or process)."""
        return self.node_ranks is not None

    def _record_locally(self, sid: str, vid: str) -> list[str]:
        """(Other ranks, node-local tier 0) the first rank of each node fetches the manifest
        rank 0 committed, writes it into the node's tier 0, moves the branch head there and
        says so; the node's other ranks then read it from there (so the process group's store
        serves the manifest once per node). Return the objects this rank flushes."""
        flush = json.loads(self.coordinator.get(sid, f"flush/{self.rank}"))
        key = f"versions/{vid}.json"
        leader = self.node_ranks[0]
        if leader == self.rank:
            data = self.coordinator.get(sid, "manifest")
            manifest = Manifest.from_bytes(data, f"save outcome of version {vid}")
            if not self.store.exists(key):
                self.store.write(key, [data])
                self.store.barrier([key])
                with self.placement.tier_locks[0]:
                    self.refs.move(self.store, "heads", manifest.version.branch, vid)
            self.coordinator.set(sid, f"recorded/{self.rank}", "1")
        else:
            if leader != 0:
                self.coordinator.get(sid, f"recorded/{leader}", wait=True)
            manifest = Manifest.from_bytes(self.store.read(key), f"{self.store.url}/{key}")
        self.history.cache.put(vid, manifest)
        return flush

    def finish_flushes(self) -> list:
        """Collective (every rank calls it, as Checkpointer.resume does): finish the flushes a
        stopped job left undone. Rank 0 flushes between tiers every rank reaches. With a
        node-local tier 0, the committed versions rank 0's node holds and the shared tier lacks
        are flushed as a save's are: each object by a rank whose node holds it, committed below
        by rank 0 once every rank's copies are durable. A version whose objects neither this
        job's nodes nor the tier below hold (a node left or was wiped) stays where it is.
        Returns this rank's flush tasks."""
        ours = frozenset(self._from_every_rank("reading the writer leases", self.leases.key))
        node = self._node_flushes(ours) if self.node_local else []
        below = [(k, vid) for k in range(1 if self.node_local else 0, len(self.stores) - 1)
                 for vid in self.placement.undone(k, ours)] if self.rank == 0 else []
        tasks = []
        for m, share in node:
            self.history.cache.put(m.version.id, m)
            with self.placement.rules.sharing(share):
                tasks.append(self.placement.flush(m.version.id, 0))
        return tasks + [self.placement.flush(vid, k) for k, vid in below]

    def _node_flushes(self, ours: frozenset) -> list[tuple[Manifest, list[str]]]:
        """(Node-local tier 0, collective) rank 0 offers the versions its node's tier 0 holds
        and the shared tier lacks; every rank reports which of their objects its node holds
        (and whether another running process writes to its tier 0); rank 0 says which can be
        flushed. Returns (manifest, the objects this rank copies) for each of those."""
        offer = self._from_rank_0("listing the versions its tier 0 has not flushed", lambda: [
            (vid, self.history.manifest_by_id(vid).to_bytes()) for vid in self.placement.undone(0, ours)])
        manifests = []

        def report():
            for vid, data in offer:
                where = f"version {vid} from rank 0's tier 0"
                manifests.append(Manifest.from_bytes(data, where))
                check_id(manifests[-1].version, vid, where)
            held = [sorted(o for o in m.objects() if self.store.exists(object_key(o))) for m in manifests]
            return self.leases.others_alive(self.store, ignore=ours), held

        reports = self._from_every_rank("reading its tier 0", report)
        busy = [r for r, (alive, _) in enumerate(reports) if alive]
        if busy and manifests and self.rank == 0:
            log.info("not finishing flushes: another running process writes to the tier 0 of rank(s) %s", busy)
        go = self._from_rank_0("checking the shared tier", lambda: [
            not busy and self._flushable(m, [h[i] for _, h in reports]) for i, m in enumerate(manifests)])
        return [(m, assign_flush(m, [{"held": h[i]} for _, h in reports])[self.rank])
                for i, m in enumerate(manifests) if go[i]]

    def _from_rank_0(self, what: str, compute):
        """Rank 0's compute(), on every rank; ForkpointError on every rank if it raised there."""
        mine = None
        if self.rank == 0:
            try:
                mine = (True, compute())
            except Exception as e:
                mine = (False, f"{type(e).__name__}: {e}")
        done, value = self.group.broadcast(mine)
        if not done:
            raise ForkpointError(f"finish_flushes: rank 0 failed {what}: {value}")
        return value

    def _from_every_rank(self, what: str, compute) -> list:
        """Every rank's compute(), in rank order, on every rank; ForkpointError on every rank
        naming the ranks where it raised."""
        try:
            mine = (True, compute())
        except Exception as e:
            mine = (False, f"{type(e).__name__}: {e}")
        everyone = self.group.all_gather(mine)
        failed = {r: value for r, (done, value) in enumerate(everyone) if not done}
        if failed:
            raise ForkpointError(f"finish_flushes: rank(s) {sorted(failed)} failed {what}: "
                                 + "; ".join(f"rank {r}: {v}" for r, v in failed.items()))
        return [value for _, value in everyone]

    def _flushable(self, m: Manifest, held: list[list[str]]) -> bool:
        """(Rank 0) True when every object of `m` is held by some rank's node (`held`, per
        rank) or already on the shared tier below."""
        anywhere = set().union(*held)
        lacking = [o for o in m.objects() if o not in anywhere and not self.stores[1].exists(object_key(o))]
        if lacking:
            log.warning("version %s is not flushed to %s: %d of its objects are on no node of this job "
                        "(nor below), e.g. %s", m.version.id, self.stores[1].url, len(lacking), lacking[0])
        return not lacking

    def restore(self, state, ref: str = "main", *args, **kwargs) -> Version:
        """Collective restore. With a node-local tier 0 the ranks agree on the version: `ref`
        as every rank sees it; if they see it differently (a node lost its tier 0), or some
        rank misses objects of it (another node wrote them and they were not flushed, e.g.
        after a change of world size), the version the shared tier below has for `ref`."""
        if not self.node_local:
            return self.repo.restore(state, ref, *args, **kwargs)
        recovered = self.recover(ref)
        if recovered is not None:
            ref = recovered.vid
        try:
            return self._agreed_restore(state, ref, *args, **kwargs)
        finally:
            if self.replicator is not None:
                self.replicator.start_reseed()

    def _agreed_restore(self, state, ref: str, *args, **kwargs) -> Version:
        """The node-local restore proper (see restore)."""
        try:
            mine = self.resolve(ref)
        except RefNotFoundError:
            mine = None
        seen = self.group.all_gather(mine)
        failure, failed = None, []
        if len(set(seen)) == 1 and mine is not None:
            try:
                version = self.repo.restore(state, mine, *args, **kwargs)
            except (MissingObjectError, CorruptObjectError) as e:
                failure = e
            flags = self.group.all_gather(failure is not None)
            failed = [r for r, f in enumerate(flags) if f]
            if not failed:
                return version
        shared = self._shared_version(ref)
        if shared is None or (failed and shared == mine):
            if failure is not None:
                raise failure
            why = (f"rank(s) {failed} could not read version {mine}" if failed else
                   f"ranks resolve {ref!r} differently ({sorted(set(map(str, seen)))})")
            raise MissingObjectError(f"{why}, and no shared tier of {self.url} has another version for "
                                     f"{ref!r}: a node lost its tier 0 before the version was flushed")
        return self.repo.restore(state, shared, *args, **kwargs)

    def _shared_version(self, ref: str) -> str | None:
        """`ref` as the shared tiers (below the node-local one) resolve it, or None."""
        for store in self.stores[1:]:
            for kind in ("heads", "tags"):
                target = self.refs.state_in(store, kind, ref)[1]
                if target is not None:
                    return target
        if all(c in "0123456789abcdef" for c in ref) and any(
                st.exists(f"versions/{ref}.json") for st in self.stores[1:]):
            return ref
        return None



class NodeLocalFlushRules(FlushRules):
    """How a rank of fp.dist.Repo takes part in flushes. From a node-local tier 0 it copies
    its share of each version (see assign_flush) and reports it; rank 0 commits the version
    below once every rank's report is in. Eviction from a tier other processes write to
    spares unreferenced objects younger than `sweep_grace` seconds (their saves in flight)."""

    def __init__(self, rank: int, stores: list, node_ranks: list[int] | None, coordinator, sweep_grace: float):
        self.rank, self.stores, self.node_ranks = rank, stores, node_ranks
        self.coordinator, self.sweep_grace = coordinator, sweep_grace
        self._share: list[str] | None = None

    @contextlib.contextmanager
    def sharing(self, digests: list[str] | None):
        """Within it, a flush from node-local tier 0 that this rank schedules copies the objects
        `digests` (its share, see assign_flush): a version's commit schedules its flush within it."""
        self._share = digests
        try:
            yield
        finally:
            self._share = None

    def keys(self, vid: str, k: int, m: Manifest) -> list[str]:
        if k == 0 and self.node_ranks is not None:
            return [object_key(o) for o in self._share or []]
        return super().keys(vid, k, m)

    def gate(self, vid: str, k: int, failed: BaseException | None) -> bool:
        """(Node-local tier 0) report this rank's copies; rank 0 waits for every rank's report
        and then commits the version below; a failed or missing report fails the flush."""
        if not (k == 0 and self.node_ranks is not None):
            return super().gate(vid, k, failed)
        sid = f"flush-{vid}"
        self.coordinator.publish(sid, {"error": f"{type(failed).__name__}: {failed}"} if failed else {})
        if failed is not None:
            raise failed
        if self.rank != 0:
            return False
        self.coordinator.gather(sid)
        return True

    def writes_below(self, k: int) -> bool:
        return not (k == 0 and self.node_ranks is not None and self.rank != 0)

    def sweep_min_age(self, k: int) -> float:
        private = process_private(self.stores[k].url)
        return 0.0 if private or (k == 0 and self.node_ranks == [self.rank]) else self.sweep_grace


def check_node_local(url, tiers, api_name: str = "fp.dist.Repo") -> None:
    """Refuse a node-local (or per-process mem://) tier 0 without a shared tier below it or
    without `keep`, before any rank opens anything."""
    tiers = list(tiers) if tiers else [url]
    first = tiers[0]
    name = str(getattr(first, "url", first))
    if not (getattr(first, "local", False) or process_private(name)):
        return
    if len(tiers) < 2:
        raise ValueError(f"tier 0 ({name}) is node-local: give {api_name} a shared tier below it "
                         "(tiers=[fp.tier(local, local=True), shared]), where every node's part of a "
                         "version goes, or use storage every rank reaches")
    if getattr(first, "keep", None) is None:
        raise ValueError(f"tier 0 ({name}) is node-local: give it keep= (e.g. fp.tier({name!r}, keep=2, "
                         "local=True)); retention (gc) runs on rank 0 alone, so only the tier's own keep "
                         "bounds what the other nodes hold")


def assign_flush(manifest: Manifest, parts: list[dict]) -> list[list[str]]:
    """(Node-local tier 0) which objects each rank copies to the shared tier: each object of
    the manifest goes to the rank holding it that has the fewest so far (rank 0 takes those
    no rank holds: they must be on the shared tier already)."""
    holders: dict[str, list[int]] = {}
    for r, part in enumerate(parts):
        for o in part.get("held", ()):
            holders.setdefault(o, []).append(r)
    out: list[list[str]] = [[] for _ in parts]
    for o in sorted(manifest.objects()):
        ranks = holders.get(o, [0])
        out[min(ranks, key=lambda r: (len(out[r]), r))].append(o)
    return out
