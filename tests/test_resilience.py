"""Preemption signals, walltime, auto interval, restarts, multi-rank agreement."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import forkpoint as fp
from forkpoint.policy.interval import YoungDaly, young_daly
import procs

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("mtbf_h, expected_min", [(24, 117), (6, 57), (0.25, 9.1)])
def test_daly_worked_cases(mtbf_h, expected_min):
    assert young_daly(5.0, mtbf_h * 60) == pytest.approx(expected_min, abs=0.1 if expected_min < 10 else 0.5)


def test_auto_interval_uses_measured_stall_and_time_cap():
    capped = YoungDaly(mtbf=30.0, max_fraction=0.05)
    assert capped.should_save(0, time.monotonic()), "no measurement yet: save to get one"
    assert "no checkpoint measured yet" in capped.explain()
    capped.observe(2.0)
    tau, why = capped.interval()
    assert why == "5% time cap" and tau == pytest.approx(2.0 * 0.95 / 0.05)
    assert tau > young_daly(2.0, 30.0), "the cap saves less often than Young/Daly here"
    auto = YoungDaly(mtbf=3600.0)
    auto.observe(0.05)
    auto.observe(0.01)
    assert auto.stall == pytest.approx(0.03)
    tau2, why2 = auto.interval()
    assert why2 == "young/daly" and tau2 == pytest.approx(young_daly(auto.stall, 3600.0))
    assert "measured stall" in auto.explain() and "MTBF M = 3600 s (given)" in auto.explain()
    assert "no time-fraction cap" in auto.explain() and "5% cap" in capped.explain()
    assert not auto.should_save(1, time.monotonic())
    assert auto.should_save(1, time.monotonic() - tau2 - 1)


def test_checkpointer_auto_learns_stall(repo):
    model = torch.nn.Linear(64, 64)
    ck = fp.Checkpointer(repo, {"model": model}, every="auto", sync=True, preemption=False)
    assert ck.step(0) is not None
    ck.step(1)
    assert ck.policy.stall is not None and ck.policy.stall > 0
    assert "auto interval" in ck.policy.explain()
    ck.close()
    with pytest.raises(ValueError, match="unknown save policy"):
        fp.Checkpointer(repo, {"model": model}, every="sometimes")
    with pytest.raises(TypeError, match=r"every=0.5 is not a step count .* fp.EverySeconds"):
        fp.Checkpointer(repo, {"model": model}, every=0.5)


def _train(repo, log, steps, extra=(), env=None, wait=True):
    cmd = [sys.executable, "-m", "forkpoint.cli.demo", "train", "--repo", repo, "--log", log,
           "--steps", str(steps), *extra]
    if wait:
        return subprocess.run(cmd, timeout=procs.CHILD_SECONDS, env=env)
    return subprocess.Popen(cmd, env=env)


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def test_sigterm_at_random_step_then_bit_identical_resume(tmp_path):
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    assert _train(ref, str(tmp_path / "ref.jsonl"), 40, ["--every", "5"]).returncode == 0
    proc = _train(cut, str(tmp_path / "cut.jsonl"), 40, ["--every", "5", "--sleep", "0.05"], wait=False)
    while not os.path.exists(str(tmp_path / "cut.jsonl")) or len(open(tmp_path / "cut.jsonl").readlines()) < 3:
        time.sleep(0.05)
    time.sleep(random.Random(7).uniform(0.0, 1.0))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=procs.CHILD_SECONDS) == fp.PREEMPTED_EXIT_CODE
    repo = fp.Repo(cut)
    head = repo.version("main")
    last_logged = max(_losses(str(tmp_path / "cut.jsonl")))
    assert head.step == last_logged and head.message == "emergency: signal SIGTERM"
    assert head.meta["reason"] == "signal SIGTERM"
    assert _train(cut, str(tmp_path / "cut.jsonl"), 40, ["--every", "5"]).returncode == 0
    a, b = fp.Repo(ref).load("main"), fp.Repo(cut).load("main")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])
    assert _losses(str(tmp_path / "ref.jsonl")) == _losses(str(tmp_path / "cut.jsonl"))
    resumed = fp.Repo(cut).version("main")
    assert resumed.meta["restarts"] == 1 and resumed.meta["resumed_from"] == head.id
    assert resumed.meta["lost_seconds"] >= 0
    out = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "log", "main", "-r", cut],
                         capture_output=True, text=True)
    assert "restarts=1" in out.stdout


def test_walltime_saves_once_before_the_end(tmp_path):
    """The job's end is set 6 s after the child's imports (under a loaded CI, importing torch
    took longer than a fixed 6 s from the parent's clock, and the save came at step 0)."""
    url = str(tmp_path / "r")
    script = (
        "import os, time, torch, forkpoint as fp\n"
        "os.environ['FORKPOINT_END_TIME'] = end = str(time.time() + 6.0)\n"
        "print('end', end)\n"
        f"repo = fp.Repo({url!r}, create=True)\n"
        "m = torch.nn.Linear(8, 8)\n"
        "ck = fp.Checkpointer(repo, {'m': m}, every=None)\n"
        "for step in range(80):\n"
        "    time.sleep(0.1)\n"
        "    ck.step(step)\n"
        "ck.close()\n"
        "print(ck.policy.explain())\n")
    out = procs.run([sys.executable, "-c", script], timeout=procs.CHILD_SECONDS)
    assert out.returncode == 0, out.stderr
    log = fp.Repo(url).log()
    assert len(log) == 1 and log[0].meta["reason"] == "walltime"
    end = float(out.stdout.split()[1])
    assert end - 4.0 < log[0].time < end, "saved shortly before the end, not at the start"
    assert log[0].step > 0
    assert "before the job's end" in out.stdout


def test_requeue_under_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.args"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {record}\n")
    (bin_dir / "scontrol").chmod(0o755)
    url = str(tmp_path / "r")
    script = (
        "import os, signal, time, torch, forkpoint as fp\n"
        f"repo = fp.Repo({url!r}, create=True)\n"
        "m = torch.nn.Linear(8, 8)\n"
        "ck = fp.Checkpointer(repo, {'m': m}, every=None, preemption=fp.Preemption(requeue=True))\n"
        "for step in range(100):\n"
        "    if step == 5: os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    ck.step(step)\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_ARRAY_JOB_ID="4200", SLURM_ARRAY_TASK_ID="7")
    out = procs.run([sys.executable, "-c", script], env=env, timeout=procs.CHILD_SECONDS)
    assert out.returncode == fp.PREEMPTED_EXIT_CODE, out.stderr
    assert record.read_text().split() == ["requeue", "4200_7"]
    assert fp.Repo(url).version("main").step == 5


def preempted_ranks(directory, timeout: float = 120.0) -> tuple[list[int] | None, str]:
    """Run tests/helpers/dist_preempt.py on two ranks against the repository directory/r:
    (their exit codes, "") or, if a rank is still running after `timeout` seconds (killed
    then), (None, every rank's standard error: the helper prints its stacks at 90 s)."""
    directory.mkdir(parents=True, exist_ok=True)
    children, errs = [], []
    try:
        for rank in range(2):
            env = dict(os.environ, FP_TEST_RENDEZVOUS=str(directory / "rendezvous"), RANK=str(rank),
                       WORLD_SIZE="2", LOCAL_RANK=str(rank))
            errs.append(open(directory / f"rank{rank}.err", "w+"))
            children.append(subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "dist_preempt.py"),
                                              str(directory / "r")], env=env, stderr=errs[-1]))
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in children]
        return codes, ""
    except subprocess.TimeoutExpired:
        for p in children:
            p.kill()
            p.wait()
        return None, "\n".join(f"--- rank {r} ---\n" + (directory / f"rank{r}.err").read_text() for r in range(2))
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in errs:
            f.close()


@pytest.mark.ranks
def test_signal_on_one_rank_saves_one_version_at_the_same_step(tmp_path):
    """A signal on rank 1 stops both ranks at the same step with one coordinated save. A run
    that hangs (seen once in the full suite, not reproduced) runs once more, its stacks kept
    as a warning; a second hang fails."""
    codes, stacks = preempted_ranks(tmp_path / "first")
    directory = tmp_path / "first"
    if codes is None:
        warnings.warn(f"the preempted ranks hung and ran again:\n{stacks}")
        directory = tmp_path / "second"
        codes, stacks = preempted_ranks(directory)
        assert codes is not None, f"the preempted ranks hung twice:\n{stacks}"
    assert codes == [fp.PREEMPTED_EXIT_CODE] * 2, (directory / "rank0.err").read_text() + (directory / "rank1.err").read_text()
    url = str(directory / "r")
    log = fp.Repo(url).log()
    emergency = [v for v in log if v.message.startswith("emergency")]
    assert [v.step for v in log] == [3, 0], "one regular save at step 0, one coordinated save at 3"
    assert len(emergency) == 1 and emergency[0].env["world_size"] == 2
    assert emergency[0].meta["reason"] == "stop requested on another rank"


def test_example_training_script_runs_and_resumes(tmp_path):
    url = str(tmp_path / "r")
    script = os.path.join(HERE, "..", "examples", "train.py")
    for steps in (20, 30):
        out = procs.run([sys.executable, script, "--repo", url, "--steps", str(steps)],
                        timeout=procs.CHILD_SECONDS)
        assert out.returncode == 0, out.stderr
        assert "auto interval" in out.stdout
    log = fp.Repo(url).log()
    assert log[0].step == 29 and log[0].meta["restarts"] == 1


def test_mtbf_estimated_from_restart_history(repo):
    from forkpoint.policy.preemption import estimate_mtbf

    assert estimate_mtbf(repo, "main") is None
    repo.save({"x": 1}, step=0)
    time.sleep(0.05)
    repo.save({"x": 2}, step=1, meta={"restarts": 1})
    time.sleep(0.05)
    v = repo.save({"x": 3}, step=2, meta={"restarts": 2})
    span = v.time - repo.log()[-1].time
    assert estimate_mtbf(repo, "main") == pytest.approx(span / 2)
    ck = fp.Checkpointer(repo, {"x": {"y": 1}}, every="auto", preemption=False)
    assert ck.policy.mtbf_estimate == pytest.approx(span / 2)
    ck.policy.observe(0.1)
    assert "estimated from restarts" in ck.policy.explain()


def test_slurm_restart_count_and_squeue_end_time(tmp_path, monkeypatch, repo):
    from forkpoint.policy.preemption import slurm_end_time

    model = torch.nn.Linear(4, 4)
    repo.save({"m": model}, step=9)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    ck = fp.Checkpointer(repo, {"m": model}, every=1, sync=True, preemption=False)
    assert ck.resume() == 10
    v = ck.step(10)
    assert v.meta["restarts"] == 3 and v.meta["resumed_from"] == repo.resolve("main~1")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho 2031-05-04T12:30:00\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    monkeypatch.delenv("FORKPOINT_END_TIME", raising=False)
    assert slurm_end_time() == time.mktime(time.strptime("2031-05-04T12:30:00", "%Y-%m-%dT%H:%M:%S"))
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1900000000")
    assert slurm_end_time() == 1900000000.0
