"""Replicated node-local tiers in real multi-process gloo groups: four simulated nodes (one rank
and one tier-0 directory each); losing a node wipes its directory. Restores must be bit-exact
and, where peers hold everything, must not read the shared tier."""

import glob
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

import forkpoint as fp  # noqa: E402
from forkpoint.format.objects import object_key  # noqa: E402
from forkpoint.tiers.replication import record_key  # noqa: E402
from test_dist import launch, rerun_once_if_hung  # noqa: E402

pytestmark = pytest.mark.ranks


def copies(nodes: str, digest: str) -> int:
    """On how many nodes' tier 0 the object `digest` is."""
    return sum(os.path.exists(os.path.join(d, object_key(digest))) for d in glob.glob(f"{nodes}/node*"))


@rerun_once_if_hung
def test_losing_nodes_recovers_from_peer_memory_then_from_the_shared_tier(tmp_path):
    nodes, shared = str(tmp_path / "nodes"), str(tmp_path / "shared")
    records = launch("replicated_saves", 4, tmp_path / "save", nodes, shared)
    ids = records[0]["result"]["ids"]
    assert [rec["result"]["replicated"] for rec in records] == [[True] * 3] * 4
    newest = fp.Repo(shared).manifest(ids[2])
    assert all(copies(nodes, o) >= 2 for o in newest.objects()), "every object on two nodes at least"
    record = json.loads(open(f"{nodes}/node1/{record_key(ids[2])}").read())
    assert record["replicas"] == 1 and len(record["holds"]) == 4
    assert not os.path.exists(f"{nodes}/node1/{record_key(ids[0])}"), "evicted with its version (keep=2)"
    references = str(tmp_path / "save" / "references.pt")

    shutil.rmtree(f"{nodes}/node1")
    records = launch("replicated_restore", 4, tmp_path / "lost1", nodes, shared, references)
    for r, rec in enumerate(records):
        result = rec["result"]
        assert result["version"] == ids[2] and result["matches"] == [2], result
        assert result["note"] == [r, 2]
        assert result["shared_reads"] == 0, "every object came from a peer's memory"
        assert result["replicated"], "the replacement node is seeded again: the next loss is covered"
    recovery = records[0]["result"]["recovery"]
    assert recovery["from_peers"] > 0 and recovery["from_shared"] == 0 and recovery["reason"] == ""
    assert recovery["reseeded"] > 0, "node 1's replicas of node 0 came back after the restore"
    assert all(copies(nodes, o) >= 2 for o in newest.objects())

    shutil.rmtree(f"{nodes}/node1")
    shutil.rmtree(f"{nodes}/node2")
    records = launch("replicated_restore", 4, tmp_path / "lost2", nodes, shared, references)
    for r, rec in enumerate(records):
        result = rec["result"]
        assert result["version"] == ids[2] and result["matches"] == [2], result
        assert result["replicated"]
    assert [rec["result"]["shared_reads"] > 0 for rec in records] == [False, True, False, False], \
        "only node 1's own part was on no survivor; node 2's came from node 3, its replicas from node 1"
    reason = records[0]["result"]["recovery"]["reason"]
    assert "node(s) [1, 2] lost their tier 0, replicas=1" in reason and shared in reason, reason
    recovery = records[0]["result"]["recovery"]
    assert recovery["from_peers"] > 0 and recovery["from_shared"] > 0


@rerun_once_if_hung
def test_a_node_killed_during_replication_leaves_no_version_marked_that_is_not(tmp_path):
    nodes, shared = str(tmp_path / "nodes"), str(tmp_path / "shared")
    records = launch("replicated_saves", 4, tmp_path / "save", nodes, shared, 3, None, 2)
    assert records[2] is None, "rank 2 was killed"
    ids = records[0]["result"]["ids"]
    for r in (0, 1, 3):
        assert records[r]["result"]["replicated"] == [True, True, False]
    assert not glob.glob(f"{nodes}/node*/{record_key(ids[2])}"), "no node marks the interrupted version"
    for marked in glob.glob(f"{nodes}/node*/{record_key(ids[1])}"):
        holds = json.loads(open(marked).read())["holds"]
        assert all(os.path.exists(f"{nodes}/node{n}/{object_key(o)}") for n, h in enumerate(holds) for o in h)
    version = fp.Repo(f"{nodes}/node0").manifest(ids[1])
    assert all(copies(nodes, o) >= 2 for o in version.objects()), "a marked version has its copies"

    shutil.rmtree(f"{nodes}/node2")
    references = str(tmp_path / "save" / "references.pt")
    records = launch("replicated_restore", 4, tmp_path / "restart", nodes, shared, references, True)
    for rec in records:
        result = rec["result"]
        assert result["version"] == ids[1] and result["matches"] == [1], result
        assert result["shared_reads"] == 0 and result["replicated"], \
            "Checkpointer.resume rebuilds the newest version peers can give back"


@rerun_once_if_hung
def test_a_node_killed_after_flushing_its_part_gives_back_the_newest_version_from_the_shared_tier(tmp_path):
    """The killed node's part of the last version reached the shared tier before the kill, so
    recovery rebuilds that version, unreplicated, reading only the lost node's part from below."""
    nodes, shared = str(tmp_path / "nodes"), str(tmp_path / "shared")
    records = launch("replicated_saves", 4, tmp_path / "save", nodes, shared, 3, None, 2, 1, True)
    assert records[2] is None, "rank 2 was killed"
    ids = records[0]["result"]["ids"]
    assert not glob.glob(f"{nodes}/node*/{record_key(ids[2])}"), "no node marks the interrupted version"

    shutil.rmtree(f"{nodes}/node2")
    references = str(tmp_path / "save" / "references.pt")
    records = launch("replicated_restore", 4, tmp_path / "restart", nodes, shared, references, True)
    for rec in records:
        result = rec["result"]
        assert result["version"] == ids[2] and result["matches"] == [2], result
    assert [rec["result"]["shared_reads"] > 0 for rec in records] == [False, False, True, False]
    reason = records[0]["result"]["recovery"]["reason"]
    assert "node(s) [2] lost their tier 0, and the version was never fully replicated" in reason, reason


@rerun_once_if_hung
def test_a_node_over_its_budget_takes_no_replicas_and_a_loss_then_reads_the_shared_tier(tmp_path):
    nodes, shared = str(tmp_path / "nodes"), str(tmp_path / "shared")
    records = launch("replicated_saves", 4, tmp_path / "save", nodes, shared, 2, 4096)
    ids = records[0]["result"]["ids"]
    assert [rec["result"]["replicated"] for rec in records] == [[False, False]] * 4
    newest = fp.Repo(shared).manifest(ids[1])
    sharded = {o for leaf in newest.leaves if leaf.path == "fsdp/model/0.weight" for c in leaf.chunks for o in c.objects}
    assert sharded and all(copies(nodes, o) == 1 for o in sharded), "no node took a replica over its budget"

    shutil.rmtree(f"{nodes}/node1")
    references = str(tmp_path / "save" / "references.pt")
    records = launch("replicated_restore", 4, tmp_path / "lost", nodes, shared, references)
    assert all(rec["result"]["version"] == ids[1] and rec["result"]["matches"] == [1] for rec in records)
    assert [rec["result"]["shared_reads"] > 0 for rec in records] == [False, True, False, False]
    reason = records[0]["result"]["recovery"]["reason"]
    assert "node(s) [1] lost their tier 0, and the version was never fully replicated" in reason, reason


@rerun_once_if_hung
def test_nodes_of_two_ranks_replicate_through_their_first_rank(tmp_path):
    nodes, shared = str(tmp_path / "nodes"), str(tmp_path / "shared")
    records = launch("replicated_saves", 4, tmp_path / "save", nodes, shared, 2, None, -1, 2)
    ids = records[0]["result"]["ids"]
    assert [rec["result"]["replicated"] for rec in records] == [[True, True]] * 4
    assert sorted(os.listdir(nodes)) == ["node0", "node1"]
    newest = fp.Repo(shared).manifest(ids[1])
    assert all(copies(nodes, o) == 2 for o in newest.objects()), "each node holds the whole version"
    shutil.rmtree(f"{nodes}/node0")
    references = str(tmp_path / "save" / "references.pt")
    records = launch("replicated_restore", 4, tmp_path / "lost", nodes, shared, references, False, 2)
    for r, rec in enumerate(records):
        result = rec["result"]
        assert result["version"] == ids[1] and result["matches"] == [1] and result["note"] == [r, 1], result
        assert result["shared_reads"] == 0 and result["replicated"]
