"""The Transformers plug-in against the real Trainer: checkpoints at save_steps become
versions (model, optimizer, scheduler, RNG, TrainerState), a new process resumes from a ref
exactly, save_total_limit maps to retention."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import forkpoint as fp  # noqa: E402
import procs  # noqa: E402

pytestmark = pytest.mark.timeout(1900)

RUN = os.path.join(os.path.dirname(__file__), "frameworks", "hf_run.py")


def run(*args):
    out = procs.run([sys.executable, RUN, *args], timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_checkpoints_to_versions_and_resumes_exactly(tmp_path):
    url, d = str(tmp_path / "repo"), str(tmp_path / "out")
    run("--repo", url, "--dir", d, "--steps", "12", "--save-steps", "4", "--limit", "2", "--out", str(tmp_path / "a.pt"))
    assert not any(f.startswith("checkpoint-") for f in os.listdir(d)), "no checkpoint folders are written"
    repo = fp.Repo(url)
    repo.drain()
    log = repo.log("main")
    assert [v.step for v in log] == [12, 8, 4]
    tree = repo.load("main")
    assert {"model", "optimizer", "scheduler", "rng", "trainer_state"} <= set(tree)
    assert tree["trainer_state"]["global_step"] == 12 and "loss" in log[0].metrics
    assert sorted(repo.tags()) == ["checkpoint-12", "checkpoint-8"], "save_total_limit=2 keeps two"
    with pytest.raises(fp.errors.PrunedVersionError):
        repo.load(log[2].id)
    run("--repo", url, "--dir", str(tmp_path / "out2"), "--steps", "12", "--resume", "checkpoint-8",
        "--out", str(tmp_path / "b.pt"))
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert (b["step"], b["ran"]) == (12, 4), "the new process resumed at step 8"
    assert same(a["params"], b["params"]), "resumed in a new process: bit-identical"
    run("--repo", url, "--dir", str(tmp_path / "out3"), "--steps", "16", "--resume", "true",
        "--out", str(tmp_path / "c.pt"))
    c = torch.load(tmp_path / "c.pt")
    assert (c["step"], c["ran"]) == (16, 4), "True resumes the branch head"
    assert fp.Repo(url).version("main").step == 16


def test_asynchronous_trainer_checkpoints_resume_exactly(tmp_path):
    url = str(tmp_path / "repo")
    run("--repo", url, "--dir", str(tmp_path / "plain"), "--steps", "12", "--save-steps", "4", "--plain",
        "--out", str(tmp_path / "plain.pt"))
    run("--repo", url, "--dir", str(tmp_path / "out"), "--steps", "12", "--save-steps", "4", "--limit", "2",
        "--async", "--out", str(tmp_path / "a.pt"))
    plain, a = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "a.pt")
    assert same(plain["params"], a["params"]), "training with asynchronous checkpoints is unchanged"
    repo = fp.Repo(url)
    assert [v.step for v in repo.log("main")][:2] == [12, 8]
    assert sorted(repo.tags()) == ["checkpoint-12", "checkpoint-8"]
    run("--repo", url, "--dir", str(tmp_path / "out2"), "--steps", "12", "--resume", "checkpoint-8",
        "--async", "--out", str(tmp_path / "b.pt"))
    b = torch.load(tmp_path / "b.pt")
    assert (b["step"], b["ran"]) == (12, 4) and same(a["params"], b["params"])
