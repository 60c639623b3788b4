"""Integrity and space: verify, retention, gc, usage."""

import re
import time

from ..engine.restore import ReadRequest, read_leaves
from ..engine.objectwriter import stored_header
from ..errors import CorruptObjectError, FormatError, ForkpointError
from ..format.manifest import Manifest, Version, stub_bytes
from ..format.objects import is_object_key, object_key, runs_of_bytes
from ..format.refs import decode_record, record_key, seq_of
from ..state.leaves import empty_leaf
from ..storage import Store
from .records import GcReport, VerifyReport
from .ledger import CommitLedger
from .refs import drop_old_records


class Maintenance:
    """Integrity and space of one repository's tiers: verify, retention (prune), gc and usage.
    A Repo's collaborator, reached as `repo.maintenance`: `submit_read` schedules a read,
    `pinned(digest)` (called with `evict_lock` held) names objects a save or flush in flight
    relies on, and `ledger` this process's commits."""

    def __init__(self, stores: list[Store], refs, history, leases, ledger: CommitLedger, submit_read,
                 pinned, evict_lock):
        self.stores, self.refs, self.history, self.leases, self.ledger = stores, refs, history, leases, ledger
        self._submit_read, self._pinned, self._evict_lock = submit_read, pinned, evict_lock

    def verify(self, ref: str | None = None, progress=None) -> VerifyReport:
        """Re-read and re-hash every object of `ref` (or of every version) on every tier holding it."""
        wanted = {self.history.resolve(ref)} if ref is not None else None
        report = VerifyReport()
        damaged: dict[str, tuple[str, dict, set]] = {}  # object -> (why, {version: step}, leaves)
        if ref is None:
            report.problems.extend(self._lineage_problems())
        seen, verified = set(), set()  # verified: (tier, chunk) read back intact
        for store in self.stores:
            for vid in self.history.version_ids(store):
                if wanted is not None and vid not in wanted:
                    continue
                key = f"versions/{vid}.json"
                try:
                    m = Manifest.from_bytes(store.read(key), f"{store.url}/{key}")
                except Exception as e:  # a broken manifest is a problem to report, not to stop at
                    report.problems.append(str(e))
                    continue
                if vid not in seen and not m.version.pruned:
                    seen.add(vid)
                    report.versions += 1
                leaves = [leaf for leaf in m.leaves if leaf.alias_of is None]
                unread = [leaf for leaf in leaves
                          if not all((store.url, _chunk_key(c)) in verified for c in leaf.chunks)]
                for group in runs_of_bytes(unread, VERIFY_GROUP_BYTES):
                    for leaf, error in self._read_back(store, vid, group):
                        if error is None:
                            verified.update((store.url, _chunk_key(c)) for c in leaf.chunks)
                            continue
                        found = _DAMAGED_OBJECT.search(str(error))
                        if found is None:
                            report.problems.append(str(error))
                        else:
                            what = damaged.setdefault(found["object"], (found["why"], {}, set()))
                            what[1][vid] = m.version.step
                            what[2].add(leaf.path)
                for leaf in leaves:
                    report.objects += len(leaf.chunks)
                    report.bytes += leaf.nbytes
                    if progress is not None:
                        progress(leaf.nbytes)
        for obj, (why, versions, leaves) in damaged.items():
            report.problems.append(f"object {obj} {why}; it holds {_some(sorted(leaves))} of "
                                   f"{len(versions)} version(s): "
                                   + _some([f"{vid[:12]} (step {step})" for vid, step in versions.items()]))
        return report

    def _read_back(self, store: Store, vid: str, leaves: list) -> list[tuple]:
        """(leaf, None or the error reading it back) for each of `leaves` of version `vid` from
        `store`, re-hashing every byte: one read of all (objects shared by leaves, such as
        packs, are read once), and where that fails, one read per leaf to name the damaged."""
        def read(group):
            requests = [ReadRequest(leaf, empty_leaf("bytes", "uint8", [leaf.nbytes], "cpu", leaf.path)[1])
                        for leaf in group]
            read_leaves(store, requests, vid, self._submit_read, trust=False)

        try:
            read(leaves)
            return [(leaf, None) for leaf in leaves]
        except Exception as e:
            if len(leaves) == 1:
                return [(leaves[0], e)]
        outcomes = []
        for leaf in leaves:
            try:
                read([leaf])
                outcomes.append((leaf, None))
            except Exception as e:
                outcomes.append((leaf, e))
        return outcomes

    def _lineage_problems(self) -> list[str]:
        """What is wrong with the refs and the histories they reach, one line each: ref records
        that cannot be read, refs to versions on no tier, and ancestors that are missing,
        damaged or loop (the breaks that make gc refuse to run)."""
        problems, walked = [], set()
        for kind, noun in (("heads", "branch"), ("tags", "tag")):
            for name in self.refs.names(kind):
                try:
                    vid = self.history.ref_target(kind, name)
                    if vid is None or vid in walked:
                        continue
                    for v in self.history.first_parents(vid):
                        if v.id in walked:
                            break
                        walked.add(v.id)
                except ForkpointError as e:
                    problems.append(f"{noun} {name}: {e}")
        return problems

    # ----------------------------------------------------------------- retention and gc
    def _chains(self) -> dict[str, list[Version]]:
        return {name: list(self.history.first_parents(vid)) for name, vid in self.refs.targets("heads").items()}

    def prune_plan(self, keep, branches: list[str] | None = None) -> list[str]:
        """Return ids of versions `keep` would prune on `branches` (default: all)."""
        chains = self._chains()
        tagged = set(self.refs.targets("tags").values())
        protected = set(tagged) | {c[0].id for c in chains.values() if c}
        chosen = set(chains) if branches is None else set(branches)
        candidates = []
        for name, chain in chains.items():
            if name not in chosen:
                protected.update(v.id for v in chain)
                continue
            live = [v for v in chain if not v.pruned]
            protected.update(keep.select(live, tagged))
            candidates.extend(v.id for v in live)
        return sorted({c for c in candidates if c not in protected})

    def prune(self, vid: str, store: Store | None = None, barrier: bool = True) -> list[Store]:
        """Replace the version's manifest on `store` (default: every tier holding it) by a stub;
        return the stores written (without `barrier`, the caller makes the stubs durable)."""
        stub = stub_bytes(self.history.version_by_id(vid))
        key = f"versions/{vid}.json"
        targets = [store] if store is not None else [st for st in self.stores if st.exists(key)]
        for st in targets:
            st.write(key, [stub])
            if barrier:
                st.barrier([key])
        self.history.cache.pop(vid, None)
        return targets

    def gc(self, keep=None, branches: list[str] | None = None, dry_run: bool = False,
           grace: float = 600.0) -> GcReport:
        """Prune versions by `keep`, then delete objects no version needs and stale temp files.

        Objects, manifests and temp files younger than `grace` seconds are kept, so gc is safe
        while other processes save (a save must finish within `grace`). Where no other
        process holds a writer lease younger than `grace` (repo.writers), objects and
        manifests older than QUIET_MARGIN seconds go at once.
        """
        started = time.thread_time()
        report = GcReport(dry_run=dry_run)
        since = self.ledger.seq
        self._live_versions()
        if keep is not None:
            report.pruned_versions = self.prune_plan(keep, branches)
        pruned = set(report.pruned_versions)
        pruning = time.thread_time()
        if not dry_run:
            written: dict[int, tuple[Store, list[str]]] = {}
            for vid in report.pruned_versions:
                for st in self.prune(vid, barrier=False):
                    written.setdefault(id(st), (st, []))[1].append(f"versions/{vid}.json")
            for st, keys in written.values():
                st.barrier(keys)
        pruning = time.thread_time() - pruning
        now = time.time()
        reachable = self._live_versions()
        for store in self.stores:
            pruning += self._gc_store(store, reachable, pruned, now, grace, dry_run, report, since)
        report.scan_cpu_seconds = round(time.thread_time() - started - pruning, 6)
        return report

    def _live_versions(self) -> set[str]:
        """Every version a branch or tag reaches through first parents. Raises (naming the ref,
        record or version, before gc deletes anything) where a ref record is unreadable, a ref's
        version or an ancestor is on no tier, a record is damaged or the parents loop: what lies
        behind such a break cannot be proven unreachable."""
        try:
            targets = set()
            for kind in ("heads", "tags"):
                for name, vid in self.refs.targets(kind).items():
                    targets.add(vid if self.history.has_manifest(vid) else self.history.ref_target(kind, name))
            return self.history.reachable(targets, strict=True)
        except ForkpointError as e:
            raise type(e)(f"gc refused to run and deleted nothing: {e}") from None

    def _gc_store(self, store, reachable: set, pruned: set, now: float, grace: float,
                  dry_run: bool, report: GcReport, since: int) -> float:
        """Sweep one tier: orphan manifests, unreferenced objects, stale temp files, old refs.
        Nothing committed by this process after commit number `since` is touched. Returns
        the CPU seconds spent deleting objects (work that grows with what was pruned)."""
        deadline = now - grace
        if grace > 0:
            quiet = self.leases.quiet_since(store, grace, dry_run)
            if quiet is None:
                report.others_writing.append(store.url)
            else:
                deadline = max(deadline, quiet)
        live_objects = self._sweep_manifests(store, reachable, pruned, deadline, dry_run, report, since)
        deleting = self._sweep_objects(store, live_objects, deadline, dry_run, report, since)
        self._sweep_temp(store, deadline, dry_run, report)
        if not dry_run:
            self._compact_refs(store, now, grace)
        return deleting

    def _sweep_manifests(self, store, reachable: set, pruned: set, deadline: float, dry_run: bool,
                         report: GcReport, since: int) -> set:
        """Delete the manifests no ref reaches that are older than `deadline` (none committed
        by this process after `since`, none in commit); return the objects the rest refer to."""
        live_objects = set()
        for m in self.history.manifests_in(store):
            vid = m.version.id
            key = f"versions/{vid}.json"
            orphan = False
            if vid not in reachable:
                try:
                    orphan = store.mtime(key) < deadline
                except FileNotFoundError:
                    continue
            if orphan and not self.ledger.committed_since(since, vid) and not self.ledger.in_commit(vid):
                report.deleted_manifests += 1
                if not dry_run:
                    store.delete(key)
                    self.history.cache.pop(vid, None)
                continue
            if vid not in pruned:
                live_objects.update(m.objects())
        return live_objects

    def _sweep_objects(self, store, live_objects: set, deadline: float, dry_run: bool, report: GcReport,
                       since: int) -> float:
        """Delete the objects not in `live_objects`, older than `deadline` and not pinned by a
        save in flight; return the CPU seconds the deletes took."""
        deleting = 0.0
        for key in store.list("objects"):
            if not is_object_key(key):
                report.left_alone.append(key)
                continue
            name = key.rsplit("/", 1)[-1]
            if name in live_objects:
                continue
            try:
                if store.mtime(key) >= deadline:
                    report.kept_young += 1
                    continue
                size = store.size(key)
            except FileNotFoundError:
                continue
            with self._evict_lock:
                if self._pinned(name) or self.ledger.committed_since(since, name):
                    continue
                try:  # a save of another process may have reused (touched) it since the listing
                    if store.fresh_mtime(key) >= deadline:
                        continue
                except FileNotFoundError:
                    continue
                report.deleted_objects += 1
                report.freed_bytes += size
                if not dry_run:
                    begun = time.thread_time()
                    store.delete(key)
                    deleting += time.thread_time() - begun
        return deleting

    @staticmethod
    def _sweep_temp(store, deadline: float, dry_run: bool, report: GcReport) -> None:
        """Delete temp files older than `deadline` (LocalStore.delete spares its own in flight)."""
        for key in store.list("tmp"):
            try:
                if store.mtime(key) < deadline:
                    report.deleted_temp += 1
                    if not dry_run:
                        store.delete(key)
                else:
                    report.kept_young += 1
            except FileNotFoundError:
                pass

    def _compact_refs(self, store, now: float, grace: float) -> None:
        """Drop old ref records; a ref deleted more than `grace` seconds ago loses all of them
        (newest last), so listing refs costs nothing for the tags and branches that were removed
        (a Trainer's `checkpoint-<step>` tags, say)."""
        by_ref: dict[tuple[str, str], list[int]] = {}
        for key in store.list("refs"):
            seq = seq_of(key)
            if seq is not None and key.count("/") == 3:
                _, kind, name, _ = key.split("/")
                by_ref.setdefault((kind, name), []).append(seq)
        for (kind, name), seqs in by_ref.items():
            seqs.sort()
            newest = record_key(kind, name, seqs[-1])
            try:
                gone = (decode_record(store.read(newest), f"{store.url}/{newest}")["target"] is None
                        and now - store.mtime(newest) > grace)
            except FileNotFoundError:
                continue
            if gone:
                for seq in seqs:
                    store.delete(record_key(kind, name, seq))
            else:
                drop_old_records(store, kind, name, seqs)

    def du(self) -> dict:
        """Logical and stored bytes per version (newest first) and branch, the objects' total,
        and per codec (as the object headers say now) the decoded and stored bytes of the
        distinct objects in use. A version's `stored_bytes` is what its save wrote (before any
        encoding after the commit). A branch's `held_bytes` is what the distinct objects its
        unpruned versions need (delta bases included) take on the store now; `exclusive_bytes`
        the part of it no other branch or tag needs: what deleting the branch and a gc would free."""
        versions = {vid: self.history.version_by_id(vid) for vid in self.history.version_ids()}
        objects: dict[str, str] = {}
        needs: dict[str, set[str]] = {}
        for vid, v in versions.items():
            if v.pruned:
                continue
            needed = needs[vid] = set()
            for leaf in self.history.manifest_by_id(vid).leaves:
                for c in leaf.chunks:
                    objects[c.object] = "delta+" if c.delta else ""
                    needed.add(c.object)
                    for base in (c.delta or {}).get("chain", []):
                        objects.setdefault(base, "delta chain (pruned version): ")
                        needed.add(base)
        sizes: dict[str, int | None] = {}
        for digest in objects:
            try:
                sizes[digest] = self.stores[0].size(object_key(digest))
            except FileNotFoundError:
                sizes[digest] = None
        chains = self._chains()
        held = {name: set().union(*(needs.get(v.id, set()) for v in chain)) for name, chain in chains.items()}
        tagged = set().union(*(needs.get(vid, set()) for vid in self.refs.targets("tags").values()))
        branches = {}
        for name, chain in chains.items():
            others = tagged.union(*(objs for other, objs in held.items() if other != name))
            branches[name] = {"versions": len(chain),
                              "logical_bytes": sum(v.logical_bytes for v in chain if not v.pruned),
                              "stored_bytes": sum(v.stored_bytes for v in chain if not v.pruned),
                              "held_bytes": sum(sizes[o] or 0 for o in held[name]),
                              "exclusive_bytes": sum(sizes[o] or 0 for o in held[name] - others)}
        total = sum(self.stores[0].size(k) for k in self.stores[0].list("objects"))
        codecs = self._codec_usage(objects, sizes)
        return {"versions": [{"id": v.id, "branch": v.branch, "step": v.step, "pruned": v.pruned,
                              "logical_bytes": v.logical_bytes, "stored_bytes": v.stored_bytes}
                             for v in sorted(versions.values(), key=lambda v: v.time, reverse=True)],
                "branches": branches, "objects_bytes": total, "codecs": codecs}

    def _codec_usage(self, objects: dict[str, str], sizes: dict[str, int | None]) -> dict:
        """{codec (prefixed by `objects`' label): objects, decoded and stored bytes} of the
        objects present. Decoded bytes are the header's length, not the extent the chunks use:
        a packed object holds leaves of other versions too."""
        codecs: dict[str, dict] = {}
        for digest, label in objects.items():
            stored = sizes[digest]
            if stored is None:
                continue
            try:
                name, decoded = stored_header(self.stores[0], object_key(digest))
                codec = label + name
            except FileNotFoundError:
                continue
            except (CorruptObjectError, FormatError):
                codec, decoded = label + "damaged (unreadable header)", 0
            entry = codecs.setdefault(codec, {"objects": 0, "decoded_bytes": 0, "stored_bytes": 0})
            entry["objects"] += 1
            entry["decoded_bytes"] += decoded
            entry["stored_bytes"] += stored
        return codecs


class MaintenanceCommands:
    """The upkeep commands of a Repo's public API, over `self.maintenance` (see repo.core)."""

    maintenance: Maintenance

    def verify(self, ref: str | None = None, progress=None) -> VerifyReport:
        """Re-read and re-hash every object of `ref` (or of every version) on every tier holding it."""
        return self.maintenance.verify(ref, progress)

    def prune_plan(self, keep, branches: list[str] | None = None) -> list[str]:
        """Return ids of versions `keep` would prune on `branches` (default: all)."""
        return self.maintenance.prune_plan(keep, branches)

    def gc(self, keep=None, branches: list[str] | None = None, dry_run: bool = False,
           grace: float = 600.0) -> GcReport:
        """Prune versions by `keep`, then delete objects no version needs and stale temp files
        (see Maintenance.gc: what is younger than `grace` seconds stays)."""
        return self.maintenance.gc(keep, branches, dry_run, grace)

    def du(self) -> dict:
        """Logical and stored bytes per version, branch and codec (see Maintenance.du)."""
        return self.maintenance.du()


_DAMAGED_OBJECT = re.compile(r"object (?P<object>\S+?/objects/[^\s:]+)(?::| )\s*(?P<why>.*)", re.S)


VERIFY_GROUP_BYTES = 256 << 20
"""Leaf bytes read back (and held) at once by verify."""


def _chunk_key(chunk) -> tuple:
    """What makes two chunks the same bytes read the same way."""
    chain = tuple(chunk.delta["chain"]) if chunk.delta else ()
    return chunk.object, chunk.start, chunk.size, chunk.hash, chunk.codec, chain


def _some(items: list[str], shown: int = 5) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
