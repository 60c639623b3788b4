"""Repo: versions, refs, lineage, load/restore, diff, verify and gc — the public core.

A repository is a store holding `forkpoint.json`, `objects/`, `versions/` and `refs/`.
A version is visible once its manifest is durable and a ref record points at it.
"""

import json
import os
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from . import __version__
from .engine.restore import ReadRequest, read_leaves
from .engine.save import KnownChunk, SaveOptions, object_key, schedule_save, staging_sizes
from .engine.scheduler import Budget, Priority, Scheduler, Task
from .engine.staging import StagingPool
from .errors import (ConflictError, CorruptObjectError, FormatError, MissingObjectError,
                     PrunedVersionError, RefNotFoundError, RepoNotFoundError, StateMismatchError)
from .format.manifest import FORMAT_VERSION, Leaf, Manifest, Version, check_format
from .format.paths import has_prefix
from .format.refs import check_name, decode_record, encode_record, parse_ref_expr, record_key, seq_of
from .state import capture, flatten, is_module, merge, restore_objects, unflatten, walk_skeleton
from .state.leaves import empty_leaf, finish_leaf, is_torch_tensor, live_buffer
from .state.skeleton import rename as rename_skeleton
from .state.skeleton import select as select_skeleton
from .storage import Store, open_store
from .tiers import Tier, farthest_next_use, open_tiers
from .tiers.movement import copy_manifest, copy_object, object_keys, sweep

REPO_MARKER = "forkpoint.json"
REPO_KIND = "forkpoint.repository"
REF_RECORDS_KEPT = 4


@dataclass
class LeafDiff:
    """How one path differs between two versions."""

    path: str
    status: str
    detail: str = ""
    max_abs: float | None = None
    rel_l2: float | None = None


@dataclass
class Divergence:
    """The earliest step at which two branches' states differ beyond tolerance."""

    step: int
    version_a: str
    version_b: str
    paths: list[str]
    max_abs: float | None


@dataclass
class VerifyReport:
    """What `verify` checked and the problems it found (empty when all is well)."""

    versions: int = 0
    objects: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class GcReport:
    """What `gc` removed (or would remove, on a dry run)."""

    pruned_versions: list[str] = field(default_factory=list)
    deleted_objects: int = 0
    freed_bytes: int = 0
    deleted_manifests: int = 0
    deleted_temp: int = 0
    dry_run: bool = False


class PendingSave:
    """A save running in the background: `done()`, `wait(timeout)` -> Version.

    `captured()` tells whether every tensor has been copied out of live memory;
    `wait_capture()` blocks until then (after which the state may be changed freely).
    """

    def __init__(self, commit: Task, captures: list[Task], by_pointer: dict[int, list[Task]]):
        self._commit = commit
        self._captures = captures
        self.capture_map = by_pointer

    def done(self) -> bool:
        return self._commit.done()

    def wait(self, timeout: float | None = None) -> Version:
        return self._commit.result(timeout)

    def captured(self) -> bool:
        return all(t.done() for t in self._captures)

    def wait_capture(self) -> None:
        for t in self._captures:
            t.result()


def _environment() -> dict:
    env = {"forkpoint": __version__, "python": sys.version.split()[0], "numpy": np.__version__,
           "hostname": socket.gethostname(), "pid": os.getpid(),
           "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            env["world_size"] = dist.get_world_size()
    return env


class Repo:
    """A forkpoint repository at `url`: a local path, file://, mem://name, or an fsspec URL
    such as s3://bucket/prefix (`storage_options` go to the fsspec file system)."""

    def __init__(self, url: str | Store | None = None, create: bool = False, codec: str = "raw",
                 on_conflict: str = "retry", workers: int = 4, options: SaveOptions | None = None,
                 storage_options: dict | None = None, tiers: list | None = None):
        if tiers is not None:
            if url is not None:
                raise ValueError("give either url or tiers, not both")
            self.tier_specs, self.stores = open_tiers(tiers)
        elif url is None:
            raise ValueError("Repo needs a url (or tiers=[...])")
        else:
            store = url if isinstance(url, Store) else open_store(str(url), **(storage_options or {}))
            self.tier_specs, self.stores = [Tier(store.url)], [store]
        self.store = self.stores[0]
        self.url = self.store.url
        if on_conflict not in ("retry", "error"):
            raise ValueError(f"on_conflict must be 'retry' or 'error', got {on_conflict!r}")
        self.on_conflict = on_conflict
        self.options = options or SaveOptions(codec=codec, workers=workers)
        self.writer_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._open_or_create(create)
        budget = Budget(staging_bytes=self.options.staging_bytes, window_bytes=self.options.window_bytes,
                        cpu_workers=2, default_io_slots=self.options.workers)
        self._sched = Scheduler(budget, threads=self.options.workers + 4)
        self._staging = StagingPool(self.options.staging_bytes + self.options.window_bytes)
        self._tier = "tier0"
        self._last_commit: Task | None = None
        self._flushed = [0] * len(self.stores)
        self._future_order: list[str] = []
        self._writers: set = set()
        self._flushing: set[str] = set()
        self._flush_pins: dict[str, set[str]] = {}
        self._evict_lock = threading.Lock()
        self._tier_locks = [threading.Lock() for _ in self.stores]
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- set-up
    def _open_or_create(self, create: bool) -> None:
        """Check every tier's marker; create missing ones when the repository exists on any tier."""
        found = []
        for store in self.stores:
            try:
                record = json.loads(store.read(REPO_MARKER))
            except FileNotFoundError:
                continue
            except ValueError:
                raise FormatError(f"{store.url}/{REPO_MARKER} is not valid JSON") from None
            check_format(record, REPO_KIND, f"repository {store.url}")
            found.append(store)
        if not found and not create:
            raise RepoNotFoundError(
                f"no forkpoint repository at {self.url}: create one with "
                f"fp.Repo({self.url!r}, create=True) or `forkpoint init {self.url}`")
        record = {"format": REPO_KIND, "format_version": list(FORMAT_VERSION), "created": time.time()}
        for store in self.stores:
            if store not in found:
                store.create_exclusive(REPO_MARKER, json.dumps(record).encode())

    def close(self) -> None:
        """Wait for background saves, then release threads. Idempotent."""
        if self._closed:
            return
        self._sched.shutdown(wait=True)
        self._staging.clear()
        for store in self.stores:
            store.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- refs
    def _ref_state_in(self, store: Store, kind: str, name: str) -> tuple[int, str | None]:
        """Return (highest seq, target) of a ref in one store; (-1, None) when it never existed."""
        seqs = [s for s in map(seq_of, store.list(f"refs/{kind}/{name}")) if s is not None]
        if not seqs:
            return -1, None
        seq = max(seqs)
        key = record_key(kind, name, seq)
        return seq, decode_record(store.read(key), f"{store.url}/{key}")["target"]

    def _ref_state(self, kind: str, name: str) -> tuple[int, str | None]:
        """Return the ref as the fastest tier that has records of it sees it."""
        for store in self.stores:
            state = self._ref_state_in(store, kind, name)
            if state[0] >= 0:
                return state
        return -1, None

    def _publish_ref(self, kind: str, name: str, seq: int, target: str | None,
                     store: Store | None = None) -> bool:
        data = encode_record(seq, target, time.time(), self.writer_id)
        return (store or self.store).create_exclusive(record_key(kind, name, seq), data)

    def _set_ref(self, kind: str, name: str, target: str | None, must_exist: bool | None) -> None:
        current = self._ref_state(kind, name)[1]
        if must_exist is True and current is None:
            raise RefNotFoundError(f"no {kind[:-1]} {name!r} in {self.url}")
        if must_exist is False and current is not None:
            raise ValueError(f"{kind[:-1]} {name!r} already exists in {self.url} (at {current})")
        for store in reversed(self.stores):
            self._move_ref(store, kind, name, target)

    def _move_ref(self, store: Store, kind: str, name: str, target: str | None) -> None:
        for _ in range(100):
            seq, _ = self._ref_state_in(store, kind, name)
            if self._publish_ref(kind, name, seq + 1, target, store):
                return
        raise ConflictError(f"could not update {kind[:-1]} {name!r} in {store.url}: too many concurrent writers")

    def _names(self, kind: str) -> dict[str, str]:
        names = {key.split("/")[2] for store in self.stores
                 for key in store.list(f"refs/{kind}") if key.count("/") == 3}
        out = {}
        for name in sorted(names):
            target = self._ref_state(kind, name)[1]
            if target is not None:
                out[name] = target
        return out

    def branches(self) -> dict[str, str]:
        """Return {branch name: head version id}."""
        return self._names("heads")

    def tags(self) -> dict[str, str]:
        """Return {tag name: version id}."""
        return self._names("tags")

    def head(self, branch: str = "main") -> str | None:
        """Return the head version id of `branch`, or None when it has no versions."""
        return self._ref_state("heads", check_name(branch, "branch"))[1]

    def fork(self, ref: str, name: str) -> Version:
        """Create branch `name` at the version `ref` names; later saves on it descend from there."""
        version = self.version(ref)
        self._set_ref("heads", check_name(name, "branch"), version.id, must_exist=False)
        return version

    def tag(self, name: str, ref: str = "main", force: bool = False) -> Version:
        """Point tag `name` at `ref` (moving an existing tag only with force=True)."""
        version = self.version(ref)
        self._set_ref("tags", check_name(name, "tag"), version.id, must_exist=None if force else False)
        return version

    def delete_tag(self, name: str) -> None:
        """Remove a tag (its version stays)."""
        self._set_ref("tags", check_name(name, "tag"), None, must_exist=True)

    def delete_branch(self, name: str) -> None:
        """Remove a branch ref (its versions stay until gc finds them unreachable)."""
        self._set_ref("heads", check_name(name, "branch"), None, must_exist=True)

    # ----------------------------------------------------------------- versions
    def _manifest_by_id(self, vid: str) -> Manifest:
        cached = self._manifests.get(vid)
        if cached is not None:
            return cached
        if not isinstance(vid, str) or not vid or not all(c in "0123456789abcdef" for c in vid):
            raise FormatError(f"invalid version id {vid!r} in {self.url}: expected hex digits")
        key = f"versions/{vid}.json"
        for store in self.stores:
            try:
                data = store.read(key)
                break
            except FileNotFoundError:
                continue
        else:
            raise RefNotFoundError(f"version {vid} does not exist in {self.url}") from None
        m = Manifest.from_bytes(data, f"{store.url}/{key}")
        if m.version.id != vid:
            raise FormatError(f"manifest {self.url}/{key} names version {m.version.id}, not {vid}")
        with self._lock:
            self._manifests[vid] = m
        return m

    def _version_ids(self, store: Store | None = None) -> list[str]:
        stores = [store] if store is not None else self.stores
        return sorted({k[len("versions/"):-len(".json")] for st in stores for k in st.list("versions")
                       if k.endswith(".json")})

    def resolve(self, ref: str) -> str:
        """Return the version id named by a branch, tag, id (or unique prefix), with `~N` suffixes."""
        if not isinstance(ref, str) or not ref:
            raise RefNotFoundError(f"invalid ref {ref!r}")
        base, ups = parse_ref_expr(ref)
        vid = None
        if base.replace(".", "").replace("_", "").replace("-", "").isalnum() and "/" not in base:
            vid = self._ref_state("heads", base)[1]
            if vid is None:
                vid = self._ref_state("tags", base)[1]
        if vid is None and len(base) >= 4 and all(c in "0123456789abcdef" for c in base):
            matches = [v for v in self._version_ids() if v.startswith(base)]
            if len(matches) > 1:
                raise RefNotFoundError(f"ref {base!r} is ambiguous: {', '.join(sorted(matches)[:5])}")
            vid = matches[0] if matches else None
        if vid is None:
            raise RefNotFoundError(
                f"no branch, tag or version {base!r} in {self.url}; branches: "
                f"{', '.join(self.branches()) or '(none)'}")
        for i in range(ups):
            parents = self._manifest_by_id(vid).version.parents
            if not parents:
                raise RefNotFoundError(f"{ref!r}: version {vid} has no parent ({i} generations back)")
            vid = parents[0]
        return vid

    def version(self, ref: str = "main") -> Version:
        """Return the Version record `ref` names."""
        return self._manifest_by_id(self.resolve(ref)).version

    def manifest(self, ref: str = "main") -> Manifest:
        """Return the full manifest (record, skeleton, leaf table) of `ref`."""
        return self._manifest_by_id(self.resolve(ref))

    def log(self, ref: str = "main", limit: int | None = None) -> list[Version]:
        """Return the first-parent history of `ref`, newest first (pruned records included)."""
        out: list[Version] = []
        vid: str | None = self.resolve(ref)
        while vid is not None and (limit is None or len(out) < limit):
            try:
                v = self._manifest_by_id(vid).version
            except RefNotFoundError:
                break
            out.append(v)
            vid = v.parents[0] if v.parents else None
        return out

    def versions(self) -> list[Version]:
        """Return every version record in the repository, oldest first."""
        return sorted((self._manifest_by_id(v).version for v in self._version_ids()),
                      key=lambda v: v.time)

    # ----------------------------------------------------------------- save
    def save(self, state, branch: str = "main", step: int | None = None, message: str = "",
             metrics: dict | None = None, meta: dict | None = None, sync: bool = True,
             allow_pickle: bool = False) -> Version | PendingSave:
        """Store `state` as a new version on `branch`.

        sync=True writes straight from live memory and returns the Version. sync=False returns
        a PendingSave at once: tensors are copied to staging memory by background tasks, and
        the caller must not modify them before `PendingSave.wait_capture()` (the Checkpointer
        hooks optimizers and modules to wait exactly where needed).
        """
        if self._closed:
            raise RuntimeError(f"repository {self.url} is closed")
        check_name(branch, "branch")
        metrics = _json_safe(metrics or {}, "metrics")
        meta = _json_safe(meta or {}, "meta")
        tree, _ = capture(state)
        skeleton, flat = flatten(tree, allow_pickle=allow_pickle, copy=False)
        record = Version("", [], branch, step, 0.0, message, metrics, meta, env=_environment())
        plan = schedule_save(self._sched, self.store, self._tier, flat, self._known_chunks(branch),
                             self.options, self._staging, "window" if sync else "staging",
                             guard=self._evict_lock)
        self._writers.add(plan.writer)
        commit = self._sched.submit(
            "commit", lambda: self._finish_save(plan, skeleton, record, allow_pickle),
            priority=Priority.COMMIT, needs={f"io:{self._tier}": 1}, deps=plan.writes,
            after=[self._last_commit])
        self._sched.submit("cleanup", lambda: self._forget_writer(plan.writer),
                           priority=Priority.COMMIT, after=[commit])
        self._last_commit = commit
        if sync:
            return commit.result()
        by_ptr = {fl.data.data.__array_interface__["data"][0]: plan.captures[i]
                  for i, fl in enumerate(flat) if fl.data is not None and i in plan.captures and fl.data.data.size}
        return PendingSave(commit, plan.capture_tasks(), by_ptr)

    def warm_staging(self, state, allow_pickle: bool = False) -> int:
        """Allocate and fault in the staging buffers an asynchronous save of `state` will use,
        so that the first checkpoint does not pay for fresh memory; return the bytes warmed."""
        tree, _ = capture(state)
        _, flat = flatten(tree, allow_pickle=allow_pickle, copy=False)
        limit = self.options.staging_bytes
        sizes = [n for n in staging_sizes(flat, self.options)]
        return self._staging.warm(sizes if sum(sizes) <= limit else [])

    def background(self, fn, *args, **kwargs) -> Task:
        """Run `fn` as a low-priority task after every save already submitted; return the task."""
        return self._sched.submit("background", lambda: fn(*args, **kwargs), priority=Priority.GC,
                                  after=[self._last_commit])

    def drain(self) -> None:
        """Block until every background task (saves, flushes, evictions, prefetches) is done."""
        self._sched.drain()

    def stats(self) -> dict:
        """Queue depths, bytes in flight and seconds per stage and per tier, resource use."""
        return self._sched.stats()

    def _submit_read(self, fn, nbytes: int) -> Task:
        return self._sched.submit("restore", fn, priority=Priority.RESTORE,
                                  needs={f"io:{self._tier}": 1}, nbytes=nbytes, tier=self._tier)

    def _known_chunks(self, branch: str) -> dict[str, KnownChunk]:
        """Chunks of the branch head packed with others, by hash (their objects are refreshed)."""
        head = self._ref_state("heads", branch)[1]
        known: dict[str, KnownChunk] = {}
        if head is None:
            return known
        try:
            m = self._manifest_by_id(head)
        except (RefNotFoundError, FormatError):
            return known
        for leaf in m.leaves:
            for c in leaf.chunks:
                if c.object != c.hash:
                    known[c.hash] = KnownChunk(c.object, c.start, c.size, c.codec)
        for obj in {k.object for k in known.values()}:
            try:
                self.store.touch(object_key(obj))
            except FileNotFoundError:
                known = {h: k for h, k in known.items() if k.object != obj}
        return known

    def _finish_save(self, plan, skeleton, record: Version, allow_pickle: bool) -> Version:
        stored = plan.assemble()
        self.store.barrier(stored.written_keys)
        record.logical_bytes = sum(leaf.nbytes for leaf in stored.leaves if leaf.alias_of is None)
        record.stored_bytes = stored.stored_bytes
        has_pickle = any(leaf.kind == "pickle" for leaf in stored.leaves)
        manifest = Manifest(record, skeleton, stored.leaves, pickle=allow_pickle and has_pickle)
        return self._commit(manifest)

    def _commit(self, manifest: Manifest) -> Version:
        record = manifest.version
        for _ in range(1000):
            seq = self._ref_state_in(self.store, "heads", record.branch)[0]
            head = self._ref_state("heads", record.branch)[1]
            record.parents = [head] if head else []
            record.time = time.time()
            vid = manifest.assign_id()
            key = f"versions/{vid}.json"
            self.store.write(key, [manifest.to_bytes()])
            self.store.barrier([key])
            if self._publish_ref("heads", record.branch, seq + 1, vid):
                with self._lock:
                    self._manifests[vid] = manifest
                self._after_commit(vid, 0)
                return record
            if self.on_conflict == "error":
                raise ConflictError(
                    f"branch {record.branch!r} of {self.url} moved while saving; version {vid} is "
                    f"stored but not on the branch: keep it with repo.fork({vid!r}, name) or "
                    "repo.tag(name, ...) before gc removes it")
            self.store.delete(key)
        raise ConflictError(f"branch {record.branch!r}: gave up after repeated concurrent updates")

    # ----------------------------------------------------------------- tiers
    def _after_commit(self, vid: str, k: int) -> None:
        """A version is durable on tier k: flush it on when due, then apply tier k's retention."""
        self._flushed[k] += 1
        if k + 1 < len(self.stores) and self._flushed[k] % self.tier_specs[k].flush_every == 0:
            self._schedule_flush(vid, k)
        else:
            self._sched.submit("evict", lambda: self._evict(k), priority=Priority.EVICT)

    def _schedule_flush(self, vid: str, k: int) -> Task:
        m = self._manifest_by_id(vid)
        tier = f"tier{k + 1}"
        src, dst = self.stores[k], self.stores[k + 1]
        keys = sorted(object_keys(m))
        with self._evict_lock:
            self._flushing.add(vid)
            self._flush_pins[vid] = {key.rsplit("/", 1)[-1] for key in keys}
        copies = [self._sched.submit("flush", lambda key=key: copy_object(self.stores[k:], dst, key),
                                     priority=Priority.FLUSH, needs={f"io:{tier}": 1}, tier=tier)
                  for key in keys]

        def finish():
            try:
                dst.barrier(keys)
                with self._tier_locks[k + 1]:
                    copy_manifest(src, dst, vid)
                    self._stub_ancestors(vid, dst)
                    head = self._ref_state_in(dst, "heads", m.version.branch)[1]
                    if head is None or self._descends(vid, head):
                        self._move_ref(dst, "heads", m.version.branch, vid)
            finally:
                with self._evict_lock:
                    self._flushing.discard(vid)
                    self._flush_pins.pop(vid, None)
            self._evict(k)
            self._after_commit(vid, k + 1)

        return self._sched.submit("flush", finish, priority=Priority.FLUSH, deps=copies,
                                  needs={f"io:{tier}": 1}, tier=tier)

    def _stub_ancestors(self, vid: str, dst: Store) -> None:
        """Give `dst` records (stubs) of the ancestors it lacks, so its history stays walkable."""
        parents = self._manifest_by_id(vid).version.parents
        while parents and parents[0] not in self._flushing and not dst.exists(f"versions/{parents[0]}.json"):
            try:
                parent = self._manifest_by_id(parents[0])
            except RefNotFoundError:
                return
            self._prune(parent.version.id, dst)
            parents = parent.version.parents

    def _descends(self, vid: str, ancestor: str) -> bool:
        return any(v.id == ancestor for v in self.log(vid))

    def _forget_writer(self, writer) -> None:
        with self._evict_lock:
            self._writers.discard(writer)

    def _pinned(self, digest: str) -> bool:
        """True for objects a save or flush in flight relies on (call with the evict lock held)."""
        return (any(w.holds(digest) for w in self._writers)
                or any(digest in pins for pins in self._flush_pins.values()))

    def _evict(self, k: int, spare: str | None = None) -> None:
        """Apply tier k's `keep`: drop versions beyond it (only once safe on the next tier)."""
        if self.tier_specs[k].keep is None:
            return
        with self._tier_locks[k]:
            self._evict_locked(k, spare)

    def _evict_locked(self, k: int, spare: str | None) -> None:
        spec, store = self.tier_specs[k], self.stores[k]
        last = k == len(self.stores) - 1
        if spec.keep is None:
            return
        present = sorted((m.version for m in self._manifests_in(store) if not m.version.pruned),
                         key=lambda v: v.time, reverse=True)
        heads = {self._ref_state_in(store, "heads", b)[1] for b in {v.branch for v in present}}
        pinned = set(heads) | set(self.tags().values()) | {spare}
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
                self._prune(vid, nxt)
            store.delete(f"versions/{vid}.json")
        with self._evict_lock:
            live = set()
            for m in self._manifests_in(store):
                live |= object_keys(m)
            sweep(store, live, self._pinned)

    def _manifests_in(self, store: Store) -> list[Manifest]:
        """Every manifest as stored on one tier (stubs included)."""
        out = []
        for vid in self._version_ids(store):
            key = f"versions/{vid}.json"
            try:
                out.append(Manifest.from_bytes(store.read(key), f"{store.url}/{key}"))
            except FileNotFoundError:
                continue
        return out

    def where(self, ref: str) -> list[str]:
        """Return the URLs of the tiers that hold the version's manifest, fastest first."""
        vid = self.resolve(ref)
        return [st.url for st in self.stores if st.exists(f"versions/{vid}.json")]

    def prefetch(self, refs, order: list[str] | None = None) -> list[Task]:
        """Copy versions to the fastest tier in the background; return their tasks.

        `order`, when given, is the expected future access order (refs); tier 0 then evicts
        the version whose next use is farthest away.
        """
        if order is not None:
            self._future_order = [self.resolve(r) for r in order]
        tasks = []
        for ref in ([refs] if isinstance(refs, str) else refs):
            vid = self.resolve(ref)
            tasks.append(self._sched.submit("prefetch", lambda vid=vid: self._promote(vid),
                                            priority=Priority.PREFETCH, needs={f"io:{self._tier}": 1},
                                            tier=self._tier))
        return tasks

    def _promote(self, vid: str) -> None:
        if self.store.exists(f"versions/{vid}.json"):
            return
        source = next((st for st in self.stores[1:] if st.exists(f"versions/{vid}.json")), None)
        if source is None:
            raise RefNotFoundError(f"version {vid} is on no tier of {self.url}")
        m = self._manifest_by_id(vid)
        if m.version.pruned:
            return
        keys = sorted(object_keys(m))
        for key in keys:
            copy_object(self.stores[1:], self.store, key)
        self.store.barrier(keys)
        copy_manifest(source, self.store, vid)
        self._evict(0, spare=vid)

    # ----------------------------------------------------------------- load / restore
    def _readable(self, ref: str) -> Manifest:
        m = self._manifest_by_id(self.resolve(ref))
        with self._lock:
            if m.version.id in self._future_order:
                self._future_order.remove(m.version.id)
        if m.version.pruned:
            raise PrunedVersionError(
                f"version {m.version.id} (step {m.version.step}) of {self.url} was pruned by "
                "retention; its record remains in the log but its data is gone")
        return m

    def _read_values(self, m: Manifest, indices: list[int], targets: dict, map_location,
                     allow_pickle: bool, devices: dict | None = None) -> dict[int, object]:
        """Read leaves `indices` of `m`; `targets[i]` is a live uint8 buffer to fill in place."""
        if any(m.leaves[i].kind == "pickle" for i in indices) and not allow_pickle:
            leaf = next(m.leaves[i] for i in indices if m.leaves[i].kind == "pickle")
            raise _pickle_refused(leaf.path, m.version.id)
        values, requests, fresh = {}, [], {}
        for i in indices:
            leaf = m.leaves[i]
            if leaf.alias_of is not None:
                continue
            if i in targets:
                requests.append(ReadRequest(leaf, targets[i][1]))
                values[i] = targets[i][0]
            else:
                obj, buf = empty_leaf(leaf.kind, leaf.dtype, leaf.shape, leaf.device, leaf.path)
                requests.append(ReadRequest(leaf, buf))
                fresh[i] = obj
        self._read_with_fallback(requests, m.version.id)
        for i, obj in fresh.items():
            loc = (devices or {}).get(i, map_location)
            values[i] = finish_leaf(m.leaves[i].kind, obj, m.leaves[i].device, loc, allow_pickle,
                                    m.leaves[i].path)
        for i in indices:
            base = m.leaves[i].alias_of
            if base is not None:
                if base not in values:
                    values.update(self._read_values(m, [base], targets, map_location, allow_pickle, devices))
                values[i] = values[base]
        return values

    def _read_with_fallback(self, requests, vid: str) -> None:
        """Read from the fastest tier holding the version; on a missing or corrupt object, the next."""
        holders = [st for st in self.stores if st.exists(f"versions/{vid}.json")] or [self.store]
        for i, store in enumerate(holders):
            try:
                return read_leaves(store, requests, vid, self._submit_read)
            except (MissingObjectError, CorruptObjectError):
                if i == len(holders) - 1:
                    raise

    def load(self, ref: str = "main", paths: list[str] | None = None, map_location=None,
             allow_pickle: bool = False):
        """Return the state tree of `ref` (tensors on `map_location`, default CPU)."""
        m = self._readable(ref)
        paths = [paths] if isinstance(paths, str) else paths
        skeleton = select_skeleton(m.tree, paths)
        if skeleton is None:
            raise RefNotFoundError(f"version {m.version.id} has nothing under {paths}")
        indices = [n["i"] for _, _, n in walk_skeleton(skeleton) if n.get("t") == "leaf"]
        values = self._read_values(m, indices, {}, map_location, allow_pickle)
        return unflatten(skeleton, values, f"version {m.version.id}")

    def restore(self, state, ref: str = "main", strict: bool = True, paths: list[str] | None = None,
                rename: dict[str, str] | None = None, map_location=None,
                allow_pickle: bool = False) -> Version:
        """Restore `ref` into live objects in place; strict checks list every mismatch at once."""
        m = self._readable(ref)
        paths = [paths] if isinstance(paths, str) else paths
        skeleton = select_skeleton(m.tree, paths)
        if skeleton is None:
            raise RefNotFoundError(f"version {m.version.id} has nothing under {paths}")
        captured, objects = capture(state)
        skeleton = rename_skeleton(skeleton, rename, captured)
        stored = {p: n for p, _, n in walk_skeleton(skeleton)}
        live = _live_leaves(captured)
        scope = None if paths is None else [_renamed(p, rename) for p in paths]
        self._check_restore(m, stored, live, objects, scope, strict)
        targets, devices = {}, {}
        for path, node in stored.items():
            if node.get("t") != "leaf" or path not in live:
                continue
            leaf = m.leaves[node["i"]]
            value = live[path]
            buf = live_buffer(value)
            if leaf.alias_of is None and buf is not None and buf[1] == leaf.dtype and list(buf[2]) == leaf.shape:
                targets[node["i"]] = (value, buf[3])
            elif is_torch_tensor(value):
                devices[node["i"]] = value.device
        indices = [n["i"] for n in stored.values() if n.get("t") == "leaf"]
        values = self._read_values(m, indices, targets, map_location, allow_pickle, devices)
        loaded = unflatten(skeleton, values, f"version {m.version.id}")
        captured = merge(captured, loaded)
        restore_objects(captured, objects, state, module_strict=False)
        return m.version

    def _check_restore(self, m: Manifest, stored: dict, live: dict, objects, scope, strict) -> None:
        def in_scope(p):
            return scope is None or any(has_prefix(p, s) for s in scope)

        open_prefixes = [_keys_path(k) for k, o in objects if not is_module(o)]

        def checked(p):
            return not any(has_prefix(p, o) for o in open_prefixes)

        missing = sorted(p for p in live if in_scope(p) and p not in stored and checked(p))
        unexpected = sorted(p for p in stored if p not in live and checked(p))
        for keys, obj in objects:
            prefix = _keys_path(keys)
            if not is_module(obj) and in_scope(prefix) and not any(has_prefix(p, prefix) for p in stored):
                missing.append(prefix)
        mismatched = []
        for path, node in stored.items():
            if node.get("t") != "leaf" or path not in live:
                continue
            leaf, value = m.leaves[node["i"]], live[path]
            shape = getattr(value, "shape", None)
            if shape is None or leaf.kind in ("bytes", "pickle", "numpy_scalar"):
                continue
            live_dtype = str(value.dtype).removeprefix("torch.")
            if list(shape) != leaf.shape:
                mismatched.append(f"{path}: stored shape {leaf.shape}, live {list(shape)}")
            elif live_dtype != leaf.dtype and strict:
                mismatched.append(f"{path}: stored dtype {leaf.dtype}, live {live_dtype}")
        if mismatched or (strict and (missing or unexpected)):
            lines = [f"cannot restore version {m.version.id} (step {m.version.step}) strictly:"]
            if missing:
                lines.append(f"  missing in the version ({len(missing)}): " + ", ".join(missing[:20]))
            if unexpected:
                lines.append(f"  unexpected in the version ({len(unexpected)}): " + ", ".join(unexpected[:20]))
            if mismatched:
                lines.append(f"  mismatched ({len(mismatched)}): " + "; ".join(mismatched[:20]))
            lines.append("  use strict=False, paths=[...] or rename={...} for a partial restore")
            raise StateMismatchError("\n".join(lines))

    # ----------------------------------------------------------------- compare
    def diff(self, a: str, b: str, numeric: bool = True) -> list[LeafDiff]:
        """Compare two versions leaf by leaf; identical hashes are 'same' without reading data."""
        ma, mb = self._readable(a), self._readable(b)
        na = {p: n for p, _, n in walk_skeleton(ma.tree)}
        nb = {p: n for p, _, n in walk_skeleton(mb.tree)}
        out = []
        for path in sorted(set(na) | set(nb)):
            if path not in nb:
                out.append(LeafDiff(path, "removed"))
            elif path not in na:
                out.append(LeafDiff(path, "added"))
            else:
                out.append(self._diff_node(ma, mb, path, na[path], nb[path], numeric))
        return out

    def _leaf_of(self, m: Manifest, node: dict) -> Leaf:
        leaf = m.leaves[node["i"]]
        return m.leaves[leaf.alias_of] if leaf.alias_of is not None else leaf

    def _diff_node(self, ma, mb, path, x, y, numeric) -> LeafDiff:
        if x.get("t") != "leaf" or y.get("t") != "leaf":
            if x == y:
                return LeafDiff(path, "same")
            d = LeafDiff(path, "changed", f"{_node_repr(x)} -> {_node_repr(y)}")
            if x.get("t") in ("int", "float") and y.get("t") in ("int", "float"):
                d.max_abs = abs(_scalar(y) - _scalar(x))
            return d
        la, lb = self._leaf_of(ma, x), self._leaf_of(mb, y)
        if la.digest == lb.digest:
            return LeafDiff(path, "same")
        if (la.dtype, la.shape) != (lb.dtype, lb.shape):
            return LeafDiff(path, "changed", f"{la.dtype}{la.shape} -> {lb.dtype}{lb.shape}")
        d = LeafDiff(path, "changed", "values")
        if numeric and la.kind in ("torch", "numpy", "numpy_scalar"):
            va = _as_float64(self._read_values(ma, [x["i"]], {}, None, False)[x["i"]])
            vb = _as_float64(self._read_values(mb, [y["i"]], {}, None, False)[y["i"]])
            if va is not None and vb is not None:
                delta = np.abs(vb - va)
                d.max_abs = float(delta.max()) if delta.size else 0.0
                norm = float(np.linalg.norm(va.ravel()))
                d.rel_l2 = float(np.linalg.norm((vb - va).ravel())) / norm if norm else float("inf")
        return d

    def first_divergence(self, branch_a: str, branch_b: str, atol: float = 0.0) -> Divergence | None:
        """Return the earliest common step whose states differ by more than `atol`, or None."""
        by_step_a = {v.step: v for v in reversed(self.log(branch_a)) if v.step is not None}
        by_step_b = {v.step: v for v in reversed(self.log(branch_b)) if v.step is not None}
        for step in sorted(set(by_step_a) & set(by_step_b)):
            va, vb = by_step_a[step], by_step_b[step]
            if va.id == vb.id or va.pruned or vb.pruned:
                continue
            diffs = [d for d in self.diff(va.id, vb.id, numeric=atol > 0) if d.status != "same"]
            beyond = [d for d in diffs if d.max_abs is None or d.max_abs > atol]
            if beyond:
                worst = max((d.max_abs for d in beyond if d.max_abs is not None), default=None)
                return Divergence(step, va.id, vb.id, [d.path for d in beyond], worst)
        return None

    # ----------------------------------------------------------------- integrity
    def verify(self, ref: str | None = None, progress=None) -> VerifyReport:
        """Re-read and re-hash every object of `ref` (or of every version) on every tier holding it."""
        wanted = {self.resolve(ref)} if ref is not None else None
        report = VerifyReport()
        seen = set()
        for store in self.stores:
            for vid in self._version_ids(store):
                if wanted is not None and vid not in wanted:
                    continue
                key = f"versions/{vid}.json"
                try:
                    m = Manifest.from_bytes(store.read(key), f"{store.url}/{key}")
                except Exception as e:  # a broken manifest is a problem to report, not to stop at
                    report.problems.append(str(e))
                    continue
                if vid not in seen:
                    seen.add(vid)
                    report.versions += 1
                for leaf in m.leaves:
                    if leaf.alias_of is not None:
                        continue
                    _, buf = empty_leaf("bytes", "uint8", [leaf.nbytes], "cpu", leaf.path)
                    try:
                        read_leaves(store, [ReadRequest(leaf, buf)], vid, self._submit_read)
                    except Exception as e:
                        report.problems.append(str(e))
                    report.objects += len(leaf.chunks)
                    report.bytes += leaf.nbytes
                    if progress is not None:
                        progress(leaf.nbytes)
        return report

    # ----------------------------------------------------------------- retention and gc
    def _chains(self) -> dict[str, list[Version]]:
        return {name: self.log(name) for name in self.branches()}

    def prune_plan(self, keep, branches: list[str] | None = None) -> list[str]:
        """Return ids of versions `keep` would prune on `branches` (default: all)."""
        chains = self._chains()
        tagged = set(self.tags().values())
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

    def _prune(self, vid: str, store: Store | None = None) -> None:
        """Replace the version's manifest on `store` (default: every tier holding it) by a stub."""
        m = self._manifest_by_id(vid)
        record = Version(**{**m.version.summary(), "pruned": True})
        stub = Manifest(record, None, [], False)
        key = f"versions/{vid}.json"
        targets = [store] if store is not None else [st for st in self.stores if st.exists(key)]
        for st in targets:
            st.write(key, [stub.to_bytes()])
            st.barrier([key])
        with self._lock:
            self._manifests.pop(vid, None)

    def gc(self, keep=None, branches: list[str] | None = None, dry_run: bool = False,
           grace: float = 600.0) -> GcReport:
        """Prune versions by `keep`, then delete objects no version needs and stale temp files.

        Objects, manifests and temp files younger than `grace` seconds are kept, so gc is safe
        while other processes save (a save must finish within `grace`).
        """
        report = GcReport(dry_run=dry_run)
        if keep is not None:
            report.pruned_versions = self.prune_plan(keep, branches)
        pruned = set(report.pruned_versions)
        if not dry_run:
            for vid in report.pruned_versions:
                self._prune(vid)
        now = time.time()
        reachable = set()
        for start in list(self.branches().values()) + list(self.tags().values()):
            vid = start
            while vid and vid not in reachable:
                reachable.add(vid)
                try:
                    parents = self._manifest_by_id(vid).version.parents
                except RefNotFoundError:
                    break
                vid = parents[0] if parents else None
        live_objects = set()
        for vid in self._version_ids():
            key = f"versions/{vid}.json"
            if vid not in reachable and now - self.store.mtime(key) > grace:
                report.deleted_manifests += 1
                if not dry_run:
                    self.store.delete(key)
                    self._manifests.pop(vid, None)
                continue
            if vid in pruned:
                continue
            m = self._manifest_by_id(vid)
            for leaf in m.leaves:
                live_objects.update(c.object for c in leaf.chunks)
        for key in self.store.list("objects"):
            digest = key.rsplit("/", 1)[-1]
            if digest in live_objects:
                continue
            try:
                if now - self.store.mtime(key) <= grace:
                    continue
                size = self.store.size(key)
            except FileNotFoundError:
                continue
            report.deleted_objects += 1
            report.freed_bytes += size
            if not dry_run:
                self.store.delete(key)
        for key in self.store.list("tmp"):
            try:
                if now - self.store.mtime(key) > grace:
                    report.deleted_temp += 1
                    if not dry_run:
                        self.store.delete(key)
            except FileNotFoundError:
                pass
        if not dry_run:
            self._compact_refs()
        return report

    def _compact_refs(self) -> None:
        by_ref: dict[str, list[tuple[int, str]]] = {}
        for key in self.store.list("refs"):
            seq = seq_of(key)
            if seq is not None:
                by_ref.setdefault(key.rsplit("/", 1)[0], []).append((seq, key))
        for records in by_ref.values():
            for _, key in sorted(records)[:-REF_RECORDS_KEPT]:
                self.store.delete(key)

    def du(self) -> dict:
        """Return logical and stored bytes per version and per branch, and the objects' total."""
        versions = {v.id: v for v in self.versions()}
        branches = {}
        for name, chain in self._chains().items():
            branches[name] = {"versions": len(chain),
                              "logical_bytes": sum(v.logical_bytes for v in chain if not v.pruned),
                              "stored_bytes": sum(v.stored_bytes for v in chain if not v.pruned)}
        total = sum(self.store.size(k) for k in self.store.list("objects"))
        return {"versions": [{"id": v.id, "branch": v.branch, "step": v.step, "pruned": v.pruned,
                              "logical_bytes": v.logical_bytes, "stored_bytes": v.stored_bytes}
                             for v in versions.values()],
                "branches": branches, "objects_bytes": total}


def _json_safe(d: dict, what: str) -> dict:
    try:
        return json.loads(json.dumps(d, allow_nan=False, default=_to_json))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON data (finite numbers, str, lists, dicts): {e}") from None


def _to_json(x):
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON data")


def _pickle_refused(path: str, vid: str) -> Exception:
    from .errors import UnsupportedTypeError

    return UnsupportedTypeError(
        f"version {vid}: leaf {path!r} was stored with pickle; loading it could run code. "
        "Pass allow_pickle=True only if you trust this repository")


def _keys_path(keys: tuple) -> str:
    from .format.paths import join_path

    return join_path(*keys)


def _renamed(path: str, rename: dict | None) -> str:
    for old, new in (rename or {}).items():
        if has_prefix(path, old):
            return new + path[len(old.rstrip("/")):]
    return path


def _live_leaves(tree) -> dict:
    """Return {path: value} for every non-container value of a captured live tree."""
    from .format.paths import child_path

    out = {}

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, child_path(path, k))
        elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            for i, v in enumerate(obj):
                walk(v, child_path(path, i))
        else:
            out[path] = obj

    walk(tree, "")
    return out


def _node_repr(node: dict) -> str:
    if node.get("t") == "float":
        return repr(float.fromhex(node["v"]))
    if node.get("t") == "leaf":
        return "<array>"
    return json.dumps(node.get("v", node.get("t")))[:60]


def _scalar(node: dict) -> float:
    return float.fromhex(node["v"]) if node["t"] == "float" else float(node["v"])


def _as_float64(value):
    """Return a float64/complex128 numpy array of a tensor or array, or None when not numeric."""
    if is_torch_tensor(value):
        import torch

        t = value.detach().cpu()
        t = t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)
        return t.numpy()
    a = np.asarray(value)
    if a.dtype.kind not in "biufc":
        return None
    return a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)
