"""Bit-identical resume: stop, restore in a fresh process, continue = uninterrupted run."""

import json
import subprocess
import sys

import pytest
import torch

import forkpoint as fp


def _train(repo, log, steps, every=5, extra=()):
    subprocess.run([sys.executable, "-m", "forkpoint.cli.demo", "train", "--repo", repo, "--log", log,
                    "--steps", str(steps), "--every", str(every), *extra], check=True, timeout=300)


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    _train(ref, str(tmp_path / "ref.jsonl"), 41)
    _train(cut, str(tmp_path / "cut.jsonl"), 23)
    assert fp.Repo(cut).version("main").step == 20
    _train(cut, str(tmp_path / "cut.jsonl"), 41)
    a, b = fp.Repo(ref), fp.Repo(cut)
    assert a.version("main").step == b.version("main").step == 40
    ta, tb = a.load("main"), b.load("main")
    for part in ("model", "optim", "sched", "rng", "data"):
        flat_a = {leaf.path: leaf.digest for leaf in a.manifest("main").leaves if leaf.path.startswith(part)}
        flat_b = {leaf.path: leaf.digest for leaf in b.manifest("main").leaves if leaf.path.startswith(part)}
        assert flat_a == flat_b, part
    assert ta["sched"] == tb["sched"] and ta["data"] == tb["data"]
    for k in ta["model"]:
        assert torch.equal(ta["model"][k], tb["model"][k])
    la, lb = _losses(str(tmp_path / "ref.jsonl")), _losses(str(tmp_path / "cut.jsonl"))
    assert la == lb and len(la) == 41


def test_checkpointer_async_and_time_policy(repo):
    model = torch.nn.Linear(64, 64)
    ck = fp.Checkpointer(repo, {"model": model}, every=3)
    pending = [ck.step(s) for s in range(7)]
    assert [p is not None for p in pending] == [True, False, False, True, False, False, True]
    ck.wait_capture()
    with torch.no_grad():
        model.weight.zero_()
    last = ck.close() or ck.last_version
    assert [v.step for v in repo.log()] == [6, 3, 0]
    assert not torch.equal(repo.load()["model"]["weight"], model.weight), "captured before the mutation"
    ck2 = fp.Checkpointer(repo, {"model": model}, every=fp.Seconds(3600), branch="timed")
    assert ck2.step(0) is None
    ck2._last_save -= 3601
    assert ck2.step(1) is not None
    ck2.close()
    assert repo.version("timed").step == 1
    assert last is not None
    with pytest.raises(RuntimeError, match="Checkpointer of branch 'timed' is closed"):
        ck2.step(3)
    with pytest.raises(RuntimeError, match="is closed"):
        ck2.save(4)
    ck2.close()
    assert repo.version("timed").step == 1, "nothing saved after close"


def test_resume_on_empty_branch_starts_at_zero(repo):
    ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=1)
    assert ck.resume() == 0
    ck.step(0)
    ck.close()
    assert fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=1).resume() == 1
