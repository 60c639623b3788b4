"""A repository shared by the ranks of a torch.distributed process group.

Every rank writes its own pieces in parallel: the shards of DTensors it holds (one writer
per shard when a mesh dimension replicates them), its share of the replicated tensors
(spread over ranks by size), and its rank-local state. Rank 0 gathers the parts, checks
them, and commits one manifest; the version exists only once every rank's data is durable.

A node-local tier 0 (`fp.tier(path, local=True)`, or `mem://`, private to each process) is
handled by dist/node_local.py.
"""

import json
import os
import socket
import uuid

from ..engine.gcpause import gc_paused
from ..engine.save import launch_device_copies
from ..engine.scheduler import Priority
from ..errors import ForkpointError
from ..format.manifest import Version
from ..format.objects import object_key
from ..repo import Repo as BaseRepo
from ..repo.core import pending_save
from ..repo.records import environment, save_fields
from ..state import capture, classes_of, flatten
from .assembly import (assemble_manifest, assign_replicated, layout_fingerprint, split_rank_local,
                       writer_class)
from .coordinator import Coordinator, DistSaveError
from .group import Group, TorchGroup, hosts_of
from .node_local import NodeLocalFlushRules, NodeLocalMixin, assign_flush, check_node_local
from .replication import Replicator


class RankRepo(BaseRepo):
    """One rank's own fp.Repo within an fp.dist.Repo, which makes saves, restores and flushes
    collective over it: it may keep replicas of tier 0 (the collective repository makes them),
    and a rank's exit does not wait for saves in flight (they wait for every rank, and the
    others may be gone)."""

    collective = True
    closes_at_exit = False

    def __init__(self, url, rank: int, world: int, **kwargs):
        self.rank, self.world = rank, world
        super().__init__(url, **kwargs)


class Repo(NodeLocalMixin):
    """`fp.Repo` for a process group: call `save` and `restore` on every rank, in the same
    order (they are collective). `timeout` bounds how long a save waits for slow or dead
    ranks before failing with DistSaveError. Tier 0 is either storage every rank reaches or
    node-local (see dist/node_local.py; it needs `keep` and a shared tier below it). Eviction
    from a tier other processes write to spares unreferenced objects younger than
    `sweep_grace` seconds (their saves in flight).

    It wraps this rank's RankRepo (`repo`) and a Coordinator (`coordinator`): the collective
    calls are its own, and the rest of fp.Repo's API (reads, refs, history, upkeep) is the
    rank's repository's."""

    collective = True
    repo: RankRepo | None = None

    def __init__(self, url=None, *, group=None, timeout: float = 300.0, kv_store=None,
                 create: bool = False, sweep_grace: float = 300.0, **kwargs):
        self._check_arguments(url, kwargs)
        self._join(TorchGroup(group, kv_store), url, create=create, timeout=timeout, sweep_grace=sweep_grace,
                   **kwargs)

    api_name = "fp.dist.Repo"

    def _check_arguments(self, url, kwargs: dict) -> None:
        """Refuse what a collective repository cannot do, before any rank opens anything."""
        if kwargs.get("encode_later") or getattr(kwargs.get("options"), "encode_later", False):
            raise ValueError(f"encode_later=True is not supported by {self.api_name} (each rank encodes its "
                             "chunks before the coordinated commit); use repo.compact() after the run")
        check_node_local(url, kwargs.get("tiers"), self.api_name)

    def _join(self, group: Group, url, *, create: bool, timeout: float, sweep_grace: float, **kwargs) -> None:
        """Open the repository on every rank of `group` (collective): rank 0 first, creating it
        if asked, then the others; every rank raises if any rank could not."""
        self.group, self.rank, self.world = group, group.rank, group.world
        status, error = None, None
        if self.rank == 0:
            try:
                self.repo = RankRepo(url, self.rank, self.world, create=create, **kwargs)
                status = uuid.uuid4().hex[:12]
            except Exception as e:  # tell the other ranks, then raise here
                error, status = e, f"error: {type(e).__name__}: {e}"
        status = group.broadcast(status)
        hosts = hosts_of(group)
        if error is not None:
            raise error
        if status.startswith("error: "):
            raise ForkpointError(f"rank 0 could not open the repository: {status[7:]}")
        if self.rank != 0:
            try:
                self.repo = RankRepo(url, self.rank, self.world, create=False, **kwargs)
            except Exception as e:  # the others must not wait for this rank in a collective
                error = e
        failed = [r for r, bad in enumerate(group.all_gather(error is not None)) if bad]
        if error is not None:
            raise error
        if failed:
            self.repo.close()
            raise ForkpointError(f"rank(s) {failed} could not open the repository {self.url} (see their errors)")
        self.coordinator = Coordinator(group.key_value(status), self.rank, self.world, timeout)
        self.local_world = hosts.count(socket.gethostname())
        capacity = self.repo.scheduler.capacity
        for shared_by_ranks in ("cpu", "encode"):
            capacity[shared_by_ranks] = max(1, min(capacity[shared_by_ranks],
                                                   (os.cpu_count() or 1) // self.local_world))
        self._saves = 0
        self.node_ranks = self._node_group(hosts[self.rank])
        self.repo.placement.rules = NodeLocalFlushRules(self.rank, self.stores, self.node_ranks,
                                                        self.coordinator, sweep_grace)
        self.replicator = self._replicator(timeout)

    def __getattr__(self, name: str):
        """The rest of fp.Repo's API is this rank's repository's."""
        repo = self.__dict__.get("repo")
        if repo is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(repo, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<{self.api_name} {self.repo.url if self.repo else '(not open)'} rank {self.rank} of {self.world}>"

    def _replicator(self, timeout: float) -> Replicator | None:
        """(Collective) the replicas of tier 0 when it asks for them, else None."""
        if not self.tier_specs[0].replicas:
            return None
        if not hasattr(self.group, "peers"):
            raise ValueError(f"{self.api_name} cannot keep replicas of tier 0 (its processes have no "
                             "point-to-point transfers): use fp.dist.Repo (torch.distributed)")
        return Replicator(self, self.node_leaders, lambda name, fn, after: self.repo.scheduler.submit(
            name, fn, priority=Priority.FLUSH, after=[after] if after is not None else []), timeout)

    def recover(self, branch: str = "main"):
        """(Collective) rebuild what nodes lost of `branch` from their peers' replicas (see
        dist/replication.py): the Recovery, or None when nothing was lost or tier 0 keeps no
        replicas. restore and Checkpointer.resume call it."""
        return None if self.replicator is None else self.replicator.recover(branch)

    @property
    def last_recovery(self):
        """What the last recovery did (dist.replication.Recovery: version, objects from peers
        and from the shared tier, why the shared tier was read), or None."""
        return None if self.replicator is None else self.replicator.last_recovery

    def replicated(self, ref: str = "main") -> bool:
        """(Collective) True when every object of version `ref` has replicas+1 copies on
        distinct nodes (its replica record is on this node's tier 0), once the replications
        queued so far have ended (each node's first rank answers for the node)."""
        if self.replicator is None:
            return False
        vid = self.resolve(ref)
        self.replicator.wait()
        mine = self.replicator.replicated(vid) if self.replicator.member is not None else None
        return self.group.all_gather(mine)[self.node_ranks[0]]

    def close(self) -> None:
        """Wait for saves in flight, then release threads and the process group's store."""
        self.repo.close()
        self.coordinator.close()
        self.group.close()

    def save(self, state, branch: str = "main", step: int | None = None, message: str = "",
             metrics: dict | None = None, meta: dict | None = None, sync: bool = True,
             allow_pickle: bool = False):
        """Collective save: every rank calls it with its part of the same state. Returns the
        Version on every rank (sync) or a PendingSave; DistSaveError if any rank failed."""
        repo = self.repo
        if repo.closed:
            raise RuntimeError(f"repository {self.url} is closed")
        sid = f"save-{self._saves}"
        self._saves += 1
        try:
            step, message, metrics, meta = save_fields(branch, step, message, metrics, meta)
            if not sync:
                repo.commits.wait_for_room(repo.options.max_pending)
            with gc_paused():
                skeleton, shared, local_skeleton, local, select, classes = self._flat_parts(state, allow_pickle)
            n_shared = len(shared)
            # rank 0 publishes the ref and checks the branch's holder; the others are the same run
            session = repo.begin_save(branch, check_holder=self.rank == 0)
        except Exception as e:
            self._refuse_save(sid, e)
            raise
        with repo.scheduler.batch():
            try:  # reading the head's packs or the delta bases can fail: tell the others now
                plan = session.schedule(shared + local, sync, select=select, pack_key=writer_class(shared))
            except Exception as e:
                session.close()
                self._refuse_save(sid, e)
                raise
            plan.writer.keeps_advice = self.rank == 0  # one writer of codec="auto"'s advice
            fingerprint = layout_fingerprint(shared)
            part = repo.scheduler.submit(
                "part", lambda: self._publish_part(session, sid, plan, n_shared, local_skeleton, fingerprint,
                                                   {"branch": branch, "step": step}),
                priority=Priority.COMMIT, after=plan.writes)
            if self.rank == 0:
                record = Version("", [], branch, step, 0.0, message, metrics, meta,
                                 env={**environment(), "world_size": self.world})
                finish = session.queue_commit(
                    lambda: self._coordinate(session, sid, part, skeleton, record, n_shared, allow_pickle,
                                             classes),
                    sync, after=[part])
            else:
                finish = session.queue_commit(lambda: self._await_outcome(session, sid, part), sync,
                                              after=[part], io=False)
        if sync:
            return finish.result()
        return pending_save(finish, plan, shared + local)

    def _refuse_save(self, sid: str, error: Exception) -> None:
        """Tell the other ranks at once that this rank cannot take part in save `sid` (bad
        arguments, an unsupported leaf), instead of letting them wait out the timeout."""
        message = f"{type(error).__name__}: {error}"
        try:
            self.coordinator.publish(sid, {"error": message})
            if self.rank == 0:
                self.coordinator.announce(sid, {"error": f"rank 0 refused it: {message}"})
            else:
                self.coordinator.acknowledge(sid)
        except Exception:  # the store is gone: the others then time out as before
            pass

    def _flat_parts(self, state, allow_pickle: bool):
        """(skeleton, shared leaves, rank-local skeleton, rank-local leaves, select, classes) of
        `state`: `select(leaf index, box)` is True for the pieces this rank writes; `classes` is
        the manifest's record of its stateful objects."""
        tree, objects = capture(state)
        tree, local_trees = split_rank_local(tree, objects)
        deferred = self.repo.device.deferring()
        skeleton, shared = flatten(tree, allow_pickle=allow_pickle, copy=False, device_capture=deferred)
        local_skeleton, local = flatten(local_trees, allow_pickle=allow_pickle, copy=False,
                                        device_capture=deferred)
        n_shared = len(shared)
        for fl in local:
            if fl.alias_of is not None:
                fl.alias_of += n_shared
        if self.node_local:
            writers, me = len(self.node_ranks), self.node_ranks.index(self.rank)
        else:
            writers, me = self.world, self.rank
        owners = assign_replicated(shared, self.options, writers, whole_small=self.node_local)

        def select(i: int, box) -> bool:
            if i >= n_shared:
                return True
            d = shared[i].data
            if d.box is not None:
                return d.owner
            return owners.get((i, box[0][0] if box[0] else 0)) == me

        launch_device_copies(shared + local, self.options, select, writer_class(shared))
        return skeleton, shared, local_skeleton, local, select, classes_of(objects)

    def warm_staging(self, state, allow_pickle: bool = False) -> int:
        """Fault in the staging buffers this rank's asynchronous saves of `state` will use."""
        _, shared, _, local, select, _ = self._flat_parts(state, allow_pickle)
        return self.repo.warm_leaves(shared + local, select, writer_class(shared))

    def _publish_part(self, session, sid: str, plan, n_shared: int, local_skeleton: dict,
                      fingerprint: str, call: dict):
        """Make this rank's written chunks durable and hand them to the coordinator."""
        try:
            failed = next((t.future.exception() for t in plan.writes if t.future.exception()), None)
            if failed is not None:
                raise failed
            with gc_paused():
                stored = plan.assemble()
            session.make_durable(stored.written_keys)
            locals_ = []
            for leaf in stored.leaves[n_shared:]:
                d = leaf.to_json()
                if leaf.alias_of is not None:
                    d["alias_of"] = leaf.alias_of - n_shared
                locals_.append(d)
            part = {
                "chunks": {str(i): [c.to_json() for c in leaf.chunks]
                           for i, leaf in enumerate(stored.leaves[:n_shared]) if leaf.chunks},
                "local_tree": local_skeleton, "local_leaves": locals_,
                "stored_bytes": stored.stored_bytes, "layout": fingerprint, "leaves": n_shared, "call": call}
            if self.node_local:
                part["held"] = sorted({o for leaf in stored.leaves for c in leaf.chunks for o in c.objects
                                       if self.store.exists(object_key(o))})
            self.coordinator.publish(sid, part)
            return stored
        except Exception as e:
            self.coordinator.publish(sid, {"error": f"{type(e).__name__}: {e}"})
            raise

    def _coordinate(self, session, sid, part, skeleton, record: Version, n_shared: int,
                    allow_pickle: bool, classes: dict[str, str]) -> Version:
        """(Rank 0) gather every part, assemble one manifest, commit it and announce the outcome."""
        try:
            parts = self.coordinator.gather(sid)
            own = part.result()
            manifest = assemble_manifest(record, skeleton, own.leaves[:n_shared], parts, allow_pickle)
            manifest.classes = classes
            assignment = assign_flush(manifest, parts) if self.node_local else None
            with self.repo.placement.rules.sharing(assignment[0] if assignment else None):
                version = session.commit(manifest)
            if self.replicator is not None:
                self.replicator.schedule(version.id)
        except Exception as e:
            self.coordinator.announce(sid, {"error": f"{type(e).__name__}: {e}"})
            if isinstance(e, DistSaveError):
                raise
            raise DistSaveError(f"save {sid} did not commit: {type(e).__name__}: {e}") from e
        extras, cleanup = {}, []
        if self.node_local:
            extras = {"manifest": manifest.to_bytes(),
                      **{f"flush/{r}": json.dumps(keys) for r, keys in enumerate(assignment) if r}}
            cleanup = [f"recorded/{r}" for r in self.node_leaders if r]
        self.coordinator.announce(sid, {"id": version.id}, extras, cleanup)
        return version

    def _await_outcome(self, session, sid: str, part) -> Version:
        """(Other ranks) wait for rank 0's outcome; return the committed Version (with a
        node-local tier 0, after recording it there)."""
        flush = []
        outcome = self.coordinator.outcome(
            sid, (lambda o: flush.append(self._record_locally(sid, o["id"]))) if self.node_local else None)
        if "error" in outcome:
            raise DistSaveError(f"save {sid} did not commit (reported by rank 0): {outcome['error']}")
        part.result()
        if self.replicator is not None:
            self.replicator.schedule(outcome["id"])
        if flush:
            with self.repo.placement.rules.sharing(flush[0]):
                self.repo.placement.committed(outcome["id"], 0)
        session.adopt_deltas()
        return self.history.manifest_by_id(outcome["id"]).version
