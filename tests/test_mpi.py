"""fp.mpi.Repo under mpiexec: blocks of domain-decomposed fields saved on one decomposition and
restored on another, one coordinated commit, failing ranks, and the Gray-Scott example killed
with SIGKILL and resumed on another number of ranks."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import forkpoint as fp
import procs
from forkpoint.format.objects import BLOCK_BYTES

HERE = Path(__file__).parent
ROOT = HERE.parent
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
pytestmark = [pytest.mark.timeout(300), pytest.mark.ranks]


def mpiexec(n: int, *args, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python ARGS` on `n` ranks (oversubscribed on this machine's cores)."""
    assert MPIEXEC, "mpiexec not found: pip install mpich (the test extra has it)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [MPIEXEC, "-n", str(n), sys.executable, *map(str, args)]
    proc = procs.run(cmd, timeout=timeout, env=env)
    if check:
        assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def worker(n: int, name: str, tmp_path: Path, *args, check: bool = True) -> list[dict]:
    out = tmp_path / f"out-{name}"
    out.mkdir(exist_ok=True)
    proc = mpiexec(n, HERE / "mpi_workers.py", name, out, *args, check=check)
    results = [out / f"{name}.{r}.json" for r in range(n)]
    return [json.loads(p.read_text()) if p.exists() else None for p in results], proc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two versions saved by 4 ranks on a 2 x 2 grid of blocks."""
    tmp = tmp_path_factory.mktemp("mpi")
    url = str(tmp / "repo")
    results, _ = worker(4, "save", tmp, url)
    ids = results[0]["ids"]
    assert all(r["ids"] == ids for r in results), "every rank returns the version rank 0 committed"
    return tmp, url, ids, results


def test_blocks_of_every_rank_form_one_global_leaf(saved):
    from mpi_workers import FIELDS, N, field

    tmp, url, ids, results = saved
    repo = fp.Repo(url)
    assert [v.id for v in repo.log()] == ids[::-1], "one version per collective save"
    m = repo.manifest(ids[0])
    leaves = {leaf.path: leaf for leaf in m.leaves}
    assert len(leaves["fields/u"].chunks) >= 4, "each rank's block is a chunk of the one leaf"
    assert sorted(tuple(r["offset"]) for r in results) == [(0, 0), (0, 384), (384, 0), (384, 384)]
    assert len(leaves["fields/u"].chunks) >= 4 and leaves["fields/u"].shape == [4 * N, N]
    state = repo.load(ids[0])
    for name in FIELDS:
        assert np.array_equal(state["fields"][name], field(name)), name
        assert state["fields"][name].dtype == field(name).dtype
    assert state["fields"]["u"].shape == (4 * N, N)
    assert state["params"] == {"F": 0.035, "k": 0.065, "name": "gray-scott", "grid": [N, N]}
    assert (state["t"], state["step"]) == (0.5, 100)
    coef = leaves["coef"]
    stored = sum(c.lengths[0] for c in coef.chunks)
    assert stored == coef.shape[0], "the replicated array is written once, not once per rank"
    everyone = repo.load(ids[0], paths=["rank"], all_ranks=True)["rank"]
    assert [r["rank"] for r in everyone] == [0, 1, 2, 3], "rank-local state is kept per rank"
    assert m.version.meta == {"ranks": 4} and not m.pickle
    assert repo.verify().ok


@pytest.mark.parametrize("ranks", [2, 3])
def test_restore_on_another_decomposition_reads_only_what_each_rank_needs(saved, ranks):
    tmp, url, ids, _ = saved
    out = tmp / f"r{ranks}"
    out.mkdir(exist_ok=True)
    results, _ = worker(ranks, "restore", out, url, ids[1])
    for r in results:
        assert r["version"] == ids[1] and r["wrong"] == [], r
        assert r["coef_ok"] and (r["t"], r["step"]) == (1.0, 200)
        assert r["params"]["name"] == "gray-scott"
        # of each saved block the slab meets, only the 1 MiB blocks covering its rows are read:
        # at most a partial block at either end of the slab beyond what it needs
        assert r["u_bytes_needed"] <= r["u_bytes_read"] <= r["u_bytes_needed"] + 2 * BLOCK_BYTES, r
    whole = 4 * 768 * 768 * 8
    assert sum(r["u_bytes_read"] for r in results) <= whole + ranks * 2 * BLOCK_BYTES, "no rank reads the whole field"


def test_a_rank_that_stalls_makes_every_rank_fail_and_no_version_appears(tmp_path):
    results, _ = worker(4, "stall", tmp_path, str(tmp_path / "repo"))
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not fail"
        assert r["branches"] == {}
    assert "rank(s) [1] did not finish writing within 3 s" in results[0]["error"]
    assert results[0]["seconds"] < 30, "the timeout bounds the wait"
    repo = fp.Repo(str(tmp_path / "repo"))
    assert repo.branches() == {} and not list(repo.store.list("versions/"))


def test_a_rank_killed_during_a_save_leaves_only_committed_versions(tmp_path):
    url = str(tmp_path / "repo")
    results, proc = worker(4, "killed", tmp_path, url, check=False)
    assert proc.returncode != 0, "mpiexec reports the killed rank"
    first = results[0]["first"]
    repo = fp.Repo(url)
    assert [v.id for v in repo.log()] == [first], "the interrupted save published nothing"
    assert repo.verify().ok, "the committed version is intact"
    from mpi_workers import field

    assert np.array_equal(repo.load(first)["fields"]["u"], field("u"))


@pytest.mark.parametrize("node_local", [False, True])
def test_tiers_lossless_codec_and_deltas_work_as_in_fp_repo(tmp_path, node_local):
    """Through a fast tier (shared, or node-local: one node of 4 ranks, rank 0's flushes slowed
    so that each outlasts the next commit) onto a slow one, with codec="lossless" and deltas;
    no flush fails, and every version reads back on another number of ranks from the slow
    tier alone."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    results, _ = worker(4, "tiered", tmp_path, fast, slow, "1" if node_local else "0")
    ids = results[0]["ids"]
    assert all(r["flush_errors"] == [] for r in results), results
    repo = fp.Repo(slow)
    assert [v.id for v in repo.log()] == ids[::-1], "every version reached the slow tier"
    chunks = [[c for leaf in repo.manifest(v).leaves for c in leaf.chunks] for v in ids]
    assert all(c.delta is None for c in chunks[0]) and all(any(c.delta for c in cs) for cs in chunks[1:]), \
        "later versions store deltas against the earlier ones"
    assert repo.verify().ok
    out = tmp_path / "restore"
    out.mkdir()
    results, _ = worker(3, "tiered_restore", out, slow, ",".join(ids))
    assert all(r["wrong"] == [] for r in results), results


def test_a_rank_that_cannot_plan_its_save_makes_every_rank_fail_at_once(tmp_path):
    results, _ = worker(3, "unreadable_head", tmp_path, str(tmp_path / "repo"))
    for rank, r in enumerate(results):
        assert r["raised"] is not None and r["seconds"] < 30, (rank, r)  # the timeout is 60 s
        assert r["last"] == 3, "the next save commits"
    assert "unreadable on this rank" in results[0]["raised"]
    assert [v.step for v in fp.Repo(str(tmp_path / "repo")).log()] == [3, 1]


def _run_example(n: int, url: str, *args, **kwargs) -> subprocess.Popen | subprocess.CompletedProcess:
    return mpiexec(n, ROOT / "examples" / "gray_scott_mpi.py", "--repo", url, "--n", 96, *map(str, args),
                   **kwargs)


def test_gray_scott_killed_and_resumed_on_fewer_ranks_is_bit_identical(tmp_path):
    reference, run = str(tmp_path / "reference"), str(tmp_path / "run")
    _run_example(3, reference, "--steps", 1200, "--every", 100)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [MPIEXEC, "-n", "4", sys.executable, str(ROOT / "examples" / "gray_scott_mpi.py"), "--repo", run,
           "--n", "96", "--steps", "1200", "--every", "100"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(run, "refs", "heads")):
            try:
                if fp.Repo(run).version("main").step >= 200:
                    break
            except fp.errors.ForkpointError:
                pass
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = fp.Repo(run).version("main").step
    assert 200 <= killed_at < 1200, f"killed at step {killed_at}: mid-run"
    _run_example(2, run, "--steps", 1200, "--every", 100)
    a, b = fp.Repo(reference).load("main"), fp.Repo(run).load("main")
    assert a["step"] == b["step"] == 1200
    assert np.array_equal(a["u"], b["u"]) and np.array_equal(a["v"], b["v"]), \
        "4 ranks killed and resumed on 2 end bit-identical to 3 ranks uninterrupted"
    assert fp.Repo(run).version("main").env["world_size"] == 2


def test_gray_scott_fork_with_another_feed_rate_and_diff(tmp_path):
    url = str(tmp_path / "gs")
    _run_example(2, url, "--steps", 400, "--every", 100)
    fork_point = [v for v in fp.Repo(url).log() if v.step == 200][0].id
    _run_example(3, url, "--steps", 400, "--every", 100, "--branch", "feed-0.05", "--F", 0.05,
                 "--fork-from", fork_point)
    repo = fp.Repo(url)
    fork = repo.version("feed-0.05")
    assert fork.step == 400 and repo.load("feed-0.05")["params"]["F"] == 0.05
    divergence = repo.first_divergence("main", "feed-0.05")
    assert divergence.step == 300 and "u" in divergence.paths, divergence
    out = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "diff", "--repo", url, "main", "feed-0.05"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    assert "u" in out.stdout and "params/F" in out.stdout, out.stdout


def test_a_checkpointer_over_mpi_agrees_on_each_save_and_resumes_on_more_ranks(tmp_path):
    """Each rank's policy differs, so only their agreement keeps the collective saves matched;
    every version holds its step's values although the blocks change right after step()."""
    url = str(tmp_path / "repo")
    first, _ = worker(2, "checkpointer", tmp_path, url)
    assert [r["steps"] for r in first] == [[6, 4, 3, 2, 0]] * 2   # rank 0 due at 0,2,4,6; rank 1 at 0,3,6
    assert first[0]["start"] == 0 and first[0]["wrong"] == []
    again, _ = worker(3, "checkpointer", tmp_path, url)
    assert [(r["start"], r["resumed"]) for r in again] == [(7, [6.0])] * 3
    assert again[0]["steps"][:5] == [14, 12, 10, 9, 8] and again[0]["wrong"] == []


def test_fp_mpi_says_how_to_install_mpi4py_when_it_is_missing(tmp_path):
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import forkpoint as fp\n"
            "assert 'mpi4py' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
            "try:\n    fp.mpi.Repo('x')\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    assert "pip install mpi4py mpich" in out.stdout


def test_a_missing_repository_is_refused_on_every_rank(tmp_path):
    results, _ = worker(2, "missing", tmp_path, str(tmp_path / "nowhere"), "rank0")
    assert results[0]["raised"].startswith("RepoNotFoundError") and "create=True" in results[0]["raised"]
    assert results[1]["raised"].startswith("ForkpointError: rank 0 could not open the repository")
    assert not (tmp_path / "nowhere").exists()


def test_a_rank_that_cannot_open_the_repository_fails_every_rank(tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    results, _ = worker(3, "missing", out, str(tmp_path / "repo"), "rank1")
    assert results[1]["raised"].startswith("RepoNotFoundError"), results
    for r in (0, 2):
        assert results[r]["raised"].startswith("ForkpointError: rank(s) [1] could not open"), results


def test_a_block_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        fp.Block(np.zeros((4, 4)), (2, 0), (5, 4))
    with pytest.raises(ValueError, match="same number of dimensions"):
        fp.Block(np.zeros((4, 4)), (0,), (8, 4))


def test_a_single_process_repo_refuses_a_block(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    with pytest.raises(fp.errors.UnsupportedTypeError, match="fp.mpi.Repo"):
        repo.save({"u": fp.Block(np.zeros((4, 4)), (0, 0), (8, 4))})
    assert repo.branches() == {}


def test_load_block_names_what_is_wrong(tmp_path):
    """A missing leaf, a box that does not fit, data that is not an array, a dtype numpy lacks,
    and a damaged object: each a clear error."""
    import torch

    from forkpoint.format.objects import object_key

    repo = fp.Repo(str(tmp_path / "r"), create=True)
    u = np.arange(64 * 64, dtype=np.float64).reshape(64, 64)
    v = repo.save({"u": u, "note": b"x" * 5000, "half": torch.ones(4, dtype=torch.bfloat16)})
    assert np.array_equal(repo.load_block("main", "u", (8, 16), (4, 4)), u[8:12, 16:20])
    with pytest.raises(fp.errors.RefNotFoundError, match="no leaf 'w'"):
        repo.load_block("main", "w", (0, 0), (1, 1))
    with pytest.raises(ValueError, match="does not fit"):
        repo.load_block("main", "u", (60, 0), (8, 8))
    with pytest.raises(ValueError, match="does not fit"):
        repo.load_block("main", "u", (0,), (8,))
    with pytest.raises(fp.errors.UnsupportedTypeError, match="not an array"):
        repo.load_block("main", "note", (0,), (10,))
    with pytest.raises(fp.errors.UnsupportedTypeError, match="numpy lacks"):
        repo.load_block("main", "half", (0,), (2,))
    leaf = next(leaf for leaf in repo.manifest(v.id).leaves if leaf.path == "u")
    key = object_key(leaf.chunks[0].object)
    data = bytearray(repo.store.read(key))
    data[-100] ^= 0xFF
    repo.store.write(key, [bytes(data)])
    fresh = fp.Repo(str(tmp_path / "r"))
    with pytest.raises(fp.errors.CorruptObjectError):
        fresh.load_block("main", "u", (60, 0), (4, 64))
