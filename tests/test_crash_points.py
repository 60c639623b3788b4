"""Crash at every storage operation (the SQLite way): each write, exclusive create, delete
and touch that save, commit, gc, compact, fork/tag and a flush between tiers make is, in
turn, the point where the process dies: that operation and every later one fail. After each
crash a fresh process's view must hold every committed version bit-exact, no half version,
a clean verify, and a next save and gc that work.
"""

import errno
import shutil
import threading

import numpy as np
import pytest

import forkpoint as fp
from helpers.unpaced import encode_every_chunk
from forkpoint.engine.save import SaveOptions
from forkpoint.storage.local import LocalStore

MUTATIONS = ("write", "create_exclusive", "delete", "touch")


class Dead(OSError):
    """What every storage operation raises once the simulated process has died."""

    def __init__(self):
        super().__init__(errno.EIO, "simulated crash: the process died before this storage operation")


class CrashAt:
    """Patches LocalStore so that its `at`-th mutating operation (counting from 0) and all
    later ones raise Dead without touching storage; `at=None` only counts them."""

    def __init__(self, monkeypatch, at: int | None):
        self.at, self.count, self.deletes, self.lock = at, 0, 0, threading.Lock()
        for name in MUTATIONS:
            monkeypatch.setattr(LocalStore, name, self._wrap(getattr(LocalStore, name)))

    @property
    def crashed(self) -> bool:
        return self.at is not None and self.count > self.at

    def _wrap(self, real):
        def op(store, *args, **kwargs):
            if real.__name__ == "delete":
                self.deletes += 1
            with self.lock:
                dead = self.at is not None and self.count >= self.at
                self.count += 1
            if dead:
                raise Dead()
            return real(store, *args, **kwargs)
        return op


def state(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal(3000).astype(np.float32), "b": np.full(7, i, dtype=np.int64),
            "frozen": np.arange(2000, dtype=np.float64), "step": i}


OPTIONS = dict(options=SaveOptions(chunk_bytes=4096, small_leaf_bytes=2048), workers=2)


def open_repo(root, tiered: bool, **extra):
    if tiered:
        repo = fp.Repo(tiers=[fp.tier(str(root / "fast"), keep=1), str(root / "slow")], **OPTIONS, **extra)
    else:
        repo = fp.Repo(str(root / "r"), **OPTIONS, **extra)
    return encode_every_chunk(repo) if extra.get("codec") == "lossless" else repo


def build(root, tiered: bool) -> None:
    """A repository with history: five versions on main, a fork with its own version, a tag."""
    repo = fp.Repo(tiers=[fp.tier(str(root / "fast"), keep=1), str(root / "slow")], create=True, **OPTIONS) \
        if tiered else fp.Repo(str(root / "r"), create=True, **OPTIONS)
    for i in range(5):
        repo.save(state(i), step=i)
    repo.fork("main~3", "alt")
    repo.save(state(10), branch="alt", step=10)
    repo.tag("first", "main~4")
    repo.close()


OPERATIONS = {
    "save": lambda repo: repo.save(state(3), step=3),
    "save lossless": lambda repo: repo.save(state(3), step=3),
    "gc": lambda repo: repo.gc(keep=fp.Keep(last=1), grace=0),
    "compact": lambda repo: repo.compact(codec="lossless"),
    "fork and tag": lambda repo: (repo.fork("main~1", "exp"), repo.tag("best", "alt")),
    "flush": lambda repo: repo.save(state(3), step=3),
}
EXTRA = {"save lossless": {"codec": "lossless"}}
TIERED = {"flush"}


def snapshot(repo) -> dict:
    """Every loadable version (id -> step) and every ref of a fresh view."""
    versions = {v.id: v.step for v in repo.versions() if not v.pruned}
    return {"versions": versions, "branches": repo.branches(), "tags": repo.tags()}


def check(root, tiered: bool, before: dict, operation: str) -> None:
    repo = open_repo(root, tiered)
    try:
        after = snapshot(repo)
        for vid, step in before["versions"].items():
            if vid in after["versions"]:
                assert_state(repo.load(vid), step)
            else:  # only gc may drop a version, and only by pruning it
                assert operation == "gc" and repo.version(vid).pruned, vid
        for name, vid in {**after["branches"], **after["tags"]}.items():
            assert_state(repo.load(vid), repo.version(vid).step)  # no ref names a half version
        for name, vid in before["branches"].items():
            assert name in after["branches"], name
        report = repo.verify()
        assert report.ok, report.problems
        v = repo.save(state(20), step=20)
        repo.gc(grace=0)
        assert_state(open_repo(root, tiered).load(v.id), 20)
    finally:
        repo.close()


def assert_state(out: dict, step: int) -> None:
    expected = state(step)
    assert out["step"] == step
    for k in ("w", "b", "frozen"):
        assert np.array_equal(out[k], expected[k]), (step, k)


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_crash_at_every_storage_operation_loses_nothing_committed(tmp_path, monkeypatch, operation):
    tiered = operation in TIERED
    base = tmp_path / "base"
    build(base, tiered)
    with monkeypatch.context() as m:
        counter = CrashAt(m, None)
        repo = open_repo(shutil.copytree(base, tmp_path / "count"), tiered, **EXTRA.get(operation, {}))
        OPERATIONS[operation](repo)
        repo.close()
    total = counter.count
    assert total >= 2, f"{operation} made {total} storage operations"
    if operation == "gc":
        assert counter.deletes > 5, "gc deleted objects of pruned versions"
    before = snapshot(open_repo(base, tiered))
    for at in range(total):
        root = shutil.copytree(base, tmp_path / f"at{at}")
        with monkeypatch.context() as m:
            crash = CrashAt(m, at)
            repo = open_repo(root, tiered, **EXTRA.get(operation, {}))
            try:
                OPERATIONS[operation](repo)
                repo.drain()
            except (OSError, fp.errors.ForkpointError):
                pass
            try:
                repo.close()
            except (OSError, fp.errors.ForkpointError):
                pass
            assert crash.crashed or crash.count <= at
        check(root, tiered, before, operation)
        shutil.rmtree(root)
