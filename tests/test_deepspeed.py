"""The DeepSpeed plug-in against real DeepSpeed (ZeRO-1 on CPU): save_checkpoint makes a
version at commit, a new process resumes from the branch head or a ref, bit-identical."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

import forkpoint as fp  # noqa: E402
import procs  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

RUN = os.path.join(os.path.dirname(__file__), "frameworks", "ds_run.py")


def run(*args):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(var, None)
    out = procs.run([sys.executable, RUN, *args], timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_checkpoint_to_versions_and_resume(tmp_path):
    url, d = str(tmp_path / "repo"), str(tmp_path / "ckpt")
    run("--dir", str(tmp_path / "plain"), "--steps", "8", "--out", str(tmp_path / "ref.pt"))
    run("--repo", url, "--dir", d, "--steps", "8", "--out", str(tmp_path / "a.pt"))
    a, ref = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "ref.pt")
    assert same(a["params"], ref["params"]), "checkpointing through forkpoint does not change training"
    repo = fp.Repo(url)
    log = repo.log("main")
    assert [v.meta["deepspeed_tag"] for v in log] == ["global_step8", "global_step4"]
    assert [v.step for v in log] == [8, 4]
    files = repo.load("main")["files"]
    assert "mp_rank_00_model_states.pt" in files and any(f.endswith("optim_states.pt") for f in files)
    assert set(repo.tags()) >= {"global_step4", "global_step8"}
    run("--repo", url, "--dir", d, "--steps", "8", "--resume", "--tag", "main~1", "--out", str(tmp_path / "b.pt"))
    b = torch.load(tmp_path / "b.pt")
    assert b["ran"] == 4 and same(b["params"], ref["params"]), "resumed from step 4: bit-identical"
    run("--repo", url, "--dir", d, "--steps", "12", "--resume", "--out", str(tmp_path / "c.pt"))
    assert torch.load(tmp_path / "c.pt")["ran"] == 4, "no tag: the branch head (step 8)"


def test_load_needs_only_the_repository(tmp_path):
    """The save directory wiped (a job resumed on another node): load by branch head, tag or
    version id from a directory that never held the checkpoint; an empty repository loads
    nothing and trains from scratch, as stock DeepSpeed without a checkpoint."""
    import shutil

    url, d = str(tmp_path / "repo"), str(tmp_path / "ckpt")
    run("--dir", str(tmp_path / "plain"), "--steps", "8", "--out", str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt")
    run("--repo", url, "--dir", d, "--steps", "8", "--out", str(tmp_path / "a.pt"))
    shutil.rmtree(d)
    elsewhere = str(tmp_path / "elsewhere")
    step4 = fp.Repo(url).resolve("main~1")
    for tag, out in ((None, "head.pt"), ("global_step4", "tag.pt"), (step4, "id.pt")):
        run("--repo", url, "--dir", elsewhere, "--steps", "8", "--resume", *(["--tag", tag] if tag else []),
            "--out", str(tmp_path / out))
    assert torch.load(tmp_path / "head.pt")["ran"] == 0
    for out in ("tag.pt", "id.pt"):
        resumed = torch.load(tmp_path / out)
        assert resumed["ran"] == 4 and same(resumed["params"], ref["params"])
    run("--repo", str(tmp_path / "empty"), "--dir", str(tmp_path / "e"), "--steps", "8", "--resume",
        "--out", str(tmp_path / "fresh.pt"))
    fresh = torch.load(tmp_path / "fresh.pt")
    assert fresh["ran"] == 8 and same(fresh["params"], ref["params"])


def test_decoupled_protocol(tmp_path):
    url, d = str(tmp_path / "repo"), str(tmp_path / "ckpt")
    run("--dir", str(tmp_path / "plain"), "--steps", "8", "--out", str(tmp_path / "ref.pt"))
    run("--repo", url, "--dir", d, "--steps", "8", "--decoupled", "--out", str(tmp_path / "a.pt"))
    ref = torch.load(tmp_path / "ref.pt")
    assert same(torch.load(tmp_path / "a.pt")["params"], ref["params"]), "the copy finished before the state changed"
    repo = fp.Repo(url)
    assert [v.step for v in repo.log("main")] == [8, 4]
    assert repo.verify().ok
    run("--repo", url, "--dir", d, "--steps", "8", "--resume", "--tag", "global_step4", "--out", str(tmp_path / "b.pt"))
    b = torch.load(tmp_path / "b.pt")
    assert b["ran"] == 4 and same(b["params"], ref["params"])


def run_ranks(world, *args):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", RUN, "--dist", *args]
    out = procs.run(cmd, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.ranks
def test_zero1_on_two_ranks_saves_one_version_and_resumes_exactly(tmp_path):
    url, d = str(tmp_path / "repo"), str(tmp_path / "ckpt")
    run_ranks(2, "--dir", str(tmp_path / "plain"), "--steps", "8", "--out", str(tmp_path / "ref.pt"))
    run_ranks(2, "--repo", url, "--dir", d, "--steps", "8", "--out", str(tmp_path / "a.pt"))
    ref = torch.load(tmp_path / "ref.pt")
    assert same(torch.load(tmp_path / "a.pt")["params"], ref["params"])
    repo = fp.Repo(url)
    assert [v.step for v in repo.log("main")] == [8, 4] and repo.version("main").env["world_size"] == 2
    per_rank = repo.load("main")["files"]
    assert len(per_rank) == 2 and all(any(n.endswith("optim_states.pt") for n in f) for f in per_rank), \
        "each rank stored its own ZeRO partition"
    run_ranks(2, "--repo", url, "--dir", d, "--steps", "8", "--resume", "--tag", "global_step4",
              "--out", str(tmp_path / "b.pt"))
    b = torch.load(tmp_path / "b.pt")
    assert b["ran"] == 4 and same(b["params"], ref["params"]), "both ranks resumed their partitions exactly"
