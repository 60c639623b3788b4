"""libforkpoint's collective save under mpiexec: every rank writes its blocks and rank 0
commits one version; a failure on any rank fails the commit on all of them with one message;
the C heat example checkpoints on 4 ranks, restarts on 2 and ends bit-identical to an
uninterrupted run."""

import os
import shutil
import sys

import numpy as np
import pytest

import forkpoint as fp
from helpers.cbuild import MPICC, make as cbuild_make
import procs

pytestmark = [pytest.mark.timeout(300), pytest.mark.ranks]
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


@pytest.fixture(scope="module")
def mpibuild():
    return cbuild_make("mpi", "mpicc (pip install mpich), a C compiler and libzstd-dev", MPICC=MPICC)


def mpiexec(n, *args):
    assert MPIEXEC, "mpiexec not found: pip install mpich (the test extra has it)"
    done = procs.run([MPIEXEC, "-n", str(n), *map(str, args)], timeout=procs.CHILD_SECONDS)
    assert done.returncode == 0, f"mpiexec -n {n} {args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def ranks_report(out):
    """{rank: (status, id or message)} from test_mpi's lines."""
    lines = [line.split(" ", 2) for line in out.splitlines() if line[:1].isdigit()]
    return {int(r): (int(st), rest) for r, st, rest in lines}


def test_collective_save_commits_every_ranks_blocks_once(mpibuild, tmp_path):
    repo = tmp_path / "repo"
    report = ranks_report(mpiexec(4, os.path.join(mpibuild, "test_mpi"), "ok", repo))
    assert sorted(report) == [0, 1, 2, 3] and {st for st, _ in report.values()} == {0}
    ids = {rest for _, rest in report.values()}
    assert len(ids) == 1, "every rank gets the one version's id"
    r = fp.Repo(str(repo))
    (version,) = r.log("main")
    assert version.id == ids.pop() and version.step == 10 and version.message == "collective"  # rank 0's
    state = r.load("main")
    rows = np.arange(12)[:, None] * 100 + np.arange(4)
    assert state["a"].dtype == np.int32 and np.array_equal(state["a"], rows)
    assert np.array_equal(state["w"], [0, 0]), "a whole array is stored once, from rank 0"
    assert r.verify().problems == []
    r.close()


@pytest.mark.parametrize("mode, status, words", [
    ("gap", 1, "rank 0 of 4: the blocks put under 'a' do not cover its global shape"),
    ("badput", 1, "rank 1 of 4: 'a': the block [12, 15) of dimension 0 does not fit the global size 12"),
    ("branch", 1, "rank 1 of 4: began a collective save on branch 'elsewhere', and rank 0 on 'main'"),
    ("conflict", 7, "rank 0 of 4: branch 'main' moved since this save began"),
])
def test_a_failure_on_one_rank_fails_the_commit_on_every_rank(mpibuild, tmp_path, mode, status, words):
    repo = tmp_path / "repo"
    report = ranks_report(mpiexec(4, os.path.join(mpibuild, "test_mpi"), mode, repo))
    assert sorted(report) == [0, 1, 2, 3]
    assert {st for st, _ in report.values()} == {status}
    messages = {rest for _, rest in report.values()}
    assert len(messages) == 1 and words in messages.pop()
    r = fp.Repo(str(repo))
    # nothing of the collective save was committed (conflict: only the other writer's version)
    if mode == "conflict":
        assert [sorted(r.load(v.id)) for v in r.log("main")] == [["x"]]
    else:
        assert not r.branches() and not list((repo / "versions").glob("*.json"))
    r.close()


def test_heat_checkpoints_on_4_ranks_restarts_on_2_and_ends_as_the_uninterrupted_run(mpibuild, tmp_path):
    heat, repo = os.path.join(mpibuild, "heat_mpi"), tmp_path / "heat"
    common = ["--n", 90, "--steps", 300, "--every", 100]
    out = mpiexec(4, heat, repo, *common, "--stop-at", 150)  # 2 x 2 blocks; preempted after step 150
    assert "stopped at step 150" in out
    out = mpiexec(2, heat, repo, *common)  # 2 x 1 blocks read from the 2 x 2 checkpoint
    assert "at step 100 on 2 ranks" in out
    mpiexec(4, heat, repo, *common, "--branch", "straight")
    r = fp.Repo(str(repo))
    resumed, straight = r.load("main"), r.load("straight")
    assert int(resumed["step"]) == int(straight["step"]) == 300
    assert resumed["u"].shape == (90, 90) and np.array_equal(resumed["u"], straight["u"])
    assert 0 < resumed["u"].max() < 1.2 and resumed["u"][0].max() < resumed["u"].max()
    assert [v.message for v in r.log("main")] == [
        "heat step 300 on 2 ranks", "heat step 200 on 2 ranks", "heat step 100 on 4 ranks"]
    # the field at step 100 is what a run that stopped there holds, so the restart read real data
    assert not np.array_equal(r.load("main~2")["u"], resumed["u"])
    assert r.verify().problems == []
    r.close()
