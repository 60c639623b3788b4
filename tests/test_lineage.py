"""Versions and lineage: refs, log, fork, tag, diff, first_divergence, format checks."""

import json
import os

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.errors import FormatError, RefNotFoundError, RepoNotFoundError


def test_missing_repository_is_a_clear_error(tmp_path):
    with pytest.raises(RepoNotFoundError, match="no forkpoint repository at .*create=True"):
        fp.Repo(str(tmp_path / "nope"))


def test_save_records_and_refs(repo):
    ids = []
    for step in range(4):
        v = repo.save({"w": torch.full((3,), float(step))}, step=step, message=f"s{step}",
                      metrics={"loss": 1.0 / (step + 1)}, meta={"cfg": {"lr": 0.1}})
        ids.append(v.id)
    v = repo.version("main")
    assert v.id == ids[-1] and v.parents == [ids[-2]] and v.step == 3 and v.message == "s3"
    assert v.metrics == {"loss": 0.25} and v.meta == {"cfg": {"lr": 0.1}}
    assert v.env["world_size"] == 1 and "torch" in v.env and v.logical_bytes == 12
    assert repo.resolve("main~2") == ids[1] and repo.resolve("main~~") == ids[1]
    assert repo.resolve(ids[0][:8]) == ids[0]
    assert [x.id for x in repo.log("main")] == ids[::-1]
    assert [x.id for x in repo.log("main", limit=2)] == ids[:1:-1]
    with pytest.raises(RefNotFoundError, match=f"'main~4' goes 4 versions back, but the history ends 3 back: "
                                               f"main~3 \\({ids[0]}\\) is its first version"):
        repo.resolve("main~4")
    with pytest.raises(RefNotFoundError, match="no branch, tag or version 'nosuch'"):
        repo.load("nosuch")
    assert torch.equal(repo.load("main~3")["w"], torch.zeros(3))


def test_fork_and_tag(repo):
    for step in range(3):
        repo.save({"w": torch.full((2,), float(step))}, step=step)
    base = repo.fork("main~1", "lr-sweep")
    assert base.step == 1
    v = repo.save({"w": torch.full((2,), 9.0)}, branch="lr-sweep", step=2)
    assert v.parents == [base.id]
    assert set(repo.branches()) == {"main", "lr-sweep"}
    assert [x.step for x in repo.log("lr-sweep")] == [2, 1, 0]
    with pytest.raises(ValueError, match="already exists"):
        repo.fork("main", "lr-sweep")
    repo.tag("best", "main~2")
    assert repo.version("best").step == 0
    with pytest.raises(ValueError, match="already exists"):
        repo.tag("best", "main")
    repo.tag("best", "main", force=True)
    assert repo.version("best").step == 2
    repo.delete_tag("best")
    assert "best" not in repo.tags()
    with pytest.raises(ValueError, match="invalid branch name"):
        repo.save({}, branch="bad/name")


def test_a_branch_and_a_tag_never_share_a_name(repo):
    """A name read as a ref must keep meaning what it meant: a tag named like a branch, or a
    branch (by fork, by a save, by a Checkpointer) named like a tag, is refused, and nothing
    is written."""
    repo.save({"w": torch.zeros(2)}, step=0)
    repo.tag("best", "main")
    with pytest.raises(ValueError, match="'main' is a branch .* Use another tag name"):
        repo.tag("main", "main")
    for create in (lambda: repo.fork("main", "best"),
                   lambda: repo.save({"w": torch.ones(2)}, branch="best"),
                   lambda: repo.save({"w": torch.ones(2)}, branch="best", sync=False).wait(),
                   lambda: fp.Checkpointer(repo, {"w": torch.ones(2)}, branch="best")):
        with pytest.raises(ValueError, match="'best' is a tag .* would shadow it"):
            create()
    assert set(repo.branches()) == {"main"} and set(repo.tags()) == {"best"}
    assert len(repo.version_ids()) == 1
    assert torch.equal(repo.load("best")["w"], torch.zeros(2))
    repo.delete_tag("best")
    repo.save({"w": torch.ones(2)}, branch="best")
    assert torch.equal(repo.load("best")["w"], torch.ones(2))


def test_diff_uses_hash_fast_path_and_reports_numbers(repo, monkeypatch):
    a = {"w": torch.ones(4, 4), "frozen": torch.arange(1000.0), "lr": 0.1, "gone": 1}
    va = repo.save(a)
    b = {"w": torch.ones(4, 4) * 1.5, "frozen": torch.arange(1000.0), "lr": 0.2, "new": torch.zeros(2)}
    vb = repo.save(b)
    reads = []
    import forkpoint.repo.reading as repo_mod

    real = repo_mod.read_leaves
    monkeypatch.setattr(repo_mod, "read_leaves",
                        lambda store, reqs, *a, **k: (reads.extend(r.leaf.path for r in reqs), real(store, reqs, *a, **k)))
    d = {x.path: x for x in repo.diff(va.id, vb.id)}
    assert d["frozen"].status == "same" and "frozen" not in reads
    assert d["w"].status == "changed" and d["w"].max_abs == pytest.approx(0.5)
    assert d["w"].rel_l2 == pytest.approx(0.5)
    assert d["lr"].status == "changed" and d["lr"].max_abs == pytest.approx(0.1)
    assert d["gone"].status == "removed" and d["new"].status == "added"


def test_first_divergence(repo):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(100)
    for step in range(10):
        repo.save({"w": w.copy()}, step=step)
        if step == 3:
            repo.fork("main", "b")
        w = w * 0.9
    w_b = repo.load("b")["w"]
    for step in range(4, 10):
        if step >= 7:
            w_b = w_b + 1e-3
        elif step >= 5:
            w_b = w_b + 1e-9
        w_b = w_b * 0.9 if step > 4 else w_b * 0.9
        repo.save({"w": w_b.copy()}, branch="b", step=step)
    assert repo.first_divergence("main", "main") is None
    exact = repo.first_divergence("main", "b")
    assert exact.step == 5
    loose = repo.first_divergence("main", "b", atol=1e-6)
    assert loose.step == 7 and loose.paths == ["w"] and loose.max_abs > 1e-4


def test_newer_major_format_is_refused(repo):
    v = repo.save({"x": 1})
    path = os.path.join(repo.url, "versions", f"{v.id}.json")
    record = json.load(open(path))
    record["format_version"] = [2, 0]
    with open(path, "w") as f:
        json.dump(record, f)
    fresh = fp.Repo(repo.url)
    with pytest.raises(FormatError, match="format 2.0, newer than this forkpoint reads"):
        fresh.load("main")
    marker = os.path.join(repo.url, "forkpoint.json")
    rec = json.load(open(marker))
    rec["format_version"] = [3, 1]
    json.dump(rec, open(marker, "w"))
    with pytest.raises(FormatError, match="upgrade forkpoint"):
        fp.Repo(repo.url)


def test_truncated_manifest_is_a_clear_error(repo):
    v = repo.save({"x": torch.ones(2)})
    path = os.path.join(repo.url, "versions", f"{v.id}.json")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(FormatError, match="not valid JSON.*truncated"):
        fp.Repo(repo.url).load("main")
