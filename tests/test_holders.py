"""One live run per branch: a second one is refused, forks, or takes over a dead holder."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

import forkpoint as fp
from forkpoint.errors import BranchHeldError
from forkpoint.repo.holders import HOLD_EXPIRY, boot_id, start_ticks
import procs

HERE = os.path.dirname(__file__)


@pytest.fixture
def holder(tmp_path):
    """A live process holding branch main of a repository; killed at the end."""
    url = str(tmp_path / "repo")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "branch_holder.py"), url, "main"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n"
    yield url, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_second_run_on_a_held_branch_is_refused_naming_the_holder(holder):
    url, proc = holder
    repo = fp.Repo(url)
    head = repo.head("main")
    with pytest.raises(BranchHeldError) as e:
        fp.Checkpointer(repo, {"model": torch.nn.Linear(4, 4)}, every=1)
    message = str(e.value)
    assert f"pid {proc.pid} on {socket.gethostname()}, since 20" in message
    assert "branch=" in message and "on_conflict='fork'" in message and "take_over=True" in message
    with pytest.raises(BranchHeldError, match=f"pid {proc.pid}"):
        repo.save({"x": 1}, branch="main", step=5)
    assert repo.head("main") == head, "nothing saved on the held branch"
    assert repo.branch_holder("main").pid == proc.pid
    repo.save({"x": 1}, branch="other", step=5)


def test_on_conflict_fork_continues_on_a_branch_named_after_the_run(holder):
    url, proc = holder
    repo = fp.Repo(url)
    head = repo.head("main")
    with pytest.warns(fp.ResumeWarning, match=r"continues on branch 'main-"):
        ck = fp.Checkpointer(repo, {"model": torch.nn.Linear(4, 4)}, every=1, on_conflict="fork", sync=True)
    assert ck.branch == re.sub(r"[^A-Za-z0-9._-]", "-", f"main-{socket.gethostname()}-{os.getpid()}")
    assert ck.resume() == 1, "the fork starts from the held branch's head"
    ck.step(1)
    ck.close()
    assert repo.log(ck.branch)[1].id == head and repo.head("main") == head


def test_a_holder_killed_by_sigkill_needs_no_cleanup(holder):
    url, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    repo = fp.Repo(url)
    assert repo.branch_holder("main") is None
    ck = fp.Checkpointer(repo, {"model": torch.nn.Linear(4, 4)}, every=1, sync=True)
    assert ck.resume() == 1
    ck.step(1)
    assert repo.branch_holder("main").pid == os.getpid()
    ck.close()
    assert repo.branch_holder("main") is None, "close releases the branch"
    assert [v.step for v in repo.log("main")] == [1, 0]


def test_two_copies_of_one_script_do_not_interleave(tmp_path):
    """The issue's case: the second copy of a training script on the branch fails at once."""
    url = str(tmp_path / "repo")
    first = subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "branch_holder.py"), url, "main"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "holding\n"
        second = subprocess.run([sys.executable, os.path.join(HERE, "helpers", "branch_holder.py"), url, "main"],
                                input="", capture_output=True, text=True, timeout=procs.CHILD_SECONDS)
        assert second.returncode != 0 and "BranchHeldError" in second.stderr and f"pid {first.pid}" in second.stderr
    finally:
        first.communicate("", timeout=60)
    assert first.returncode == 0
    assert [v.step for v in fp.Repo(url).log("main")] == [0]


def _fake_holder(repo, seq=0, **fields):
    record = {"host": socket.gethostname(), "pid": os.getppid(), "boot": boot_id(),
              "start": start_ticks(os.getppid()), "since": time.time(), "run": "other", **fields}
    key = f"holders/main/{seq:016d}.json"
    repo.store.write(key, [json.dumps(record).encode()])
    return key


def test_holders_of_other_hosts_expire_and_reused_pids_do_not_count(tmp_path):
    repo = fp.Repo(str(tmp_path / "repo"), create=True)
    key = _fake_holder(repo)
    assert repo.branch_holder("main") is not None, "the parent process is alive"
    _fake_holder(repo, start="1")
    assert repo.branch_holder("main") is None, "same pid, another start time: the pid was reused"
    _fake_holder(repo, boot="another-boot")
    assert repo.branch_holder("main") is None, "a holder of an earlier boot is dead"
    _fake_holder(repo, host="elsewhere", pid=1)
    assert repo.branch_holder("main").host == "elsewhere"
    with pytest.raises(BranchHeldError, match="on elsewhere"):
        fp.Checkpointer(repo, {"model": torch.nn.Linear(4, 4)}, every=1)
    then = time.time() - HOLD_EXPIRY - 1
    os.utime(os.path.join(repo.url, key), (then, then))
    assert repo.branch_holder("main") is None, "another host's hold expires unless refreshed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp.Checkpointer(repo, {"model": torch.nn.Linear(4, 4)}, every=1).close()


def test_take_over_replaces_a_live_holder(holder):
    url, proc = holder
    repo = fp.Repo(url)
    ck = fp.Checkpointer(repo, {"model": torch.nn.Linear(4, 4)}, every=1, take_over=True, sync=True)
    assert repo.branch_holder("main").pid == os.getpid()
    ck.step(ck.resume())
    ck.close()
    assert [v.step for v in repo.log("main")] == [1, 0]


def test_a_run_whose_branch_was_taken_over_cannot_save_there(tmp_path):
    """Another run took the branch over (take_over=True): at this run's next refresh its
    record is gone, and its saves on the branch raise, naming the new holder."""
    repo = fp.Repo(str(tmp_path / "repo"), create=True)
    ck = fp.Checkpointer(repo, {"model": torch.nn.Linear(4, 4)}, every=1, sync=True)
    ck.step(0)
    for key in repo.store.list("holders/main"):
        repo.store.delete(key)
    _fake_holder(repo, seq=1, run="the new holder")
    repo.refs.holds.refresh()
    with pytest.raises(BranchHeldError, match="taken over by run 'the new holder'"):
        ck.step(1)
    assert [v.step for v in repo.log("main")] == [0]
