"""Replicas of node-local tiers, as pure decisions: which node copies which objects to which
peer, what a node must hold of a replicated version, and where a lost node's objects come
back from. No I/O; dist/replication.py moves the bytes.

Nodes form a ring in the order of their first rank: node i's objects go to nodes i+1 ... i+k
(mod the number of nodes), so no copy is ever on its own node and losing k adjacent nodes
still leaves one copy of every object.
"""

import json
from dataclasses import dataclass, field

RECORD_PREFIX = "replicas"


def record_key(vid: str) -> str:
    """The storage key of version `vid`'s replica record on a node-local tier."""
    return f"{RECORD_PREFIX}/{vid}.json"


def ring_peers(node: int, nodes: int, replicas: int) -> list[int]:
    """The nodes that hold copies of `node`'s objects: the next `replicas` on the ring."""
    return [(node + j) % nodes for j in range(1, replicas + 1)]


@dataclass
class ReplicationPlan:
    """What one replication moves: `sends[(source node, target node)]` = digests (sorted),
    `own[node]` = the digests the node held before (its ranks' part), `holds[node]` = every
    digest it holds once it is done, and `short` = why the version will not have replicas+1
    copies of every object (empty when it will)."""

    sends: dict = field(default_factory=dict)
    own: list = field(default_factory=list)
    holds: list = field(default_factory=list)
    short: list = field(default_factory=list)


def plan_replication(held: list[dict[str, int]], replicas: int, used: list[int],
                     budget: int | None) -> ReplicationPlan:
    """The copies that give every object `held` (per node: digest -> stored bytes) replicas+1
    copies on distinct nodes; a target whose tier would pass `budget` bytes (it holds `used`
    now) receives nothing and the plan says so."""
    n = len(held)
    plan = ReplicationPlan(own=[sorted(h) for h in held], holds=[set(h) for h in held])
    if replicas >= n:
        plan.short.append(f"replicas={replicas} needs at least {replicas + 1} nodes, the job has {n}")
        plan.holds = [sorted(h) for h in plan.holds]
        return plan
    incoming: list[dict] = [{} for _ in range(n)]
    for source in range(n):
        for target in ring_peers(source, n, replicas):
            for digest, size in held[source].items():
                if digest not in plan.holds[target] and digest not in incoming[target]:
                    incoming[target][digest] = (source, size)
    for target, objects in enumerate(incoming):
        total = used[target] + sum(size for _, size in objects.values())
        if budget is not None and total > budget:
            plan.short.append(f"node {target} would hold {total} bytes, over its budget of {budget}")
            continue
        for digest, (source, _) in objects.items():
            plan.sends.setdefault((source, target), []).append(digest)
            plan.holds[target].add(digest)
    for pair in plan.sends:
        plan.sends[pair].sort()
    plan.holds = [sorted(h) for h in plan.holds]
    return plan


def batches(digests: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """`digests` in order, cut into runs of at most `max_bytes` (an object larger than that
    is a run of its own): the rounds of one transfer, so a receiver never buffers more."""
    out, run, total = [], [], 0
    for d in digests:
        if run and total + sizes[d] > max_bytes:
            out.append(run)
            run, total = [], 0
        run.append(d)
        total += sizes[d]
    if run:
        out.append(run)
    return out


@dataclass
class ReplicaRecord:
    """A version whose every object had replicas+1 copies: what each node's ranks wrote of
    it (`own`, what its restore reads) and what each node holds of it (`holds`)."""

    vid: str
    replicas: int
    own: list
    holds: list

    def to_bytes(self) -> bytes:
        return json.dumps({"version": self.vid, "replicas": self.replicas, "own": self.own,
                           "holds": self.holds}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str, nodes: int) -> "ReplicaRecord":
        """Parse a stored record, refusing one that does not describe `nodes` nodes of digests."""
        try:
            d = json.loads(data)
            lists = (d["own"], d["holds"])
            ok = (isinstance(d["version"], str) and isinstance(d["replicas"], int)
                  and all(isinstance(x, list) for x in lists)
                  and all(isinstance(h, list) and all(isinstance(x, str) and len(x) == 64 for x in h)
                          for x in lists for h in x))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"{where} is not a replica record: corrupted")
        if len(d["holds"]) != nodes or len(d["own"]) != nodes:
            raise ValueError(f"{where} describes {len(d['holds'])} nodes, this job has {nodes}")
        return cls(d["version"], d["replicas"], d["own"], d["holds"])


@dataclass
class RecoveryPlan:
    """How the nodes get back what a version needs: `sends[(source, target)]` digests from a
    surviving peer, `from_shared[target]` digests no peer holds (read from the shared tier),
    and `missing` those neither has."""

    sends: dict = field(default_factory=dict)
    from_shared: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)


def delivered(plan: RecoveryPlan, present: list[set]) -> list[set]:
    """What each node holds once `plan` is carried out (`present`: before it)."""
    after = [set(p) for p in present]
    for (_, target), digests in plan.sends.items():
        after[target].update(digests)
    for target, digests in plan.from_shared.items():
        after[target].update(digests)
    return after


def plan_recovery(needed: list[set], present: list[set], on_shared) -> RecoveryPlan:
    """For each node, the digests of `needed` it lacks (`present`: what it holds now), each
    from the surviving peer that holds it and sends least so far, else from the shared tier
    (`on_shared(digest)`), else listed as missing."""
    plan = RecoveryPlan()
    load = [0] * len(present)
    for target, wanted in enumerate(needed):
        for digest in sorted(wanted - present[target]):
            sources = [s for s, held in enumerate(present) if s != target and digest in held]
            if sources:
                source = min(sources, key=lambda s: (load[s], s))
                load[source] += 1
                plan.sends.setdefault((source, target), []).append(digest)
            elif on_shared(digest):
                plan.from_shared.setdefault(target, []).append(digest)
            else:
                plan.missing.append(digest)
    return plan
