"""Two writers: different branches both succeed; on one branch no version is lost."""

import os
import subprocess
import sys

import numpy as np
import pytest

import forkpoint as fp
from conftest import race_before_publish
from forkpoint.errors import ConflictError

HERE = os.path.dirname(__file__)
N = 25


def _run_two(url, branches):
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "concurrent_saver.py"),
                               url, b, f"w{i}", str(N)]) for i, b in enumerate(branches)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]


def test_two_processes_different_branches(tmp_path):
    url = str(tmp_path / "r")
    fp.Repo(url, create=True).close()
    _run_two(url, ["a", "b"])
    repo = fp.Repo(url)
    for b in ("a", "b"):
        log = repo.log(b)
        assert [v.step for v in log] == list(range(N - 1, -1, -1))
    assert repo.verify().ok


def test_two_processes_same_branch_lose_nothing(tmp_path):
    url = str(tmp_path / "r")
    fp.Repo(url, create=True).close()
    _run_two(url, ["main", "main"])
    repo = fp.Repo(url)
    log = repo.log("main")
    assert len(log) == 2 * N, "every save is on the branch, none overwritten"
    seen = sorted((v.meta["writer"], v.step) for v in log)
    assert seen == sorted((w, i) for w in ("w0", "w1") for i in range(N))
    for v in log:
        out = repo.load(v.id)
        assert out["writer"] == v.meta["writer"] and np.all(out["w"] == v.step)
    assert repo.gc(grace=0).deleted_manifests >= 0 and len(repo.log("main")) == 2 * N


def test_conflict_error_mode_keeps_the_version(tmp_path):
    url = str(tmp_path / "r")
    a = fp.Repo(url, create=True, on_conflict="error")
    b = fp.Repo(url)
    a.save({"x": 0}, step=0)
    race_before_publish(a, lambda: b.save({"x": "from b"}, step=1))
    with pytest.raises(ConflictError, match=r"moved while saving; version (\w+) is stored") as e:
        a.save({"x": "from a"}, step=1)
    vid = str(e.value).split("version ")[1].split(" ")[0]
    assert fp.Repo(url).load(vid)["x"] == "from a"
    assert fp.Repo(url).load("main")["x"] == "from b"
    fp.Repo(url).fork(vid, "kept")
    assert fp.Repo(url).load("kept")["x"] == "from a"
