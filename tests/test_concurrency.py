"""Two writers: different branches both succeed; on one branch no version is lost."""

import os
import subprocess
import sys

import numpy as np
import pytest

import forkpoint as fp
import procs as procs_
from conftest import race_before_publish
from forkpoint.errors import ConflictError

HERE = os.path.dirname(__file__)
N = 25


def _run_two(url, branches):
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "concurrent_saver.py"),
                               url, b, f"w{i}", str(N)]) for i, b in enumerate(branches)]
    assert [p.wait(timeout=procs_.CHILD_SECONDS) for p in procs] == [0, 0]


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


def test_ref_records_stay_bounded_and_a_stale_writer_never_publishes_over_dropped_ones(tmp_path):
    """Old ref records are dropped as saves publish new ones; a writer whose read of the head
    predates that (its seq was dropped and is free again) must rebase, not land below the head."""
    from forkpoint.repo.refs import REF_RECORDS_KEPT

    url = str(tmp_path / "r")
    a, b = fp.Repo(url, create=True), fp.Repo(url)
    a.save({"who": "a"}, step=0)

    def many_saves_then_gc():
        for i in range(3 * REF_RECORDS_KEPT):
            b.save({"who": f"b{i}"}, step=1 + i)
        b.gc(grace=0)

    race_before_publish(a, many_saves_then_gc)
    late = a.save({"who": "a, late"}, step=100)
    repo = fp.Repo(url)
    assert repo.head("main") == late.id and repo.load("main")["who"] == "a, late"
    assert len(repo.log("main")) == 2 + 3 * REF_RECORDS_KEPT, "no save lost from the branch"
    records = os.listdir(tmp_path / "r" / "refs" / "heads" / "main")
    assert len(records) <= 2 * REF_RECORDS_KEPT
    for i in range(3 * REF_RECORDS_KEPT):
        repo.tag("moving", "main~1" if i % 2 else "main", force=True)
    assert len(os.listdir(tmp_path / "r" / "refs" / "tags" / "moving")) <= 2 * REF_RECORDS_KEPT
    assert repo.version("moving").id == repo.version("main~1").id


def test_temporary_names_differ_in_a_forked_child_and_across_threads():
    """Temporary object files are named by run id, process id and a counter: a forked child
    (which shares the parent's run id and counter) and threads never draw the same name."""
    import threading

    from forkpoint.storage.local import _temp_name

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, "\n".join(_temp_name() for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    assert os.waitpid(pid, 0)[1] == 0
    with os.fdopen(read) as f:
        child = set(f.read().split("\n"))
    names, lock = [], threading.Lock()

    def draw():
        mine = [_temp_name() for _ in range(1000)]
        with lock:
            names.extend(mine)

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(child) == 100 and len(set(names)) == 4000 and not child & set(names)
