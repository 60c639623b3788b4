"""The distributed example under real torchrun, then resumed on another number of ranks, and
under a SLURM-style environment (SLURM_PROCID / SLURM_NTASKS, as srun sets them)."""

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import forkpoint as fp  # noqa: E402
import procs

pytestmark = pytest.mark.ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dist_train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args) -> str:
    """Run the example under torchrun; return rank 0's output. A worker that finished its work
    (rank 0 printed "done") but aborted in torch's process-group teardown, which happens now
    and then under load on this machine, is not counted as a failure: the versions it
    committed are checked by the caller. A run whose port another process took between
    free_port() and torchrun's bind (EADDRINUSE, before any rank starts) runs again on another."""
    for attempt in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), EXAMPLE, *args]
        out = procs.run(cmd, timeout=procs.CHILD_SECONDS, cwd=ROOT)
        if out.returncode == 0 or "EADDRINUSE" not in out.stderr:
            break
    teardown_abort = "done at step" in out.stdout and "terminate called without an active exception" in out.stderr
    assert out.returncode == 0 or teardown_abort, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_torchrun_then_resume_on_three_ranks(tmp_path):
    repo = str(tmp_path / "run")
    out = torchrun(2, "--repo", repo, "--steps", "5", "--every", "3")
    assert "rank 0 of 2 (torchrun): starting at step 0" in out
    out = torchrun(3, "--repo", repo, "--steps", "8", "--every", "3")
    assert "rank 0 of 3 (torchrun): starting at step 4" in out
    log = fp.Repo(repo).log("main")
    assert [(v.step, v.env["world_size"]) for v in log] == [(6, 3), (3, 2), (0, 2)]
    assert log[0].meta["resumed_from"] == log[1].id


def test_slurm_environment(tmp_path):
    repo, port = str(tmp_path / "run"), free_port()
    children = []
    for rank in range(2):
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
               "SLURM_JOB_ID": "77", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(var, None)
        children.append(subprocess.Popen([sys.executable, EXAMPLE, "--repo", repo, "--steps", "4", "--every", "2"],
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    outs = [p.communicate(timeout=procs.CHILD_SECONDS) for p in children]
    assert all(p.returncode == 0 for p in children), outs
    assert "rank 0 of 2 (slurm)" in outs[0][0]
    assert [(v.step, v.env["world_size"]) for v in fp.Repo(repo).log("main")] == [(2, 2), (0, 2)]
