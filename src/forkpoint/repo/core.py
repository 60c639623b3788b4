"""Repo: versions, refs, lineage, load/restore, diff, verify and gc — the public core.

A repository is a store holding `forkpoint.json`, `objects/`, `versions/` and `refs/`.
A version is visible once its manifest is durable and a ref record points at it.
"""

import atexit
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from concurrent import futures

from ..engine.chunkmemory import ChunkMemory
from ..engine.delta import DeltaPlan, ValueEstimate, parent_chunks
from ..engine.gcpause import gc_paused
from ..engine.pacing import PaceMemory
from ..engine.restore import chunk_value
from ..engine.save import SaveOptions, staging_sizes, with_fields
from ..engine.encoding import codec_rules
from ..engine.scheduler import Budget, Priority, Scheduler, Task, usable_cores
from ..engine.staging import StagingPool
from ..errors import ConflictError, FormatError, RefNotFoundError, SaveAbortedError, UnsupportedTypeError
from ..codecs.floatcodec import Layouts
from ..format.objects import object_key
from ..format.manifest import Chunk, Manifest, Version, html_table
from ..format.refs import check_name
from ..state import capture, classes_of, flatten
from ..state.device import DeviceCapture
from ..storage import Store, open_store
from ..tiers import Tier, open_tiers
from .commit import CommitQueue, SaveSession
from .compaction import CompactCommands, Compactor
from .interrupts import finishing_on_first_interrupt
from .compare import CompareCommands, Comparison
from .history import History, HistoryCommands
from .ledger import CommitLedger
from .marker import open_or_create
from .maintenance import Maintenance, MaintenanceCommands
from .writers import Leases
from .placement import Placement
from .reading import ReadCommands, Reader
from .records import PendingSave, environment, save_fields
from .refs import RefCommands, Refs

MAX_ENCODERS = 8
"""Chunks one process encodes at once: one per core, at most this many (each also gets an I/O
slot of its own, so that the other write tasks keep the store busy meanwhile)."""
_OPEN_AT_EXIT: "weakref.WeakSet" = weakref.WeakSet()


def _close_left_open() -> None:
    """At interpreter exit, close the repositories a program left open: their saves in flight
    commit and their threads stop before the interpreter tears down (left running, they made
    the process abort at exit now and then). The scheduler's and the helper threads are daemon
    threads, so they still run when exit handlers do."""
    for repo in list(_OPEN_AT_EXIT):
        try:
            repo.close()
        except Exception as e:  # exit goes on; say what was not closed cleanly
            print(f"forkpoint: closing {repo.url} at exit failed: {e}", file=sys.stderr)


atexit.register(_close_left_open)


def _stop_unclosed(scheduler) -> None:
    """Finish `scheduler`'s queued tasks and stop its threads, from a thread of its own: the
    finalizer of a repository collected unclosed calls this on whatever thread the collector
    ran on, one of the scheduler's own included."""
    threading.Thread(target=scheduler.shutdown, name="forkpoint-stop-unclosed", daemon=True).start()


class Repo(RefCommands, HistoryCommands, ReadCommands, CompareCommands, MaintenanceCommands, CompactCommands):
    """A forkpoint repository at `url`: a local path, file://, mem://name, or an fsspec URL
    such as s3://bucket/prefix (`storage_options` go to the fsspec file system), or a
    hierarchy of `tiers` (see fp.tier). How saves lay out, encode and stage data is given once,
    as `options` (a SaveOptions) and/or its fields as keywords: `codec` (a policy, or
    {path glob: policy}), `delta`, `workers`, `chunk_bytes`, ... (see engine.save.SaveOptions)."""

    closes_at_exit = True
    """Whether a repository the program leaves open is closed at interpreter exit (its saves
    in flight then commit first)."""
    collective = False
    """Whether this process saves together with others (the rank of an fp.dist.Repo)."""
    rank, world = 0, 1
    """This process's rank among the processes that save together, and their number."""

    def __init__(self, url: str | Store | None = None, create: bool = False, *, tiers: list | None = None,
                 storage_options: dict | None = None, on_conflict: str = "retry",
                 options: SaveOptions | None = None, **save_options):
        if tiers is not None and url is not None:
            raise ValueError("give either url or tiers, not both")
        if tiers is None and url is None:
            raise ValueError("Repo needs a url (or tiers=[...])")
        if on_conflict not in ("retry", "error"):
            raise ValueError(f"on_conflict must be 'retry' or 'error', got {on_conflict!r}")
        self.on_conflict = on_conflict
        self.options = with_fields(options, save_options)
        self._delta_values: dict = {}
        self._delta_plans = weakref.WeakSet()  # a plan whose save never got scheduled just vanishes
        codec_rules(self.options.codec)
        self.writer_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if tiers is not None:
            self.tier_specs, self.stores = open_tiers(tiers)
        else:
            store = url if isinstance(url, Store) else open_store(str(url), **(storage_options or {}))
            self.tier_specs, self.stores = [Tier(store.url)], [store]
        self.store = self.stores[0]
        self.url = self.store.url
        try:
            if self.tier_specs[0].replicas and not self.collective:
                raise ValueError(f"tier 0 ({self.tier_specs[0].url}) asks for replicas on peer nodes: that "
                                 "needs fp.dist.Repo (the nodes of a torch.distributed job)")
            open_or_create(self.stores, self.url, create)
        except BaseException:
            for store in self.stores:
                store.close()
            raise
        self._start_engine()
        self._tier = "tier0"
        self._layouts = ChunkMemory(Layouts)
        self._pacing = PaceMemory()
        self._value_estimates = ChunkMemory(ValueEstimate)
        self._lock = threading.Lock()
        self.ledger = CommitLedger()
        self.commits = CommitQueue()
        self._compose()
        self.closed = False
        if self.closes_at_exit:
            _OPEN_AT_EXIT.add(self)

    # ----------------------------------------------------------------- set-up
    def _start_engine(self) -> None:
        """The scheduler with this repository's budgets, its staging memory and device capture."""
        encoders = min(MAX_ENCODERS, usable_cores())
        budget = Budget(staging_bytes=self.options.staging_bytes, window_bytes=self.options.window_bytes,
                        cpu_workers=2, encoders=encoders, default_io_slots=self.options.workers + encoders)
        self.scheduler = Scheduler(budget, threads=self.options.workers + encoders + 4)
        self.staging = StagingPool(self.options.staging_bytes + self.options.window_bytes)
        self.device = DeviceCapture(self.options.staging_bytes)
        # a repository dropped without close() would leave its idle workers asleep for good; a
        # rank's repository is not drained behind its peers' backs (it does not close at exit either)
        self._stop_when_collected = weakref.finalize(self, _stop_unclosed, self.scheduler)
        self._stop_when_collected.atexit = False  # at exit, _close_left_open closes what is open
        if not self.closes_at_exit:
            self._stop_when_collected.detach()

    def _compose(self) -> None:
        """The collaborators that own refs, history, leases, tiers, reads, comparisons and upkeep."""
        self.refs = Refs(self.stores, self.url, self.writer_id)
        self.history = History(self.stores, self.url, self.refs)
        self.leases = Leases(self.stores, self.writer_id)
        evict_lock = threading.Lock()
        self.compactor = Compactor(self.stores, self.scheduler, evict_lock)
        self.placement = Placement(self.stores, self.tier_specs, self.scheduler, self.refs, self.history, self.leases,
                                   self.compactor, self.options, evict_lock,
                                   lambda vid, store: self.maintenance.prune(vid, store))
        self.reader = Reader(self.stores, self.url, self.history, self._submit_read, self.scheduler.batch,
                             lambda: (self.rank, self.world), self.placement.forget_next_use)
        self.maintenance = Maintenance(self.stores, self.refs, self.history, self.leases, self.ledger,
                                       self._submit_read, self.placement.pinned, evict_lock)
        self.comparison = Comparison(self.reader.readable,
                                     lambda m, indices: self.reader.read_values(m, indices, {}, None, False), self.log)

    def close(self) -> None:
        """Wait for background saves, then release threads. Idempotent."""
        if self.closed:
            return
        self._stop_when_collected.detach()
        self.scheduler.shutdown(wait=True)
        self.staging.clear()
        self.device.clear()
        self.leases.release()
        self.refs.holds.release_all()
        for store in self.stores:
            store.close()
        self.closed = True

    def _repr_html_(self) -> str:
        """Branches and tags with their head versions, for Jupyter (every value escaped)."""
        rows = []
        for kind, names in (("branch", self.branches()), ("tag", self.tags())):
            for name, vid in sorted(names.items()):
                v = self.history.version_by_id(vid)
                metrics = " ".join(f"{k}={x}" for k, x in v.metrics.items())
                rows.append((f"{kind} {name}", f"{vid[:12]}  step {v.step}  {metrics}  {v.message}"))
        return html_table(f"forkpoint repository {self.url}", rows or [("", "no versions yet")])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- save
    def save(self, state, branch: str = "main", step: int | None = None, message: str = "",
             metrics: dict | None = None, meta: dict | None = None, sync: bool = True,
             allow_pickle: bool = False) -> Version | PendingSave:
        """Store `state` as a new version on `branch`.

        sync=True writes straight from live memory and returns the Version. sync=False returns
        a PendingSave at once (once fewer than `SaveOptions.max_pending`, 2, earlier ones are
        uncommitted): tensors and arrays are copied to staging memory by background tasks, and
        the caller must not modify them before `PendingSave.wait_capture()` (the Checkpointer
        hooks optimizers and modules to wait exactly where needed, and waits for numpy arrays).
        """
        if self.closed:
            raise RuntimeError(f"repository {self.url} is closed")
        step, message, metrics, meta = save_fields(branch, step, message, metrics, meta)
        if not sync:
            self.commits.wait_for_room(self.options.max_pending)
        with gc_paused():  # through the whole save when the caller waits for it anyway
            plan, commit = self._schedule_save(state, branch, step, message, metrics, meta, sync, allow_pickle)
            if sync:
                what = f"the save of step {step} on branch {branch!r}" if step is not None else \
                    f"the save on branch {branch!r}"
                with finishing_on_first_interrupt(what, lambda: self._abort_save(plan, commit)) as outcome:
                    version = commit.result()
                    outcome.append(f"committed as version {version.id}")
                return version
        return pending_save(commit, plan, plan.flat)

    def _schedule_save(self, state, branch, step, message, metrics, meta, sync, allow_pickle):
        """Flatten `state` and queue its save's tasks; (plan, commit task)."""
        tree, objects = capture(state)
        skeleton, flat = flatten(tree, allow_pickle=allow_pickle, copy=False, device_capture=self.device)
        sharded = next((fl.path for fl in flat if fl.data is not None and fl.data.box is not None), None)
        if sharded is not None:
            raise UnsupportedTypeError(
                f"state path {sharded!r} is a part of a larger array (a sharded DTensor or an fp.Block): "
                "save it from every rank with fp.dist.Repo or fp.mpi.Repo")
        record = Version("", [], branch, step, 0.0, message, metrics, meta, env=environment())
        session, classes = SaveSession(self, branch), classes_of(objects)
        with self.scheduler.batch():
            plan = session.schedule(flat, sync, encode_later=self.options.encode_later)
            commit = session.queue_commit(lambda: self._finish_save(session, plan, skeleton, record, allow_pickle,
                                                                         classes),
                                          sync, deps=plan.writes)
            plan.commit = commit
        return plan, commit

    def begin_save(self, branch: str = "main", check_holder: bool = True) -> SaveSession:
        """Start a version on `branch` written object by object (the commit protocol of
        repo/commit.py, which the DCP Writer and fp.dist.Repo use); end it with `close()` or a
        `with` block. BranchHeldError when another live run holds the branch, unless
        `check_holder` is False (a rank of that run that writes objects but does not commit)."""
        if self.closed:
            raise RuntimeError(f"repository {self.url} is closed")
        check_name(branch, "branch")
        return SaveSession(self, branch, check_holder)

    def warm_staging(self, state, allow_pickle: bool = False) -> int:
        """Allocate and fault in the staging buffers an asynchronous save of `state` will use
        (and the pinned host buffers of its device tensors), and, on a memory tier that captures
        into its own buffers, the buffers of the versions it keeps (`keep` and one being
        written), so that the first checkpoints do not pay for fresh memory; return the bytes
        warmed."""
        tree, _ = capture(state)
        _, flat = flatten(tree, allow_pickle=allow_pickle, copy=False, device_capture=self.device)
        return self.warm_leaves(flat)

    def warm_leaves(self, flat, select=None, pack_key=None) -> int:
        """warm_staging for flattened leaves (state.flatten's), of which a save writes the
        pieces `select(leaf index, box)` picks, packed by `pack_key(leaf index)`."""
        for fl in flat:
            if fl.data is not None and fl.data.pending is not None:
                fl.data.pending.release()
        staging, objects = staging_sizes(flat, self.options, select, self.store.adopts_buffers, pack_key)
        warmed = self.staging.warm(staging if sum(staging) <= self.options.staging_bytes else [])
        versions = (self.tier_specs[0].keep or 1) + 1
        return warmed + self.store.reserve(objects * versions)

    def background(self, fn, *args, **kwargs) -> Task:
        """Run `fn` as a low-priority task after every save already submitted; return the task."""
        return self.scheduler.submit("background", lambda: fn(*args, **kwargs), priority=Priority.GC,
                                     after=[self.commits.last])

    def drain(self) -> None:
        """Block until every background task (saves, flushes, evictions, prefetches) is done."""
        self.scheduler.drain()

    def stats(self) -> dict:
        """Queue depths, bytes in flight and seconds per stage and per tier, resource use, and
        the flushes that failed ("flush_errors": version, tier index, error)."""
        out = self.scheduler.stats()
        out["flush_errors"] = self.placement.flush_errors()
        return out

    # ----------------------------------------------------------------- tiers
    def where(self, ref: str) -> list[str]:
        """Return the URLs of the tiers that hold the version in full (its manifest, not the
        stub of a pruned or evicted version), fastest first."""
        return self.placement.where(self.resolve(ref))

    def prefetch(self, refs, order: list[str] | None = None) -> list[Task]:
        """Copy versions to the fastest tier in the background; return their tasks. `order`,
        when given, is the expected future access order (refs); tier 0 then evicts the
        version whose next use is farthest away."""
        vids = [self.resolve(r) for r in ([refs] if isinstance(refs, str) else refs)]
        return self.placement.prefetch(vids, None if order is None else [self.resolve(r) for r in order])

    def finish_flushes(self) -> list[Task]:
        """Schedule the flushes a stopped process left undone (killed or crashed before its
        background flushes ended): on each tier above the last, the committed versions the tier
        below lacks (with flush_every > 1, only branch heads and tagged versions), oldest first.
        Skipped for a tier another running process writes to (its own flushes are in flight).
        Returns the flush tasks. (Collective for fp.dist.Repo.)"""
        return self.placement.finish_flushes()

    def _submit_read(self, fn, nbytes: int) -> Task:
        return self.scheduler.submit("restore", fn, priority=Priority.RESTORE,
                                  needs={f"io:{self._tier}": 1}, nbytes=nbytes, tier=self._tier)

    def _head_manifest(self, branch: str) -> Manifest | None:
        """The manifest of the branch head that a new save builds on, or None (no head, an
        unreadable one, or a pruned stub)."""
        head = self.refs.target("heads", branch)
        if head is None:
            return None
        try:
            m = self.history.manifest_by_id(head)
        except (RefNotFoundError, FormatError):
            return None
        return None if m.version.pruned else m

    def _known_chunks(self, m: Manifest | None) -> dict[str, Chunk]:
        """Chunks of head manifest `m` packed with others, by hash (their objects are refreshed;
        the manifest's own records, so a save of many small leaves builds no object per leaf)."""
        known: dict[str, Chunk] = {}
        if m is None:
            return known
        for leaf in m.leaves:
            for c in leaf.chunks:
                if c.object != c.hash and c.delta is None:
                    known[c.hash] = c
        for obj in {k.object for k in known.values()}:
            try:
                self.store.touch(object_key(obj))
            except FileNotFoundError:
                known = {h: k for h, k in known.items() if k.object != obj}
        return known

    def _delta_plan(self, m: Manifest | None) -> DeltaPlan | None:
        """The delta plan of a save on top of head manifest `m` (None unless the repository
        stores deltas)."""
        if self.options.delta is None:
            return None
        head = m.version.id if m is not None else None

        def read_base(leaf, chunk):
            return self.reader.from_holders(head, lambda store: chunk_value(store, leaf, chunk, head))

        with self._lock:
            for other in self._delta_plans:
                other.share()
            plan = DeltaPlan(self.options.delta, parent_chunks(m), self._delta_values, read_base,
                             recycles=not self._delta_plans, estimates=self._value_estimates)
            self._delta_plans.add(plan)
        return plan

    def _abort_save(self, plan, commit: Task) -> str | None:
        """Stop a save before its commit: writes not begun are refused, the commit publishes
        nothing; returns once the writes in flight have ended. What it wrote is unreferenced
        and goes at the next gc once this process has ended (or after the grace period).
        Returns None, or how it ended when the commit had already begun (it then completes)."""
        plan.writer.aborted = True
        futures.wait([commit.future])
        if commit.future.exception() is None:
            return f"committed as version {commit.future.result().id}"
        return None

    def _finish_save(self, session: SaveSession, plan, skeleton, record: Version, allow_pickle: bool,
                     classes: dict[str, str]) -> Version:
        if plan.writer.aborted:
            raise SaveAbortedError(f"the save on branch {record.branch!r} was aborted: nothing committed")
        with gc_paused():
            stored = plan.assemble()
        session.make_durable(stored.written_keys)
        self.compactor.encode_later(plan.writer.later, plan.commit, self._tier)
        record.logical_bytes = sum(leaf.nbytes for leaf in stored.leaves if leaf.alias_of is None)
        record.stored_bytes = stored.stored_bytes
        has_pickle = any(leaf.kind == "pickle" for leaf in stored.leaves)
        manifest = Manifest(record, skeleton, stored.leaves, pickle=allow_pickle and has_pickle, classes=classes)
        return session.commit(manifest)

    def _commit(self, manifest: Manifest) -> Version:
        record = manifest.version
        record.tiers = record.tiers or [{"url": t.url, "keep": t.keep, "flush_every": t.flush_every,
                                         **({"local": True} if t.local else {})} for t in self.tier_specs]
        for _ in range(1000):
            seq = self.refs.state_in(self.store, "heads", record.branch)[0]
            head = self.refs.target("heads", record.branch)
            record.parents = [head] if head else []
            record.time = time.time()
            with gc_paused():
                data = manifest.seal()
            vid = record.id
            key = f"versions/{vid}.json"
            with self.ledger.committing(vid):
                self.store.write(key, [data])
                self.store.barrier([key])
                published = self.refs.publish("heads", record.branch, seq + 1, vid)
                if published:
                    self.history.cache.put(vid, manifest)
                    self.ledger.committed(vid, manifest.objects())
            if published:
                self.placement.committed(vid, 0)
                return record
            if self.on_conflict == "error":
                raise ConflictError(
                    f"branch {record.branch!r} of {self.url} moved while saving; version {vid} is "
                    f"stored but not on the branch: keep it with repo.fork({vid!r}, name) or "
                    "repo.tag(name, ...) before gc removes it")
            if published is False:  # None: left for gc (see Refs.publish)
                self.store.delete(key)
        raise ConflictError(f"branch {record.branch!r}: gave up after repeated concurrent updates")


def pending_save(commit: Task, plan, flat) -> PendingSave:
    """The PendingSave of an asynchronous save: its commit, and its captures by the address of
    the live memory each one copies (what the capture hooks wait for); for a device tensor,
    its device-to-host copy; and the captures of the leaves whose writes nothing counts."""
    by_ptr, unwatched = {}, {}
    for i, fl in enumerate(flat):
        d = fl.data
        if d is not None and d.pending is not None:
            by_ptr[d.live_ptr] = [d.pending]
        elif d is not None and i in plan.captures and d.data.size:
            by_ptr[d.live_ptr or d.data.__array_interface__["data"][0]] = plan.captures[i]
            if d.unwatched:
                unwatched.update((id(t), t) for t in plan.captures[i])
    return PendingSave(commit, plan.capture_tasks(), by_ptr, list(unwatched.values()))
