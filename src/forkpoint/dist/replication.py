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

import numpy as np

from ..engine.parallel import parallel_map
from ..errors import ForkpointError
from ..format.manifest import Manifest
from ..format.objects import decode_object, object_key
from ..tiers.movement import copy_object
from ..tiers.replication import (ReplicaRecord, batches, delivered, plan_recovery, plan_replication,
                                 record_key)

log = logging.getLogger("forkpoint")

ROUND_BYTES = 256 << 20
"""About the most bytes one node receives from one peer in a round of a transfer."""

MAX_OBJECT_BYTES = 1 << 40
"""A peer's announced object size above this is refused (a corrupted message)."""


@dataclass
class Recovery:
    """What a restore's recovery did: the version chosen, the objects of the nodes' own parts
    copied from peers and from the shared tier before the restore, the replicas re-seeded in
    the background after it, and why the shared tier was read (empty when it was not)."""

    vid: str
    from_peers: int
    from_shared: int
    reseeded: int
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
        self._reseed_due: dict | None = None

    @property
    def store(self):
        return self.repo.store

    def schedule(self, vid: str):
        """(First rank of each node, in commit order) queue the replication of `vid`."""
        if self.member is None:
            return None
        self.start_reseed()  # a recovery not followed by a restore re-seeds before this copy
        self._last = self._submit("replicate", lambda: self.replicate(vid), self._last)
        return self._last

    def wait(self) -> None:
        """Wait for the replications queued so far (their failures are logged, not raised)."""
        self.start_reseed()
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
        sizes = {d: n for v in views for d, n in v[0].items()}  # estimates: each file's own size is sent
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
        self._write_record(ReplicaRecord(vid, self.replicas, plan.own, plan.holds))
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
        rounds of about ROUND_BYTES (by `sizes`, estimates: each round first sends the files'
        own sizes, as copies of one object may be encoded differently on different nodes);
        what this member receives is checked by hash, written and made durable. A failure
        here still takes part in every round (a byte stands in for an unreadable object,
        which its receiver then refuses), so no peer waits out the timeout; it is raised at
        the end."""
        rounds = {pair: batches(digests, {d: sizes.get(d, 1 << 20) for d in digests}, ROUND_BYTES)
                  for pair, digests in sends.items()}
        count = max((len(r) for r in rounds.values()), default=0)
        written, errors = [], []

        def payload(digest):
            try:
                return read(digest)
            except Exception as e:
                errors.append(f"cannot read object {digest}: {type(e).__name__}: {e}")
                return b"\0"

        for r in range(count):
            mine = {t: rs[r] for (s, t), rs in rounds.items() if s == self.member and r < len(rs)}
            theirs = {s: rs[r] for (s, t), rs in rounds.items() if t == self.member and r < len(rs)}
            out = {t: [payload(d) for d in digests] for t, digests in mine.items()}
            lengths = self.peers.exchange(
                {t: [np.array([len(b) for b in bufs], dtype=np.int64).tobytes()] for t, bufs in out.items()},
                {s: [8 * len(digests)] for s, digests in theirs.items()})
            into = {s: [int(n) for n in np.frombuffer(lengths[s][0], dtype=np.int64)] for s in theirs}
            if any(n < 1 or n > MAX_OBJECT_BYTES for ns in into.values() for n in ns):
                raise ForkpointError(f"{what}: a peer announced an object size out of range")
            got = self.peers.exchange(out, into)
            for source, buffers in got.items():
                for digest, data in zip(theirs[source], buffers):
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
        `branch` (a node was lost and replaced), bring back every node's own part of the
        newest version that can be rebuilt, from peers and the shared tier, before this
        returns; the replicas a node held for others follow in the background (then the
        replica record). The Recovery, or None when no node lost anything."""
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
        self._reseed_due = decision
        now, later = decision["now"], decision["later"]
        self.last_recovery = Recovery(decision["vid"], sum(map(len, now["sends"].values())),
                                      sum(map(len, now["from_shared"].values())),
                                      sum(map(len, later["sends"].values())) + sum(map(len, later["from_shared"].values())),
                                      decision["reason"])
        return self.last_recovery

    def start_reseed(self) -> None:
        """After the restore a recovery served (or the next save or wait): queue the re-seeding
        of the replicas the nodes held for others, so it does not compete with the restore's reads."""
        decision, self._reseed_due = self._reseed_due, None
        if decision is not None and self.member is not None:
            self._last = self._submit("reseed", lambda: self._reseed(decision), self._last)

    def _survey(self, branch: str) -> dict:
        """What this node holds of `branch`: its head, and for each version on its tier 0 the
        time, the objects, those present (with their sizes) and the replica record."""
        head = self.repo.refs.state_in(self.store, "heads", branch)[1]
        versions = {}
        for vid in self.repo.history.version_ids(self.store):
            try:
                m = Manifest.from_bytes(self.store.read(f"versions/{vid}.json"), f"{self.store.url}/versions/{vid}")
            except Exception:  # a damaged manifest: that version is not offered by this node
                continue
            if m.version.id != vid or m.version.pruned or m.version.branch != branch:
                continue
            present = {}
            for o in sorted(m.objects()):
                try:
                    present[o] = self.store.size(object_key(o))
                except FileNotFoundError:
                    pass
            versions[vid] = {"time": m.version.time, "objects": sorted(m.objects()), "present": present,
                             "record": self._record(vid)}
        return {"head": head, "versions": versions}

    def _record(self, vid: str) -> dict | None:
        """This node's replica record of `vid` ({"own", "holds"}), or None (absent or damaged)."""
        try:
            r = ReplicaRecord.from_bytes(self.store.read(record_key(vid)), record_key(vid), self.nodes)
        except FileNotFoundError:
            return None
        except ValueError as e:
            log.warning("%s", e)
            return None
        return {"own": r.own, "holds": r.holds}

    def _decide(self, surveys: list[dict]) -> dict:
        """(Rank 0) the newest version every object of which a surviving node or the shared
        tier holds, and how each node gets back its own part of it (`now`) and the replicas
        it held for others (`later`)."""
        shared = self.repo.stores[1:]
        versions: dict = {}
        for s in surveys:
            for vid, v in s["versions"].items():
                versions.setdefault(vid, dict(v))
                versions[vid]["record"] = versions[vid]["record"] or v["record"]
        lost = [n for n, s in enumerate(surveys) if not s["head"]]

        def on_shared(d):
            return any(st.exists(object_key(d)) for st in shared)
        reason = "no node holds a version of it"
        for vid in sorted(versions, key=lambda x: versions[x]["time"], reverse=True):
            v, record = versions[vid], versions[vid]["record"]
            present = [set(s["versions"].get(vid, {}).get("present", ())) for s in surveys]
            sizes = {d: n for s in surveys for d, n in s["versions"].get(vid, {}).get("present", {}).items()}
            none = [set() for _ in surveys]
            now = plan_recovery([set(h) for h in record["own"]] if record else none, present, on_shared)
            later = plan_recovery([set(h) for h in record["holds"]] if record else none,
                                  delivered(now, present), on_shared)
            lacking = [o for o in v["objects"] if not any(o in p for p in present)]
            kept = [o for o in lacking if on_shared(o)]
            if now.missing or later.missing or len(kept) < len(lacking):
                reason = f"{len(lacking) - len(kept)} object(s) of version {vid} are on no surviving node nor below"
                log.info("version %s cannot be rebuilt: %s", vid, reason)
                continue
            reason = ""
            if lacking:
                reason = (f"{len(lacking)} of its {len(v['objects'])} objects are on no surviving node (node(s) "
                          f"{lost} lost their tier 0, " + (f"replicas={self.replicas})" if record else
                                                           "and the version was never fully replicated)")
                          + f": they are read from {shared[0].url}")
            return {"vid": vid, "reason": reason, "record": record, "sizes": sizes,
                    "now": _plan_json(now), "later": _plan_json(later),
                    "manifest_from": next(n for n, s in enumerate(surveys) if vid in s["versions"])}
        return {"vid": None, "reason": reason}

    def _rebuild(self, branch: str, decision: dict) -> None:
        """(First rank of each node) receive this node's own part of the chosen version from
        peers and the shared tier, then record the version and its head here."""
        vid, donor, key = decision["vid"], decision["manifest_from"], f"versions/{decision['vid']}.json"
        error = None
        try:  # every member takes part in each exchange, whatever failed here
            self._carry_out(decision["now"], decision["sizes"], f"version {vid}, recovered")
        except Exception as e:
            error = e
        data = self.peers.all_gather(self.store.read(key) if self.member == donor else None)[donor]
        if error is not None:
            raise error
        if not self.store.exists(key):
            m = Manifest.from_bytes(data, f"version {vid} from node {donor}")
            if m.version.id != vid:
                raise ForkpointError(f"node {donor} sent a manifest of {m.version.id} for {vid}")
            self.store.write(key, [data])
            self.store.barrier([key])
        if self.repo.refs.state_in(self.store, "heads", branch)[1] != vid:
            # a newer head is one that can no longer be rebuilt: every node resumes from `vid`
            self.repo.refs.move(self.store, "heads", branch, vid)

    def _reseed(self, decision: dict) -> bool:
        """(First rank of each node, in the background after a recovery) receive the replicas
        this node held for others; once every node has, record the version as replicated
        again where the record is missing."""
        vid, error = decision["vid"], None
        try:
            self._carry_out(decision["later"], decision["sizes"], f"replicas of version {vid}, re-seeded")
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        errors = self.peers.all_gather(error)
        if any(errors):
            log.warning("version %s is not replicated again after the recovery: %s", vid,
                        "; ".join(f"node {n}: {e}" for n, e in enumerate(errors) if e))
            return False
        record = decision["record"]
        if record and not self.replicated(vid):
            self._write_record(ReplicaRecord(vid, self.replicas, record["own"], record["holds"]))
        return True

    def _carry_out(self, plan: dict, sizes: dict, what: str) -> None:
        """Carry out a recovery plan (`_plan_json`): the exchange with peers, then the copies
        from the shared tier that fall to this node."""
        sends = {tuple(int(x) for x in pair.split(",")): d for pair, d in plan["sends"].items()}
        self._transfer(sends, sizes, self._local_bytes, what)
        for digest in plan["from_shared"].get(str(self.member), ()):
            copy_object(self.repo.stores[1:], self.store, object_key(digest), parallel_map)


def _plan_json(plan) -> dict:
    """A RecoveryPlan as a broadcastable dict (string keys)."""
    return {"sends": {f"{s},{t}": d for (s, t), d in plan.sends.items()},
            "from_shared": {str(t): d for t, d in plan.from_shared.items()}}
