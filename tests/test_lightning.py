"""The Lightning plug-in against the real Lightning: ModelCheckpoint (top-k, last) through
forkpoint versions, exact resume in a new process, ckpt_path as a ref, SLURM's hpc path,
retention on remove, and the no-pickle rule."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import forkpoint as fp  # noqa: E402
import procs  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

RUN = os.path.join(os.path.dirname(__file__), "frameworks", "lightning_run.py")


def run(*args, ok=True, env=None):
    out = procs.run([sys.executable, RUN, *args], timeout=400, env=env)
    if ok:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_in_a_new_process_is_exact(tmp_path, mode):
    extra = ["--async"] if mode == "async" else []
    run("--repo", str(tmp_path / "ref-repo"), "--dir", str(tmp_path / "ref"), "--epochs", "4",
        "--out", str(tmp_path / "ref.pt"))
    repo_url, d = str(tmp_path / "repo"), str(tmp_path / "ckpts")
    run("--repo", repo_url, "--dir", d, "--epochs", "2", "--out", str(tmp_path / "half.pt"), *extra)
    pointer = json.load(open(os.path.join(d, "last.ckpt")))
    assert pointer["format"] == "forkpoint.pointer"
    repo = fp.Repo(repo_url)
    version = repo.version(pointer["version"])
    assert version.step == 8 and "train_loss" in version.metrics
    run("--repo", repo_url, "--dir", d, "--epochs", "4", "--ckpt-path", os.path.join(d, "last.ckpt"),
        "--out", str(tmp_path / "resumed.pt"), *extra)
    ref, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "resumed.pt")
    assert resumed["global_step"] == ref["global_step"] == 16 and resumed["start_step"] == 8
    assert same(ref["params"], resumed["params"]), "resumed training is bit-identical on CPU"


def test_top_k_removal_maps_to_retention_and_refs_resume(tmp_path):
    repo_url, d = str(tmp_path / "repo"), str(tmp_path / "ckpts")
    run("--repo", repo_url, "--dir", d, "--epochs", "3", "--top-k", "1", "--out", str(tmp_path / "a.pt"), "--hpc")
    files = sorted(f for f in os.listdir(d) if f.endswith(".ckpt"))
    assert len([f for f in files if f.startswith("epoch")]) == 1, files
    repo = fp.Repo(repo_url)
    tags = repo.tags()
    assert "last" in tags and "hpc_ckpt_1" in tags
    assert len([t for t in tags if t.startswith("epoch")]) == 1, "removed checkpoints lose their tag"
    repo.drain()
    best = torch.load(tmp_path / "a.pt")["best"]
    assert os.path.basename(best) in files
    run("--repo", repo_url, "--dir", d, "--epochs", "4", "--ckpt-path", "hpc", "--out", str(tmp_path / "b.pt"))
    b = torch.load(tmp_path / "b.pt")
    assert (b["start_step"], b["global_step"]) == (12, 16), "SLURM's hpc checkpoint resumes"
    run("--repo", repo_url, "--dir", str(tmp_path / "other"), "--epochs", "5", "--ckpt-path", "hpc_ckpt_1",
        "--out", str(tmp_path / "c.pt"))
    c = torch.load(tmp_path / "c.pt")
    assert (c["start_step"], c["global_step"]) == (12, 20), "a tag works as ckpt_path"


def test_a_diverged_monitored_metric_still_checkpoints_and_never_ranks_best(tmp_path):
    """Lightning scores a NaN monitor as inf; JSON has neither, so the version records "inf"
    and the run goes on (it used to fail in save with a TypeError)."""
    repo_url, d = str(tmp_path / "repo"), str(tmp_path / "ckpts")
    run("--repo", repo_url, "--dir", d, "--epochs", "3", "--top-k", "3", "--nan-loss-from", "1",
        "--out", str(tmp_path / "a.pt"))
    repo = fp.Repo(repo_url)
    scores = [v.metrics.get("train_loss") for v in repo.log()]
    assert "inf" in scores and isinstance(scores[-1], float), scores
    assert os.path.basename(torch.load(tmp_path / "a.pt")["best"]).startswith("epoch=0")
    repo.gc(keep=fp.Keep(last=1, best=("train_loss", 1, "min")), grace=0)
    kept = [v for v in repo.log() if not v.pruned]
    assert scores[-1] in [v.metrics.get("train_loss") for v in kept], "the finite score is the best"


def test_objects_beyond_plain_data_need_pickle(tmp_path):
    out = run("--repo", str(tmp_path / "repo"), "--dir", str(tmp_path / "d"), "--epochs", "1", "--custom",
              "--out", str(tmp_path / "x.pt"), ok=False)
    assert out.returncode != 0 and "custom" in out.stderr and "allow_pickle" in out.stderr


def test_slurm_requeue_signal_saves_and_the_requeued_job_resumes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train"}
    repo_url, d = str(tmp_path / "repo"), str(tmp_path / "ckpts")
    run("--repo", repo_url, "--dir", d, "--epochs", "4", "--slurm-signal-at", "6", "--out", str(tmp_path / "x.pt"),
        env=env)
    assert not (tmp_path / "x.pt").exists(), "the job was killed after the signal"
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert fp.Repo(repo_url).version("hpc_ckpt_1").step == 6
    run("--repo", repo_url, "--dir", d, "--epochs", "4", "--out", str(tmp_path / "y.pt"), env=env)
    y = torch.load(tmp_path / "y.pt")
    assert (y["start_step"], y["global_step"]) == (6, 16), "the requeued job resumed from the hpc version"


@pytest.mark.ranks
def test_ddp_on_two_processes_saves_from_rank_zero_and_every_rank_resumes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run("--repo", str(tmp_path / "ref-repo"), "--dir", str(tmp_path / "ref"), "--epochs", "4", "--devices", "2",
        "--out", str(tmp_path / "ref.pt"), env=env)
    repo_url, d = str(tmp_path / "repo"), str(tmp_path / "ckpts")
    run("--repo", repo_url, "--dir", d, "--epochs", "2", "--devices", "2", "--out", str(tmp_path / "half.pt"), env=env)
    pointer = json.load(open(os.path.join(d, "last.ckpt")))
    assert fp.Repo(repo_url).version(pointer["version"]).step == 4, "2 epochs of 2 batches per rank"
    run("--repo", repo_url, "--dir", d, "--epochs", "4", "--devices", "2", "--ckpt-path", os.path.join(d, "last.ckpt"),
        "--out", str(tmp_path / "resumed.pt"), env=env)
    ref, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "resumed.pt")
    assert resumed["global_step"] == ref["global_step"] == 8 and resumed["start_step"] == 4
    assert same(ref["params"], resumed["params"]), "resumed DDP training is bit-identical"
