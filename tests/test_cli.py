"""The forkpoint command on a real repository."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import forkpoint as fp
from forkpoint.cli.main import cli
import procs


@pytest.fixture
def filled(tmp_path):
    url = str(tmp_path / "repo")
    repo = fp.Repo(url, create=True)
    model = torch.nn.Linear(8, 4)
    for step in range(4):
        with torch.no_grad():
            model.weight.add_(0.5)
        repo.save({"model": model, "epoch": step, "name": "run"}, step=step, metrics={"loss": 1.0 / (step + 1)},
                  message=f"step {step}")
    repo.fork("main~2", "alt")
    repo.save({"model": model, "epoch": 99, "name": "alt"}, branch="alt", step=2)
    repo.tag("best", "main~1")
    repo.close()
    return url


def run(*args, code=0):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_init_and_missing_repo(tmp_path):
    url = str(tmp_path / "new")
    assert "initialised" in run("init", url)
    assert fp.Repo(url).branches() == {}
    r = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "log", "-r", str(tmp_path / "nope")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no forkpoint repository" in r.stderr


def test_log_graph_and_json(filled):
    out = run("log", "-r", filled)
    assert "(main)" in out and "(alt)" in out and "tag:best" in out and "|/" in out
    data = json.loads(run("log", "main", "-r", filled, "--json"))
    assert [v["step"] for v in data] == [3, 2, 1, 0]
    assert data[0]["metrics"] == {"loss": 0.25}


def test_show_diff_branches(filled):
    out = run("show", "main", "-r", filled)
    assert "model/weight" in out and "float32" in out and "4x8" in out
    data = json.loads(run("show", "best", "-r", filled, "--json"))
    assert data["step"] == 2 and {leaf["path"] for leaf in data["leaves"]} == {"model/weight", "model/bias"}
    diff = json.loads(run("diff", "main~1", "main", "-r", filled, "--json"))
    by_path = {d["path"]: d for d in diff}
    assert by_path["model/weight"]["status"] == "changed" and abs(by_path["model/weight"]["max_abs"] - 0.5) < 1e-5
    assert by_path["model/bias"]["status"] == "same"
    assert "paths differ" in run("diff", "main", "alt", "-r", filled)
    assert set(json.loads(run("branches", "-r", filled, "--json"))) == {"main", "alt"}


def test_fork_tag_verify_gc_du(filled):
    assert "created" in run("fork", "main~3", "old", "-r", filled)
    assert "tag v0" in run("tag", "v0", "old", "-r", filled)
    rep = json.loads(run("verify", "-r", filled, "--json"))
    assert rep["ok"] and rep["versions"] == 5
    dry = json.loads(run("gc", "--keep-last", "1", "--grace", "0", "--dry-run", "-r", filled, "--json"))
    assert dry["dry_run"] and dry["pruned_versions"] == [fp.Repo(filled).resolve("main~2")]
    usage = json.loads(run("du", "-r", filled, "--json"))
    assert usage["branches"]["main"]["versions"] == 4 and usage["objects_bytes"] > 0
    run("tag", "v0", "-r", filled, "--delete")
    run("tag", "best", "-r", filled, "--delete")
    run("gc", "--keep-last", "1", "--branch", "main", "--grace", "0", "-r", filled)
    log = json.loads(run("log", "main", "-r", filled, "--json"))
    assert [v["pruned"] for v in log] == [False, True, False, False]
    assert "pruned" in run("du", "-r", filled)


def test_du_counts_a_packed_object_whole_and_lists_versions_newest_first(tmp_path):
    """A version that keeps one leaf of an older version's packed object still holds the whole
    object: its decoded bytes are the header's, so raw objects show their real ratio."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    a, b = torch.arange(64.0), torch.ones(32)
    repo.save({"a": a, "b": b}, step=1)
    repo.save({"a": a, "b": b * 2}, step=2)
    repo.gc(keep=fp.Keep(last=1), grace=0)
    usage = repo.du()
    assert [v["step"] for v in usage["versions"]] == [2, 1]
    raw = usage["codecs"]["raw"]
    assert raw["objects"] == 2 and raw["decoded_bytes"] == (64 + 32) * 4 + 32 * 4
    assert raw["stored_bytes"] == raw["decoded_bytes"] + 2 * 16, "a raw object is its bytes and a header"
    repo.close()


def test_bad_arguments_get_a_one_line_error(filled):
    """Wrong values are refused with a message and exit code 2, not a traceback, and change nothing."""
    before = fp.Repo(filled).log()
    for args, message in [(["gc", "--keep-last", "0"], "0 is not in the range x>=1"),
                          (["gc", "--grace", "-5"], "-5.0 is not in the range x>=0"),
                          (["gc", "--keep-best", "loss"], "expected METRIC:K:min|max"),
                          (["gc", "--keep-best", "loss:2:low"], "expected METRIC:K:min|max"),
                          (["gc", "--keep-last", "1", "--keep-best", "los:1:min"],
                           "no version of alt, main records metric 'los' as a number, so none would be kept as "
                           "best; nothing was pruned. Numeric metrics recorded: loss"),
                          (["tag", "bad name", "main"], "invalid tag name 'bad name'"),
                          (["fork", "main", "main"], "branch 'main' already exists")]:
        r = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", *args, "-r", filled],
                           capture_output=True, text=True)
        assert r.returncode == 2 and message in " ".join(r.stderr.split()), (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert fp.Repo(filled).log() == before
    report = json.loads(run("gc", "--keep-best", "loss:1:min", "--dry-run", "-r", filled, "--json"))
    assert report["dry_run"] and report["pruned_versions"] == [fp.Repo(filled).resolve("main~3")]


def test_verify_fails_on_corruption(filled):
    repo = fp.Repo(filled)
    obj = repo.manifest("main").leaves[0].chunks[0].object
    path = os.path.join(filled, "objects", obj[:2], obj)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    out = run("verify", "-r", filled, code=1)
    assert "problem" in out and obj in out


def test_export_safetensors(filled, tmp_path):
    out_dir = str(tmp_path / "export")
    out = run("export", "main", out_dir, "-r", filled)
    assert "model.safetensors" in out
    tensors = load_file(os.path.join(out_dir, "model.safetensors"))
    assert sorted(tensors) == ["bias", "weight"], "named as the module's state_dict keys"
    model = torch.nn.Linear(8, 4)
    model.load_state_dict(tensors)
    assert torch.equal(model.weight, fp.Repo(filled).load("main")["model"]["weight"])
    meta = json.load(open(os.path.join(out_dir, "state.json")))
    assert meta["leaves"]["epoch"] == {"value": 3} and meta["leaves"]["name"] == {"value": "run"}
    assert meta["leaves"]["model/weight"] == {"tensor": "weight", "file": "model.safetensors"}
    run("export", "main", str(tmp_path / "prefixed"), "--keep-prefix", "-r", filled)
    assert sorted(load_file(str(tmp_path / "prefixed" / "model.safetensors"))) == ["model/bias", "model/weight"]


def test_bad_refs_are_clear(filled):
    r = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "show", "nosuch", "-r", filled],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no branch, tag or version 'nosuch'" in r.stderr


def test_demo_end_to_end(tmp_path):
    r = procs.run([sys.executable, "-m", "forkpoint.cli.main", "demo", "--dir", str(tmp_path / "d"),
                   "--steps", "30"], timeout=procs.CHILD_SECONDS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SIGKILL" in r.stdout and "bit-identical" in r.stdout and "lr-sweep" in r.stdout


def test_verify_prints_one_line_per_damaged_object_with_what_it_affects(tmp_path):
    import pathlib

    import numpy as np

    url = str(tmp_path / "repo")
    repo = fp.Repo(url, create=True)
    shared = np.arange(300_000, dtype=np.float64)
    for step in range(3):
        repo.save({"w": shared, "b": np.full(1000, step)}, step=step)
    repo.gc(keep=fp.Keep(last=2), grace=0)
    digest = next(leaf for leaf in repo.manifest("main").leaves if leaf.path == "w").chunks[0].objects[0]
    path = next(pathlib.Path(url, "objects").rglob(digest + "*"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "verify", "-r", url],
                       capture_output=True, text=True)
    assert r.returncode == 1
    problems = [line for line in r.stdout.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1, r.stdout
    assert digest in problems[0] and "does not match its hash" in problems[0] and "it holds w of 2 version(s)" in problems[0]
    for ref in ("main", "main~1"):
        assert repo.resolve(ref)[:12] in problems[0]
    assert "2 version(s)" in r.stdout.splitlines()[-1], "the pruned version is not counted as checked"


def test_piped_output_keeps_whole_paths_and_tags_are_listed(tmp_path):
    url = str(tmp_path / "repo")
    repo = fp.Repo(url, create=True)
    name = "exp_avg_of_a_parameter_with_a_long_name_" * 3
    long_path = f"optim/state/{name}"
    repo.save({"optim": {"state": {name: torch.ones(3)}}, "x": torch.zeros(2)}, step=1)
    repo.tag("best", "main")
    cmd = [sys.executable, "-m", "forkpoint.cli.main"]
    shown = subprocess.run([*cmd, "show", "main", "-r", url], capture_output=True, text=True, check=True).stdout
    assert long_path in shown and "…" not in shown
    listed = subprocess.run([*cmd, "tags", "-r", url], capture_output=True, text=True, check=True).stdout
    assert listed.split()[:4] == ["best", repo.resolve("main")[:12], "step", "1"]
    data = json.loads(subprocess.run([*cmd, "tags", "-r", url, "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    assert data == {"best": {"id": repo.resolve("main"), "step": 1}}
    logged = json.loads(subprocess.run([*cmd, "log", "-r", url, "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    assert logged[0]["tags"] == ["best"] and logged[0]["branches"] == ["main"]


def test_long_operations_show_progress_on_a_terminal_only(filled, tmp_path):
    """gc, export and import name what they are doing on a terminal (stderr a tty), and print
    nothing extra when piped."""
    import pty

    for args, text in ((["gc", "-r", filled], "collecting garbage"),
                       (["export", "main", str(tmp_path / "e"), "-r", filled], "exporting main")):
        master, slave = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "forkpoint.cli.main", *args], stdout=subprocess.PIPE,
                                stderr=slave)
        os.close(slave)
        proc.wait(timeout=procs.CHILD_SECONDS)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        os.close(master)
        assert proc.returncode == 0 and text in seen.decode(errors="replace"), (args, seen[-500:])
        piped = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", *args], capture_output=True, text=True)
        assert piped.returncode == 0 and piped.stderr == "", piped.stderr
