"""Ctrl-C during a save: the first finishes it and says so, a second aborts it cleanly."""

import os
import subprocess
import sys

import forkpoint as fp
import procs

HERE = os.path.dirname(__file__)


def _interrupted(url: str, interrupts: int | str) -> subprocess.CompletedProcess:
    return procs.run([sys.executable, os.path.join(HERE, "helpers", "interrupted_save.py"), url, str(interrupts)],
                     timeout=procs.CHILD_SECONDS)


def _files(url: str, under: str) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(os.path.join(url, under)) for f in fs}


def test_one_interrupt_finishes_the_save_and_says_so(tmp_path):
    url = str(tmp_path / "repo")
    run = _interrupted(url, 1)
    assert run.returncode == 130 and "stopped by the interrupt" in run.stdout, run.stderr
    repo = fp.Repo(url)
    head = repo.version("main")
    assert head.step == 1, "the save was committed"
    lines = [line for line in run.stderr.splitlines() if line.startswith("forkpoint:")]
    assert lines == ["forkpoint: interrupted: finishing the save of step 1 on branch 'main' first "
                     "(Ctrl-C again aborts it)",
                     f"forkpoint: the save of step 1 on branch 'main' finished: committed as version {head.id}; "
                     "stopping for the interrupt"], run.stderr
    assert "Traceback" not in run.stderr
    assert repo.verify().ok and _files(url, "tmp") == set()


def test_a_second_interrupt_aborts_the_save_and_leaves_nothing_after_gc(tmp_path):
    url = str(tmp_path / "repo")
    run = _interrupted(url, 2)
    assert run.returncode == 130 and "stopped by the interrupt" in run.stdout, run.stderr
    assert "forkpoint: the save of step 1 on branch 'main' aborted: nothing committed, no temporary file left" \
        in run.stderr
    repo = fp.Repo(url)
    assert [v.step for v in repo.log()] == [0]
    assert _files(url, "tmp") == set()
    said = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "gc", "-r", url], capture_output=True,
                          text=True, check=True).stdout
    assert "0 object(s)" in said and "unreferenced object(s) or temp file(s): no other process is writing" in said
    for path in _files(url, "objects"):  # gc runs a minute later: past QUIET_MARGIN, well inside the grace
        then = os.stat(path).st_mtime - 60
        os.utime(path, (then, then))
    report = repo.gc()  # no flags: the aborting process has ended, so its objects go now
    assert report.deleted_objects > 0 and report.others_writing == []
    referenced = {o for leaf in repo.manifest("main").leaves for c in leaf.chunks for o in c.objects}
    assert {os.path.basename(p) for p in _files(url, "objects")} == referenced
    assert repo.verify().ok


def test_a_second_interrupt_once_the_commit_began_says_the_save_committed(tmp_path):
    url = str(tmp_path / "repo")
    run = _interrupted(url, "late")
    assert run.returncode == 130 and "stopped by the interrupt" in run.stdout, run.stderr
    repo = fp.Repo(url)
    head = repo.version("main")
    assert head.step == 1, "the commit had begun: it completes"
    lines = [line for line in run.stderr.splitlines() if line.startswith("forkpoint:")]
    assert lines[1:] == ["forkpoint: aborting the save of step 1 on branch 'main'",
                         "forkpoint: the save of step 1 on branch 'main' could not be aborted, it had reached "
                         f"its commit: committed as version {head.id}"], run.stderr
    assert repo.verify().ok and _files(url, "tmp") == set()
