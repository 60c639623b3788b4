"""The pure decisions of replication (tiers/replication.py): who sends what to whom, budgets,
recovery sources, and hostile replica records."""

import pytest

import forkpoint as fp
from forkpoint.tiers.replication import (ReplicaRecord, batches, delivered, plan_recovery, plan_replication,
                                         ring_peers)

A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)


def test_each_node_sends_to_the_next_k_on_the_ring_and_never_to_itself():
    assert ring_peers(3, 4, 1) == [0] and ring_peers(1, 4, 2) == [2, 3]
    held = [{A: 10, D: 1}, {B: 20, D: 1}, {C: 30, D: 1}]
    plan = plan_replication(held, 1, [0, 0, 0], None)
    assert plan.sends == {(0, 1): [A], (1, 2): [B], (2, 0): [C]}, "D is on every node already: not sent"
    assert plan.holds == [sorted([A, C, D]), sorted([A, B, D]), sorted([B, C, D])] and plan.short == []
    assert plan.own == [sorted([A, D]), sorted([B, D]), sorted([C, D])], "what each node's ranks wrote"
    two = plan_replication(held, 2, [0, 0, 0], None)
    copies = {o: sum(o in h for h in two.holds) for o in (A, B, C)}
    assert copies == {A: 3, B: 3, C: 3}


def test_an_object_two_sources_would_send_goes_to_a_target_once():
    plan = plan_replication([{A: 5}, {A: 5}, {}], 2, [0, 0, 0], None)
    assert plan.sends == {(0, 2): [A]}, "node 1 holds A; node 2 gets it from one source"


def test_a_target_over_its_budget_receives_nothing_and_the_plan_says_why():
    plan = plan_replication([{A: 100}, {B: 10}], 1, [50, 0], budget=120)
    assert plan.sends == {(0, 1): [A], (1, 0): [B]} and plan.short == [], "0 + 100 and 50 + 10 fit in 120"
    plan = plan_replication([{A: 100}, {B: 10}], 1, [50, 30], budget=120)
    assert plan.sends == {(1, 0): [B]} and plan.short == ["node 1 would hold 130 bytes, over its budget of 120"]
    assert plan_replication([{A: 1}], 1, [0], None).short == ["replicas=1 needs at least 2 nodes, the job has 1"]


def test_transfers_go_in_rounds_of_bounded_bytes():
    sizes = {A: 60, B: 60, C: 200, D: 1}
    assert batches([A, B, C, D], sizes, 128) == [[A, B], [C], [D]]
    assert batches([], sizes, 128) == []


def test_recovery_takes_each_object_from_a_surviving_peer_else_from_the_shared_tier():
    needed = [{A, B}, {B, C}, {C, D}]
    present = [{A, B}, set(), {C}]
    plan = plan_recovery(needed, present, on_shared=lambda d: d == D)
    assert plan.sends == {(0, 1): [B], (2, 1): [C]} and plan.from_shared == {2: [D]} and plan.missing == []
    assert plan_recovery([{A}], [set()], on_shared=lambda d: False).missing == [A]
    assert delivered(plan, present) == [{A, B}, {B, C}, {C, D}]


@pytest.mark.parametrize("data, match", [
    (b"not json", "not a replica record"),
    (b'{"version": "v", "replicas": 1, "own": [[], []], "holds": [["../../etc/passwd"], []]}',
     "not a replica record"),
    (b'{"version": "v", "replicas": 1, "own": [[], []], "holds": "x"}', "not a replica record"),
    (b'{"version": "v", "replicas": 1, "holds": [[], []]}', "not a replica record"),
    (b'{"version": "v", "replicas": 1, "own": [[]], "holds": [[]]}', "describes 1 nodes, this job has 2"),
])
def test_a_damaged_or_crafted_replica_record_is_refused(data, match):
    with pytest.raises(ValueError, match=match):
        ReplicaRecord.from_bytes(data, "replicas/v.json", nodes=2)
    record = ReplicaRecord("v", 1, [[A], [B]], [[A, B], [A, B]])
    assert ReplicaRecord.from_bytes(record.to_bytes(), "r", 2) == record


def test_replicas_need_a_node_local_tier_and_sane_numbers():
    with pytest.raises(ValueError, match="node-local tier that outlives the processes"):
        fp.tier("mem://fast", keep=2, replicas=1)
    with pytest.raises(ValueError, match="replicas must be an int >= 0"):
        fp.tier("/dev/shm/x", local=True, replicas=-1)
    assert fp.tier("/dev/shm/x", keep=2, local=True, replicas=1, budget=1 << 30).replicas == 1


def test_replicas_are_refused_below_tier_0_and_without_a_distributed_repository(tmp_path):
    with pytest.raises(ValueError, match="only tier 0 can keep replicas"):
        fp.Repo(tiers=[str(tmp_path / "a"), fp.tier(str(tmp_path / "b"), local=True, replicas=1)], create=True)
    with pytest.raises(ValueError, match="needs fp.dist.Repo"):
        fp.Repo(tiers=[fp.tier(str(tmp_path / "c"), keep=2, local=True, replicas=1), str(tmp_path / "d")],
                create=True)
