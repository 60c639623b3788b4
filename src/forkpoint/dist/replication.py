"""Replicas of a node-local tier 0 on peer nodes (`fp.tier(path, local=True, replicas=k)`).

After each committed version, the first rank of every node sends the version's objects its
node holds to the next k nodes of the ring (tiers/replication.py decides who sends what) over
a gloo group of those ranks, from a scheduler task; each copy is checked by hash on arrival
and made durable, and only once every node reported its copies durable does each node write
the version's replica record (what every node holds of it): a version is replicated exactly
when its record exists. Retention drops a record with its version.

On restore after a node was lost (its tier 0 empty or behind), the newest version of the
branch that peers and the shared tier can rebuild is chosen; each node gets back what it held
of it from a surviving peer (RAM to RAM), and only objects no peer holds from the shared tier.
"""

import logging
from dataclasses import dataclass

from ..engine.parallel import parallel_map
from ..errors import ForkpointError
from ..format.manifest import Manifest
from ..format.objects import decode_object, object_key
from ..tiers.movement import copy_object
from ..tiers.replication import (ReplicaRecord, batches, plan_recovery, plan_replication, record_key)

log = logging.getLogger("forkpoint")

ROUND_BYTES = 256 << 20
"""The most bytes one node receives from one peer in a round of a transfer."""


@dataclass
class Recovery:
    """What a restore's recovery did: the version chosen, the objects copied from peers and
    from the shared tier, and why the shared tier was read (empty when it was not)."""

    vid: str
    from_peers: int
    from_shared: int
    reason: str


class Replicator:
    """The replicas of one rank's node-local tier 0 (see the module doc). `repo` is the
    fp.dist.Repo (its stores, history, refs and group); `leaders` the first rank of every
    node; `submit(name, fn, after)` queues a task on the repo's scheduler."""

    def __init__(self, repo, leaders: list[int], submit, timeout: float):
        spec = repo.tier_specs[0]
        self.repo, self.replicas, self.budget = repo, spec.replicas, spec.budget
        self.leaders, self.nodes = leaders, len(leaders)
        if self.replicas >= self.nodes:
            raise ValueError(f"tier 0 ({spec.url}) asks for replicas={self.replicas}, but the job has "
                             f"{self.nodes} node(s): each copy must be on another node, so use at most "
                             f"replicas={self.nodes - 1}")
        self.peers = repo.group.peers(leaders, timeout)
        self.member = leaders.index(repo.rank) if repo.rank in leaders else None
        self._submit, self._last = submit, None
        self.last_recovery: Recovery | None = None

    @property
    def store(self):
        return self.repo.store

    def schedule(self, vid: str):
        """(First rank of each node, in commit order) queue the replication of `vid`."""
        if self.member is None:
            return None
        self._last = self._submit("replicate", lambda: self.replicate(vid), self._last)
        return self._last

    def wait(self) -> None:
        """Wait for the replications queued so far (their failures are logged, not raised)."""
        if self._last is not None:
            self._last.future.exception()

    def replicated(self, vid: str) -> bool:
        """True when this node's tier 0 has `vid`'s replica record."""
        return self.store.exists(record_key(vid))

    def replicate(self, vid: str) -> bool:
        """Copy `vid`'s objects to the peers and record it as replicated; False (logged) when
        some copy failed or a budget refused one."""
        try:
            objects = sorted(self.repo.history.manifest_by_id(vid).objects())
            held = {o: self.store.size(object_key(o)) for o in objects if self.store.exists(object_key(o))}
            mine = (held, self._used_bytes(), None)
        except Exception as e:  # still take part, so the peers are not left waiting
            mine = ({}, 0, f"{type(e).__name__}: {e}")
        views = self.peers.all_gather(mine)
        plan = plan_replication([v[0] for v in views], self.replicas, [v[1] for v in views], self.budget)
        sizes = {d: n for v in views for d, n in v[0].items()}
        error = mine[2]
        if error is None:
            try:
                self._transfer(plan.sends, sizes, self._local_bytes, f"replica of version {vid}")
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        errors = self.peers.all_gather(error)
        why = [f"node {n}: {e}" for n, e in enumerate(errors) if e] + plan.short
        if why:
            log.warning("version %s is not replicated: %s", vid, "; ".join(why))
            return False
        self._write_record(ReplicaRecord(vid, self.replicas, plan.holds))
        return True

    def _used_bytes(self) -> int:
        """The bytes of every object this node's tier 0 holds (0 when no budget is set)."""
        if self.budget is None:
            return 0
        return sum(self.store.size(k) for k in self.store.list("objects"))

    def _local_bytes(self, digest: str):
        key = object_key(digest)
        mapped = self.store.map(key, 0, None)
        return self.store.read(key) if mapped is None else mapped

    def _transfer(self, sends: dict, sizes: dict, read, what: str) -> None:
        """Move the objects of `sends` ({(source, target): digests}, same on every member) in
        rounds; what this member receives is checked by hash, written and made durable. A
        failure here still takes part in every round (zeros stand in for an unreadable
        object, which its receiver then refuses), so no peer waits out the timeout; it is
        raised at the end."""
        rounds = {pair: batches(digests, sizes, ROUND_BYTES) for pair, digests in sends.items()}
        count = max((len(r) for r in rounds.values()), default=0)
        written, errors = [], []

        def payload(digest):
            try:
                data = read(digest)
                if len(data) == sizes[digest]:
                    return data
                errors.append(f"object {digest} changed size while it was sent")
            except Exception as e:
                errors.append(f"cannot read object {digest}: {type(e).__name__}: {e}")
            return bytearray(sizes[digest])

        for r in range(count):
            out = {t: [payload(d) for d in rs[r]] for (s, t), rs in rounds.items() if s == self.member and r < len(rs)}
            into = {s: [sizes[d] for d in rs[r]] for (s, t), rs in rounds.items() if t == self.member and r < len(rs)}
            got = self.peers.exchange(out, into)
            for source, buffers in got.items():
                for digest, data in zip(rounds[(source, self.member)][r], buffers):
                    try:
                        decode_object(data, digest, f"{what} from node {source}", pmap=parallel_map)
                    except Exception as e:
                        errors.append(str(e))
                        continue
                    self.store.write(object_key(digest), [data])
                    written.append(object_key(digest))
        if written:
            self.store.barrier(written)
        if errors:
            raise ForkpointError(f"{what}: " + "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)"
                                                                       if len(errors) > 3 else ""))

    def _write_record(self, record: ReplicaRecord) -> None:
        key = record_key(record.vid)
        self.store.write(key, [record.to_bytes()])
        self.store.barrier([key])

    def recover(self, branch: str) -> Recovery | None:
        """(Collective, every rank) when some node's tier 0 lacks what the others hold of
        `branch` (a node was lost and replaced), bring every node's part of the newest
        version that can be rebuilt back from peers and the shared tier; the Recovery, or
        None when no node lost anything (or no node holds the branch)."""
        survey = self._survey(branch) if self.member is not None else None
        surveys = [s for s in self.repo.group.all_gather(survey) if s is not None]
        heads = [s["head"] for s in surveys]
        if not any(heads) or len(set(heads)) == 1:
            return None
        decision = self.repo.group.broadcast(self._decide(surveys) if self.repo.rank == 0 else None)
        error = None
        if self.member is not None and decision.get("vid"):
            try:
                self._rebuild(branch, decision)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        failed = [(r, e) for r, e in enumerate(self.repo.group.all_gather(error)) if e]
        if failed:
            raise ForkpointError("recovery of the node-local tier failed: "
                                 + "; ".join(f"rank {r}: {e}" for r, e in failed))
        if not decision.get("vid"):
            log.warning("no version of %r can be rebuilt from the nodes: %s", branch, decision["reason"])
            return None
        if decision["reason"]:
            log.warning("restoring version %s: %s", decision["vid"], decision["reason"])
        self.last_recovery = Recovery(decision["vid"], sum(len(v) for v in decision["sends"].values()),
                                      sum(len(v) for v in decision["from_shared"].values()), decision["reason"])
        return self.last_recovery

    def _survey(self, branch: str) -> dict:
        """What this node holds of `branch`: its head, and for each version on its tier 0
        (newest first) the time, the objects, those present and the replica record."""
        refs, history = self.repo.refs, self.repo.history
        head = refs.state_in(self.store, "heads", branch)[1]
        versions = {}
        for vid in history.version_ids(self.store):
            try:
                m = Manifest.from_bytes(self.store.read(f"versions/{vid}.json"), f"{self.store.url}/versions/{vid}")
            except Exception:  # a damaged manifest: that version is not offered by this node
                continue
            if m.version.pruned or m.version.branch != branch:
                continue
            objects = sorted(m.objects())
            record = None
            if self.store.exists(record_key(vid)):
                try:
                    record = ReplicaRecord.from_bytes(self.store.read(record_key(vid)), record_key(vid),
                                                      self.nodes).holds
                except ValueError as e:
                    log.warning("%s", e)
            present = {}
            for o in objects:
                try:
                    present[o] = self.store.size(object_key(o))
                except FileNotFoundError:
                    pass
            versions[vid] = {"time": m.version.time, "objects": objects, "record": record, "present": present}
        return {"head": head, "versions": versions}

    def _decide(self, surveys: list[dict]) -> dict:
        """(Rank 0) the newest version every object of which a surviving node or the shared
        tier holds, and how each node gets back its part of it."""
        shared = self.repo.stores[1:]
        versions: dict = {}
        for s in surveys:
            for vid, v in s["versions"].items():
                versions.setdefault(vid, v)
                if v["record"] and not versions[vid]["record"]:
                    versions[vid]["record"] = v["record"]
        lost = [n for n, s in enumerate(surveys) if not s["head"]]
        reason = ""
        for vid in sorted(versions, key=lambda x: versions[x]["time"], reverse=True):
            v = versions[vid]
            present = [set(s["versions"].get(vid, {}).get("present", ())) for s in surveys]
            sizes = {d: n for s in surveys for d, n in s["versions"].get(vid, {}).get("present", {}).items()}
            record = v["record"]
            needed = [set(h) for h in record] if record else [set() for _ in surveys]
            plan = plan_recovery(needed, present, lambda d: any(st.exists(object_key(d)) for st in shared))
            lacking = [o for o in v["objects"] if not any(o in p for p in present)]
            on_shared = [o for o in lacking if any(st.exists(object_key(o)) for st in shared)]
            if plan.missing or len(on_shared) < len(lacking):
                reason = (f"{len(lacking) - len(on_shared)} object(s) of version {vid} are on no surviving "
                          f"node and not on the shared tier")
                log.info("version %s cannot be rebuilt: %s", vid, reason)
                continue
            if lacking:
                why = (f"{len(lacking)} of its {len(v['objects'])} objects are on no surviving node "
                       f"(node(s) {lost} lost their tier 0, " +
                       (f"replicas={self.replicas})" if record else "and the version was never fully replicated)"))
                reason = f"{why}: they are read from {shared[0].url}"
            else:
                reason = ""
            return {"vid": vid, "reason": reason, "record": record,
                    "sends": {f"{s},{t}": d for (s, t), d in plan.sends.items()},
                    "from_shared": {str(t): d for t, d in plan.from_shared.items()},
                    "sizes": {d: sizes[d] for ds in plan.sends.values() for d in ds},
                    "manifest_from": next(n for n, s in enumerate(surveys) if vid in s["versions"])}
        return {"vid": None, "reason": reason or "no node holds a version of it"}

    def _rebuild(self, branch: str, decision: dict) -> None:
        """(First rank of each node) receive this node's part of the chosen version from peers
        and the shared tier, then record the version (and its replica record) here."""
        vid, donor, key = decision["vid"], decision["manifest_from"], f"versions/{decision['vid']}.json"
        sends = {tuple(int(x) for x in pair.split(",")): d for pair, d in decision["sends"].items()}
        error = None
        try:  # every member takes part in each exchange, whatever failed here
            self._transfer(sends, decision["sizes"], self._local_bytes, f"version {vid}, recovered")
        except Exception as e:
            error = e
        data = self.peers.all_gather(self.store.read(key) if self.member == donor else None)[donor]
        if error is not None:
            raise error
        for digest in decision["from_shared"].get(str(self.member), ()):
            copy_object(self.repo.stores[1:], self.store, object_key(digest), parallel_map)
        if not self.store.exists(key):
            m = Manifest.from_bytes(data, f"version {vid} from node {donor}")
            if m.version.id != vid:
                raise ForkpointError(f"node {donor} sent a manifest of {m.version.id} for {vid}")
            self.store.write(key, [data])
            self.store.barrier([key])
        if self.repo.refs.state_in(self.store, "heads", branch)[1] != vid:
            # a newer head is one that can no longer be rebuilt: every node resumes from `vid`
            self.repo.refs.move(self.store, "heads", branch, vid)
        if decision["record"] and not self.replicated(vid):
            self._write_record(ReplicaRecord(vid, self.replicas, decision["record"]))
