"""Retention and gc: Keep policies, protected heads and tags, dry runs, grace for live savers."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.format.objects import object_key
import procs


def _fill(repo, n, branch="main"):
    out = []
    for s in range(n):
        out.append(repo.save({"w": torch.full((100_000,), s + 10.0), "frozen": torch.ones(100_000)},
                             branch=branch, step=s, metrics={"val_loss": abs(s - 4.2)}))
    return out


def _object_files(repo):
    return {k.rsplit("/", 1)[-1] for k in repo.store.list("objects")}


def test_keep_policies_select_the_right_versions(repo):
    vs = _fill(repo, 10)
    repo.tag("milestone", vs[1].id)
    plan = set(repo.prune_plan(fp.Keep(last=2, every=5, best=("val_loss", 1, "min"))))
    kept = {v.step for v in vs if v.id not in plan}
    assert kept == {9, 8, 0, 5, 4, 1}


def test_non_finite_metrics_are_recorded_and_never_rank_best(repo):
    losses = [float("nan"), 0.7, float("inf"), np.float32(0.3), torch.tensor(float("-inf")), torch.tensor(0.5)]
    vs = [repo.save({"w": torch.full((4,), float(i))}, step=i, metrics={"val_loss": loss, "hist": [loss]},
                    meta={"note": {"x": float("nan")}})
          for i, loss in enumerate(losses)]
    recorded = [fp.Repo(repo.url).version(v.id).metrics["val_loss"] for v in vs]
    assert recorded[0] == "nan" and recorded[2] == "inf" and recorded[4] == "-inf"
    assert recorded[1] == 0.7 and abs(recorded[3] - 0.3) < 1e-7 and recorded[5] == 0.5
    assert vs[0].metrics["hist"] == ["nan"] and vs[0].meta == {"note": {"x": "nan"}}
    plan = set(repo.prune_plan(fp.Keep(last=1, best=("val_loss", 2, "min"))))
    assert {v.step for v in vs if v.id not in plan} == {3, 5}
    with pytest.raises(TypeError, match=r"metrics must be JSON data.*metrics\['bad'\] is of type object, not JSON"):
        repo.save({"w": torch.ones(1)}, metrics={"bad": object()})
    with pytest.raises(TypeError, match=r"meta\['run'\]\['hist'\]\[1\] is of type numpy.ndarray, not JSON data "
                                        r"\(an array: pass .tolist\(\)"):
        repo.save({"w": torch.ones(1)}, meta={"run": {"hist": [1, np.arange(3)]}})
    v = repo.save({"w": torch.ones(1)}, metrics={"loss": torch.tensor([0.5]), "n": np.int64(3)})
    assert v.metrics == {"loss": 0.5, "n": 3}


def test_gc_frees_pruned_data_and_keeps_everything_needed(repo):
    vs = _fill(repo, 6)
    repo.fork(vs[2].id, "side")
    before = _object_files(repo)
    dry = repo.gc(keep=fp.Keep(last=1), grace=0, dry_run=True)
    assert _object_files(repo) == before and dry.dry_run
    assert set(dry.pruned_versions) == {vs[0].id, vs[1].id, vs[3].id, vs[4].id}
    report = repo.gc(keep=fp.Keep(last=1), grace=0)
    assert report.freed_bytes == dry.freed_bytes > 0 and report.deleted_objects == 3
    fresh = fp.Repo(repo.url)
    assert [v.pruned for v in fresh.log("main")] == [False, True, True, False, True, True]
    assert torch.equal(fresh.load("main")["w"], torch.full((100_000,), 15.0))
    assert torch.equal(fresh.load("side")["w"], torch.full((100_000,), 12.0))
    assert torch.equal(fresh.load("main")["frozen"], torch.ones(100_000)), "shared objects survive"
    assert fresh.verify().ok


def test_grace_protects_objects_of_a_save_in_flight(repo):
    _fill(repo, 2)
    orphan = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    from forkpoint.format.objects import content_hash, pack_header

    digest = content_hash(orphan)
    repo.store.write(object_key(digest), [pack_header(0, orphan.nbytes), orphan])
    _age(repo, object_key(digest), 60)
    other = fp.Repo(repo.url)
    other.leases.hold(other.store)  # another process that saves
    assert repo.gc(grace=600).deleted_objects == 0
    assert repo.store.exists(object_key(digest))
    assert repo.gc(grace=0).deleted_objects == 1
    assert not repo.store.exists(object_key(digest))
    other.close()


def _referenced(repo):
    return {o for name in repo.branches() for v in repo.log(name) if not v.pruned
            for leaf in repo.manifest(v.id).leaves for c in leaf.chunks for o in c.objects}


def _age(repo, key, seconds):
    path = os.path.join(repo.url, key)
    then = time.time() - seconds
    os.utime(path, (then, then))


FOREIGN_WRITER = """
import os, sys, torch, forkpoint as fp
repo = fp.Repo(sys.argv[1])
repo.save({"w": torch.full((1000,), -1.0)}, branch="other")
print("saved", flush=True)
sys.stdin.read()  # a live saver until the test says otherwise
os._exit(0)  # exits without closing: its writer lease stays
"""


def test_gc_frees_what_pruning_freed_at_once_unless_another_process_may_be_saving(repo):
    """The grace period is for other processes' saves in flight: with no other writer lease
    younger than it, gc removes the objects of the versions it prunes right away (a Keep of
    2 leaves 2 versions on disk, not every version of the last 10 minutes)."""
    vs = _fill(repo, 5)
    assert repo.store.list("writers") == [repo.leases.key()]
    for key in repo.store.list("objects"):
        _age(repo, key, 60)  # saved a minute ago, as by a loop that saves every few seconds
    report = repo.gc(keep=fp.Keep(last=2))
    assert report.others_writing == [] and report.deleted_objects == 2  # step 0's pack holds "frozen" too
    assert _object_files(repo) == _referenced(repo) == {o for v in vs[3:] for leaf in repo.manifest(v.id).leaves
                                                        for c in leaf.chunks for o in c.objects}
    assert repo.verify().ok and torch.equal(repo.load("main~1")["w"], torch.full((100_000,), 13.0))

    _fill(repo, 3)
    foreign_writer = subprocess.Popen([sys.executable, "-c", FOREIGN_WRITER, repo.url], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
    assert foreign_writer.stdout.readline() == "saved\n"
    for key in repo.store.list("objects"):
        _age(repo, key, 60)
    foreign = [k for k in repo.store.list("writers") if k != repo.leases.key()]
    assert len(foreign) == 1
    before = _object_files(repo)
    report = repo.gc(keep=fp.Keep(last=2), branches=["main"])
    assert report.others_writing == [repo.url] and report.deleted_objects == 0 and _object_files(repo) == before
    foreign_writer.kill()
    foreign_writer.wait()
    report = repo.gc(keep=fp.Keep(last=2), branches=["main"])
    assert report.others_writing == [], "the lease of a process of this host that is gone does not count"
    assert report.deleted_objects > 0 and _object_files(repo) == _referenced(repo)
    assert repo.store.list("writers") == [repo.leases.key()], "a dead process's lease is removed"
    assert repo.verify().ok and torch.equal(repo.load("other")["w"], torch.full((1000,), -1.0))

    remote = "writers/elsewhere-1-abc.json"
    repo.store.write(remote, [json.dumps({"writer": "elsewhere:1:abc", "host": "elsewhere", "pid": 1}).encode()])
    assert repo.gc(grace=600).others_writing == [repo.url], "another host's young lease counts"
    _age(repo, remote, 700)
    assert repo.gc(grace=600).others_writing == []
    assert repo.store.list("writers") == [repo.leases.key()], "a lease older than the grace period is removed"
    repo.close()
    assert repo.store.list("writers") == [], "close removes this process's lease"
    script = FOREIGN_WRITER.replace("os._exit(0)", "fp.Repo(sys.argv[1]).gc()  # exits without close")
    subprocess.run([sys.executable, "-c", script, repo.url], check=True, timeout=procs.CHILD_SECONDS, input="", capture_output=True)
    assert repo.store.list("writers") == [], "a process that exits normally leaves no lease; gc alone writes none"


def test_gc_with_no_other_writer_keeps_what_was_written_in_the_last_seconds(repo):
    """A writer that starts after gc looked at the leases writes its lease first, so what it
    writes is newer than that look: gc keeps unreferenced objects of the last QUIET_MARGIN
    seconds (and, while another lease is fresh, of the whole grace period)."""
    from forkpoint.format.objects import content_hash, pack_header
    from forkpoint.repo.writers import QUIET_MARGIN

    _fill(repo, 1)
    orphan = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    key = object_key(content_hash(orphan))
    repo.store.write(key, [pack_header(0, orphan.nbytes), orphan])
    assert repo.gc().deleted_objects == 0 and repo.store.exists(key)
    _age(repo, key, QUIET_MARGIN + 5)
    assert repo.gc().deleted_objects == 1 and not repo.store.exists(key)


def test_dedup_of_unchanged_leaves_costs_no_bytes(repo):
    frozen = torch.randn(500_000)
    v1 = repo.save({"frozen": frozen, "w": torch.randn(10)})
    v2 = repo.save({"frozen": frozen.clone(), "w": torch.randn(10)})
    assert v1.stored_bytes > 2_000_000 and v2.stored_bytes < 5_000
    assert v2.logical_bytes == v1.logical_bytes


def test_checkpointer_applies_retention(repo):
    model = torch.nn.Linear(100, 100)
    ck = fp.Checkpointer(repo, {"model": model}, every=2, keep=fp.Keep(last=2), gc_grace=0)
    for step in range(10):
        ck.wait_capture()
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.step(step)
    ck.close()
    log = repo.log("main")
    assert [v.step for v in log] == [8, 6, 4, 2, 0]
    assert [v.pruned for v in log] == [False, False, True, True, True]
    assert len(_object_files(repo)) <= 3 * 2


def test_checkpointer_retention_takes_a_bounded_share_of_the_time(repo, monkeypatch):
    """A gc pass whose scan takes much CPU (a long history) is not run after every save: at
    most about RETENTION_SHARE of a core goes to it, and close() still applies retention."""
    from forkpoint.checkpointer.retention import RETENTION_SHARE

    passes = []
    real_sweep = repo.maintenance._gc_store

    def slow_sweep(*args):
        passes.append(time.monotonic())
        busy_until = time.thread_time() + 0.2
        while time.thread_time() < busy_until:
            pass
        return real_sweep(*args)

    monkeypatch.setattr(repo.maintenance, "_gc_store", slow_sweep)
    ck = fp.Checkpointer(repo, {"w": torch.zeros(1000)}, every=1, keep=fp.Keep(last=2), gc_grace=0)
    start = time.monotonic()
    for step in range(40):
        ck.state["w"] = torch.full((1000,), float(step))
        ck.step(step)
        time.sleep(0.02)
    elapsed = time.monotonic() - start
    ck.close()
    allowed = 2 + elapsed * RETENTION_SHARE / 0.2
    assert 2 <= len(passes) <= allowed, (len(passes), elapsed)
    log = repo.log("main")
    assert len(log) == 40 and [v.pruned for v in log].count(False) == 2
    assert torch.equal(repo.load("main")["w"], torch.full((1000,), 39.0))


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_close_applies_retention_to_saves_committed_after_the_last_pass(repo, monkeypatch, sync):
    """Passes are spaced out (RETENTION_SHARE); whatever committed after the last one, even
    saves already collected by step(), is retained by close()."""
    import forkpoint.checkpointer.retention as retention

    monkeypatch.setattr(retention, "RETENTION_SHARE", 1e-6)
    ck = fp.Checkpointer(repo, {"w": torch.zeros(1000)}, every=2, keep=fp.Keep(last=2), gc_grace=0, sync=sync)
    for step in range(10):
        ck.state["w"] = torch.full((1000,), float(step))
        if step == 9:
            time.sleep(0.5)  # step 8's save commits, and step(9) collects it
        ck.step(step)
    ck.close()
    assert [v.pruned for v in repo.log("main")] == [False, False, True, True, True]


def test_gc_beside_saves_of_the_same_process_loses_nothing(tmp_path):
    """gc with grace=0 while this process saves: its temp files and the objects of versions
    committed after gc read the manifests are left alone."""
    import threading

    repo = fp.Repo(str(tmp_path / "r"), create=True)
    stop, errors = threading.Event(), []

    def collect():
        while not stop.is_set():
            try:
                repo.gc(keep=fp.Keep(last=2), grace=0)
            except Exception as e:  # reported below
                errors.append(e)

    t = threading.Thread(target=collect)
    t.start()
    try:
        for i in range(25):
            repo.save({"w": torch.full((300_000,), float(i)), "i": i}, step=i)
            assert repo.load("main")["i"] == i
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert repo.verify("main").ok and repo.load("main")["i"] == 24


def test_gc_reads_each_stub_once_and_again_only_when_it_is_replaced(tmp_path):
    """A long history is mostly stubs of pruned versions: gc reads one once, then only checks
    its signature; a stub replaced by a full manifest (another process's flush) is read again."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    vs = _fill(repo, 6)
    full_first = repo.store.read(f"versions/{vs[0].id}.json")
    repo.gc(keep=fp.Keep(last=2))
    reads = []
    real_read = repo.store.read

    def counting_read(key):
        reads.append(key)
        return real_read(key)

    repo.store.read = counting_read
    repo.gc(keep=fp.Keep(last=2))
    stubs = {f"versions/{v.id}.json" for v in vs[:4]}
    assert not stubs & set(reads), "stubs met by the first gc were read again"
    repo.store.write(f"versions/{vs[0].id}.json", [full_first])
    reads.clear()
    assert repo.gc(grace=0).deleted_objects > 0
    assert f"versions/{vs[0].id}.json" in reads
    assert torch.equal(fp.Repo(str(tmp_path / "r")).load(vs[0].id)["w"], torch.full((100_000,), 10.0))


def test_gc_removes_the_records_of_refs_deleted_longer_ago_than_the_grace(repo):
    """Deleted tags (a Trainer's old `checkpoint-<step>` tags) must not cost every later listing
    of refs a read each: gc drops all their records once older than the grace period."""
    repo.save({"x": 1})
    for i in range(5):
        repo.tag(f"checkpoint-{i}", "main")
    repo.fork("main", "scratch")
    for i in range(4):
        repo.delete_tag(f"checkpoint-{i}")
    repo.delete_branch("scratch")
    repo.gc()
    assert len({k.split("/")[2] for k in repo.store.list("refs/tags")}) == 5, "a young deletion is kept"
    repo.gc(grace=0)
    assert repo.store.list("refs/tags") == repo.store.list("refs/tags/checkpoint-4")
    assert not repo.store.list("refs/heads/scratch") and repo.store.list("refs/heads/main")
    assert set(repo.tags()) == {"checkpoint-4"} and set(repo.branches()) == {"main"}
    repo.tag("checkpoint-0", "main")
    repo.fork("main", "scratch")
    assert set(fp.Repo(repo.url).tags()) == {"checkpoint-0", "checkpoint-4"}
    assert "scratch" in fp.Repo(repo.url).branches()


def test_files_forkpoint_did_not_write_are_left_alone_and_gc_still_works(tmp_path):
    """A stray file under objects/ (an editor's backup, an NFS .nfs file of a deleted object
    still open) or under versions/ is never read as forkpoint's, never deleted, and does not
    stop gc; gc names the ones under objects/."""
    url = str(tmp_path / "r")
    repo = fp.Repo(url, create=True)
    repo.save({"w": torch.zeros(4)}, step=0)
    repo.save({"w": torch.ones(4)}, step=1)
    strays = [os.path.join(url, "objects", "ab", ".nfs000000000123"), os.path.join(url, "objects", "notes.txt"),
              os.path.join(url, "versions", "README.json"), os.path.join(url, "versions", "old", "x.json")]
    for path in strays:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("not forkpoint's")
        os.utime(path, (time.time() - 86400, time.time() - 86400))
    report = repo.gc(keep=fp.Keep(last=1), grace=0)
    assert report.deleted_objects == 1 and report.pruned_versions
    assert sorted(report.left_alone) == ["objects/ab/.nfs000000000123", "objects/notes.txt"]
    assert all(os.path.exists(p) for p in strays)
    assert len(repo.version_ids()) == 2 and repo.verify().ok
    assert torch.equal(repo.load("main")["w"], torch.ones(4))
    out = procs.run([sys.executable, "-m", "forkpoint.cli.main", "gc", "--grace", "0", "-r", url],
                    timeout=procs.CHILD_SECONDS)
    assert out.returncode == 0 and "left alone 2 file(s) under objects/" in out.stdout, out.stdout + out.stderr
    repo.close()


def test_a_repository_is_not_created_over_files_where_it_keeps_its_own(tmp_path):
    """create=True where tmp/ (or objects/, versions/, refs/) already holds files and there is
    no marker: refused, naming them, nothing written; a directory with other files, or with a
    concurrent creator's temp file, is fine."""
    from forkpoint.errors import StoreUnavailableError

    home = tmp_path / "project"
    (home / "tmp").mkdir(parents=True)
    (home / "tmp" / "notes.txt").write_text("mine")
    with pytest.raises(StoreUnavailableError, match=r"already holds files in tmp/.*new or empty directory"):
        fp.Repo(str(home), create=True)
    assert sorted(os.listdir(home)) == ["tmp"] and (home / "tmp" / "notes.txt").read_text() == "mine"
    (tmp_path / "run" / "tmp").mkdir(parents=True)
    (tmp_path / "run" / "train.log").write_text("log")
    # another process creating it at the same moment writes its marker through tmp/ first
    (tmp_path / "run" / "tmp" / "0123456789abcdef-1f2e-0").write_text("{}")
    repo = fp.Repo(str(tmp_path / "run"), create=True)
    repo.save({"w": torch.ones(1)})
    assert fp.Repo(str(tmp_path / "run"), create=True).version("main").id == repo.version("main").id
    repo.close()


def test_a_checkpointer_keeping_best_by_a_metric_no_version_records_warns_once(repo):
    """Keep(best=("val_loss", ...)) while the loop logs only "loss": once retention prunes,
    a warning says no version is kept as best and which metrics are recorded; a run that
    records the metric gets no warning and keeps its best version."""
    import warnings

    model = torch.nn.Linear(2, 2)
    ck = fp.Checkpointer(repo, {"m": model}, every=1, sync=True, keep=fp.Keep(last=2, best=("val_loss", 1, "min")))
    with pytest.warns(UserWarning) as caught:
        for step in range(6):
            ck.step(step, metrics={"loss": 1.0 / (step + 1)})
        ck.close()
    messages = [str(w.message) for w in caught if "none is kept as best" in str(w.message)]
    assert len(messages) == 1, messages
    assert "ranks versions by 'val_loss', which no version records (they record: loss)" in messages[0]

    ok = fp.Checkpointer(repo, {"m": model}, every=1, sync=True, branch="recorded",
                         keep=fp.Keep(last=2, best=("val_loss", 1, "min")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(6):
            ok.step(step, metrics={"val_loss": abs(step - 2)})
        ok.close()
    kept = [v.step for v in repo.log("recorded") if not v.pruned]
    assert kept == [5, 4, 2]
