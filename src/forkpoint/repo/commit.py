"""The commit protocol: how a version comes to exist, for every writer of a repository
(`fp.Repo.save`, `fp.dist.Repo`, the DCP Writer, the framework plug-ins).

    with repo.begin_save("main") as session:   # the branch is not held by another run, and
        writer = session.writer()               # a lease tells other processes' gc to wait
        codec = writer.put(digest, data)        # 1. objects (deduplicated, encoded, verified)
        session.make_durable(writer.written)    # 2. durable before anything refers to them
        version = session.commit(manifest)      # 3. the manifest, then 4. the branch ref

Leaving the block without `commit` publishes nothing; what was written is unreferenced and
goes at a later gc. Until the session ends, this process's gc and eviction spare every object
its writers wrote or refer to. Saves the scheduler runs take their writer from `schedule`
and queue their commit with `queue_commit`, which keeps the repository's saves committing in
the order they were made (`repo.commits`).
"""

import collections
from concurrent import futures

from ..engine.save import ScheduledSave, schedule_save
from ..engine.objectwriter import ObjectWriter
from ..engine.scheduler import Priority, Task
from ..format.manifest import Chunk, Manifest, Version


class CommitQueue:
    """The commit tasks of one repository's scheduled saves, in the order they were made:
    `last`, the newest (the next one runs after it), and the asynchronous ones not yet
    committed, which `wait_for_room` bounds."""

    def __init__(self):
        self.last: Task | None = None
        self._pending: collections.deque[Task] = collections.deque()

    def wait_for_room(self, max_pending: int) -> None:
        """Before an asynchronous save: wait until fewer than `max_pending` earlier ones are
        uncommitted (their errors reach their own PendingSave, not this caller)."""
        pending = self._pending
        while pending and pending[0].done():
            pending.popleft()
        while len(pending) >= max_pending:
            futures.wait([pending.popleft().future])
            while pending and pending[0].done():
                pending.popleft()

    def add(self, commit: Task, sync: bool) -> None:
        """`commit` is the newest save's commit task (outstanding until it ends, unless `sync`)."""
        self.last = commit
        if not sync:
            self._pending.append(commit)


class SaveSession:
    """One version in the making on `branch` of `repo` (see the module's docstring).
    `check_holder=False` skips the check that no other live run holds the branch (the ranks
    of one run other than the one that publishes)."""

    def __init__(self, repo, branch: str, check_holder: bool = True):
        if check_holder:
            repo.refs.holds.check(branch)
        repo.leases.hold(repo.store)
        self.repo, self.branch = repo, branch
        self.head: Manifest | None = repo._head_manifest(branch)
        """The manifest of the branch head the new version builds on (None: no usable head)."""
        if check_holder and self.head is None:  # perhaps a new branch: not one named like a tag
            repo.refs.refuse_shadowing("heads", branch)
        self.deltas = None
        self._writers: list[ObjectWriter] = []
        self.closed = False

    def known_chunks(self) -> dict[str, Chunk]:
        """The head's packed chunks by hash, which the new version may refer to unwritten."""
        return self.repo._known_chunks(self.head)

    def writer(self, codec=None) -> ObjectWriter:
        """An ObjectWriter to this repository's store under `codec` (default: the repository's
        codec rules), tracked until the session ends."""
        repo = self.repo
        writer = ObjectWriter(repo.store, repo.options.codec if codec is None else codec, guard=repo.placement.evict_lock)
        with repo.placement.evict_lock:
            self._track(writer)
        return writer

    def schedule(self, flat, sync: bool, **options) -> ScheduledSave:
        """Queue the capture and write tasks of `flat` on the repository's scheduler (see
        engine.save.schedule_save; `options` go to it) with deltas against the head where the
        repository stores them; the plan's writer is tracked before any task can run."""
        repo = self.repo
        known = self.known_chunks()  # touches the head's packs: I/O kept outside the evict lock
        self.deltas = repo._delta_plan(self.head)
        guard = repo.placement.evict_lock
        with guard:
            plan = schedule_save(repo.scheduler, repo.store, repo._tier, flat, known, repo.options,
                                 repo.staging, "window" if sync else "staging", guard=guard,
                                 deltas=self.deltas, layouts=repo._layouts, pacing=repo._pacing, **options)
            self._track(plan.writer)
        return plan

    def queue_commit(self, fn, sync: bool, deps=(), after=(), io: bool = True) -> Task:
        """Queue `fn` (which commits this version, or learns how its commit ended) on the
        scheduler, to run once `deps` succeeded, `after` ended and the repository's previous
        save's commit ended; the session closes once it ends. `io`: it holds a tier-0 I/O slot.
        Returns the task (see CommitQueue for `sync`)."""
        repo = self.repo
        task = repo.scheduler.submit("commit", fn, priority=Priority.COMMIT, deps=deps,
                                     after=[*after, repo.commits.last],
                                     needs={f"io:{repo._tier}": 1} if io else {})
        repo.scheduler.submit("cleanup", self.close, priority=Priority.COMMIT, after=[task])
        repo.commits.add(task, sync)
        return task

    def make_durable(self, keys) -> None:
        """Make the objects at `keys` durable (before a manifest that refers to them)."""
        self.repo.store.barrier(list(keys))

    def commit(self, manifest: Manifest) -> Version:
        """Write `manifest` and publish it as the branch's new head (its parents are set to
        the head at that moment); ConflictError as the repository's on_conflict says."""
        if manifest.version.branch != self.branch:
            raise ValueError(f"a session on branch {self.branch!r} cannot commit to {manifest.version.branch!r}")
        version = self.repo._commit(manifest)
        self.adopt_deltas()
        return version

    def adopt_deltas(self) -> None:
        """Once the version is committed (here, or by the rank that publishes): its chunk
        values become the bases of the next save's deltas."""
        if self.deltas is not None:
            self.repo._delta_values = self.deltas.next_values

    def abort(self) -> None:
        """Refuse the writes not yet begun; the session publishes nothing."""
        for writer in self._writers:
            writer.aborted = True

    def close(self) -> None:
        """End the session (idempotent): its objects are no longer spared by this process."""
        if self.closed:
            return
        self.closed = True
        repo = self.repo
        with repo.placement.evict_lock:
            for writer in self._writers:
                repo.placement.forget(writer)
        if self.deltas is not None:
            with repo._lock:
                repo._delta_plans.discard(self.deltas)

    def _track(self, writer: ObjectWriter) -> None:
        """Register `writer` (with the evict lock held) so that eviction spares its objects."""
        self.repo.placement.track(writer)
        self._writers.append(writer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
