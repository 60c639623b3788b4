"""Storage tiers: commit fast, flush in the background, evict per tier, fall back on loss."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.errors import PrunedVersionError

HERE = os.path.dirname(__file__)


def mem():
    return f"mem://{uuid.uuid4().hex}"


def state(i):
    return {"w": torch.full((300_000,), float(i)), "frozen": torch.arange(300_000.0), "i": i}


def train(model, opt, ck, steps: int, inputs: tuple) -> None:
    """Run `steps` optimizer steps on random inputs, checkpointing after each."""
    for step in range(steps):
        model(torch.randn(*inputs)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.step(step)


def test_commit_fast_flush_and_evict(tmp_path):
    fast, disk = mem(), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=2), disk], create=True)
    ids = [repo.save(state(i), step=i).id for i in range(5)]
    repo.close()
    repo = fp.Repo(tiers=[fast, disk])
    in_fast = [v for v in ids if repo.stores[0].exists(f"versions/{v}.json")]
    assert in_fast == ids[-2:], "the memory tier keeps 2"
    assert all(repo.stores[1].exists(f"versions/{v}.json") for v in ids), "every version reached disk"
    assert repo.where(ids[0]) == [repo.stores[1].url] and len(repo.where(ids[-1])) == 2
    for i, v in enumerate(ids):
        assert repo.load(v)["i"] == i
    assert [v.step for v in repo.log()] == [4, 3, 2, 1, 0]
    n_objects = len(repo.stores[0].list("objects"))
    assert n_objects <= 2 * 2, "objects of evicted versions left the memory tier"
    repo.close()


def test_losing_the_fast_tier_loses_nothing_flushed(tmp_path):
    scratch, disk = str(tmp_path / "scratch"), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(scratch, keep=3), disk], create=True)
    for i in range(4):
        repo.save(state(i), step=i)
    repo.close()
    shutil.rmtree(scratch)
    repo = fp.Repo(tiers=[scratch, disk])
    assert repo.version("main").step == 3
    assert [repo.load(v.id)["i"] for v in repo.log()] == [3, 2, 1, 0]
    v = repo.save(state(4), step=4)
    assert v.parents == [repo.resolve("main~1")]
    repo.close()


def test_corrupt_fast_copy_falls_back_to_slower_tier(tmp_path):
    fast, disk = str(tmp_path / "fast"), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fast, disk], create=True)
    v = repo.save(state(7), step=7)
    repo.close()
    obj = next(c.object for leaf in fp.Repo(disk).manifest().leaves for c in leaf.chunks)
    path = os.path.join(fast, "objects", obj[:2], obj)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    repo = fp.Repo(tiers=[fast, disk])
    assert repo.load(v.id)["i"] == 7
    assert not repo.verify().ok, "verify still reports the corrupt copy"
    os.unlink(path)
    assert torch.equal(fp.Repo(tiers=[fast, disk]).load()["w"], state(7)["w"])


def test_flush_every_keeps_lineage_with_stubs(tmp_path):
    fast, disk = mem(), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=2, flush_every=3), disk], create=True)
    for i in range(9):
        repo.save(state(i), step=i)
    repo.close()
    slow = fp.Repo(disk)
    log = slow.log()
    assert [v.step for v in log] == [8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert [v.step for v in log if not v.pruned] == [8, 5, 2]
    assert slow.load("main")["i"] == 8


def test_the_writing_process_sees_unflushed_evicted_versions_as_gone(tmp_path):
    """A version evicted from the fast tier without being flushed (flush_every) is gone: the
    process that saved it reports it pruned, on no tier, and refuses to load it, as a fresh
    process does, although the disk tier got its stub while the version was still live above."""
    fast, disk = str(tmp_path / "fast"), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=2, flush_every=5), disk], create=True)
    ids = [repo.save(state(i), step=i).id for i in range(7)]
    repo.drain()
    for r in (repo, fp.Repo(tiers=[fast, disk])):
        assert [(v.step, v.pruned) for v in r.log()] == [
            (6, False), (5, False), (4, False), (3, True), (2, True), (1, True), (0, True)]
        assert [r.where(i) for i in ids] == [[]] * 4 + [[disk], [fast], [fast]]
        with pytest.raises(PrunedVersionError, match="flush_every"):
            r.load(ids[3])
        assert r.load(ids[4])["i"] == 4
    repo.close()


def test_last_tier_keep_prunes(tmp_path):
    repo = fp.Repo(tiers=[mem(), fp.tier(str(tmp_path / "disk"), keep=2)], create=True)
    for i in range(5):
        repo.save(state(i), step=i)
    repo.close()
    log = fp.Repo(str(tmp_path / "disk")).log()
    assert [v.pruned for v in log] == [False, False, True, True, True]


def test_prefetch_promotes_and_evicts_farthest_next_use(tmp_path):
    fast, disk = mem(), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=2), disk], create=True)
    ids = [repo.save(state(i), step=i).id for i in range(6)]
    repo.drain()
    assert not repo.stores[0].exists(f"versions/{ids[0]}.json")
    order = [ids[1], ids[0], ids[5]]
    for t in repo.prefetch([ids[1]], order=order):
        t.result()
    on_fast = {v for v in ids if repo.stores[0].exists(f"versions/{v}.json")}
    assert ids[1] in on_fast and ids[5] in on_fast and len(on_fast) == 2
    for t in repo.prefetch([ids[0]]):
        t.result()
    on_fast = {v for v in ids if repo.stores[0].exists(f"versions/{v}.json")}
    assert on_fast == {ids[0], ids[5]}, "ids[1] was used already and is not needed again"
    assert repo.load(ids[0])["i"] == 0
    repo.close()


@pytest.fixture
def shm():
    """A fresh directory in /dev/shm, removed afterwards (skips where there is none)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/fp-test-{uuid.uuid4().hex}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_shm_tier_survives_a_crash(tmp_path, shm):
    disk = str(tmp_path / "disk")
    script = (
        "import sys, numpy as np, forkpoint as fp\n"
        f"r = fp.Repo(tiers=[fp.tier({shm!r}, keep=3), fp.tier({disk!r})], create=True)\n"
        "i = 0\n"
        "while True:\n"
        "    r.save({'w': np.full(100_000, i, dtype=np.float32), 'i': i}, step=i)\n"
        "    print(i, flush=True)\n"
        "    i += 1\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    for _ in range(30):
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    repo = fp.Repo(tiers=[shm, disk])
    newest = repo.version("main")
    assert newest.step >= 29
    assert repo.load("main")["i"] == newest.step
    assert repo.verify().ok
    repo.close()


def test_flushes_a_killed_process_left_undone_are_finished_on_resume(tmp_path, shm):
    """Versions committed on /dev/shm whose flush a SIGKILL cut off reach the disk tier once
    the restarted job resumes; a live writer's tier is left to that writer."""
    disk = str(tmp_path / "disk")
    script = (
        "import os, signal, numpy as np, forkpoint as fp\n"
        f"r = fp.Repo(tiers=[fp.tier({shm!r}, keep=3), fp.tier({disk!r})], create=True)\n"
        "for i in range(6):\n"
        "    r.save({'w': np.full(16 << 20, i, dtype=np.float32), 'i': i}, step=i)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -signal.SIGKILL
    fast = fp.Repo(shm)
    newest = fast.version("main")
    slow = fp.Repo(disk)
    below = slow.version("main").step if slow.head("main") else -1
    assert below < newest.step, "the kill left no flush undone; the test proves nothing"
    repo = fp.Repo(tiers=[fp.tier(shm, keep=3), fp.tier(disk)])
    w = np.zeros(16 << 20, np.float32)
    ck = fp.Checkpointer(repo, {"w": w}, every=1)
    assert ck.resume(strict=False) == newest.step + 1
    assert w[0] == newest.step
    ck.close()
    repo.close()
    slow = fp.Repo(disk)
    assert slow.version("main").id == newest.id
    assert slow.load("main")["i"] == newest.step
    assert slow.verify().ok
    with fp.Repo(tiers=[fp.tier(shm, keep=3), fp.tier(disk)]) as other:
        other.save({"i": -1}, branch="live", step=0)
        other.leases.hold(other.stores[0])
        with fp.Repo(tiers=[fp.tier(shm, keep=3), fp.tier(disk)]) as late:
            assert late.leases.others_alive(late.stores[0])
            assert late.finish_flushes() == []


def test_async_checkpointer_with_tiers(tmp_path):
    fast, disk = mem(), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=1), disk], create=True)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=1)
    train(model, opt, ck, steps=6, inputs=(8, 256))
    ck.close()
    repo.close()
    slow = fp.Repo(disk)
    assert [v.step for v in slow.log()] == [5, 4, 3, 2, 1, 0]
    assert torch.equal(slow.load()["model"]["weight"], model.weight.detach())
    stats = fp.Repo(tiers=[fast, disk]).stats()
    assert "resources" in stats


def test_gc_sweeps_every_tier(tmp_path):
    fast, disk = str(tmp_path / "fast"), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fast, disk], create=True)
    for i in range(4):
        repo.save(state(i), step=i)
    repo.drain()
    before = [len(st.list("objects")) for st in repo.stores]
    report = repo.gc(keep=fp.Keep(last=1), grace=0)
    after = [len(st.list("objects")) for st in repo.stores]
    assert len(report.pruned_versions) == 3
    assert all(a < b for a, b in zip(after, before)), (before, after)
    assert repo.load("main")["i"] == 3 and repo.verify().ok
    repo.close()


def test_memory_tier_holds_only_verified_bytes(tmp_path):
    """Reads from this process's memory tier skip re-hashing, so nothing unverified may enter
    it: a prefetch of a corrupt disk object is refused, and verify() still re-hashes."""
    from forkpoint.errors import CorruptObjectError
    from forkpoint.format.objects import object_key

    fast, disk = mem(), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=1), disk], create=True)
    ids = [repo.save(state(i), step=i).id for i in range(3)]
    repo.drain()
    assert not repo.stores[0].exists(f"versions/{ids[0]}.json")
    obj = next(c.object for leaf in repo.manifest(ids[0]).leaves for c in leaf.chunks if leaf.path == "w")
    path = tmp_path / "disk" / "objects" / obj[:2] / obj
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError, match=obj):
        for t in repo.prefetch([ids[0]]):
            t.result()
    assert not repo.stores[0].exists(object_key(obj)), "the damaged copy never reached memory"
    head = repo.manifest(ids[2])
    key = object_key(next(c.object for leaf in head.leaves for c in leaf.chunks if leaf.path == "w"))
    blob = bytearray(repo.stores[0].read(key))
    blob[-5] ^= 0xFF
    repo.stores[0]._data[key] = bytes(blob)
    assert any(key in p for p in repo.verify(ids[2]).problems), "verify re-hashes the memory tier"
    repo.close()


def test_manifest_records_the_tiers_and_show_says_which_hold_it(tmp_path):
    from click.testing import CliRunner

    from forkpoint.cli.main import cli

    fast, disk = str(tmp_path / "fast"), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=1), fp.tier(disk, flush_every=2)], create=True)
    ids = [repo.save(state(i), step=i).id for i in range(3)]
    repo.drain()
    tiers = repo.manifest(ids[0]).version.tiers
    assert [(t["url"], t["keep"], t["flush_every"]) for t in tiers] == [
        (fp.Repo(fast).url, 1, 1), (fp.Repo(disk).url, None, 2)]
    assert repo.where(ids[1]) == [fp.Repo(disk).url], "flushed (2nd version), then evicted from the fast tier"
    repo.close()
    out = CliRunner().invoke(cli, ["show", ids[1], "--repo", disk]).output
    assert "tier 0" in out and "does not hold it now" in out and "tier 1" in out and "holds it" in out


def test_eviction_never_drops_a_version_whose_commit_is_in_flight(tmp_path):
    """Found by a flaky CI run: a flush's eviction ran between a commit's manifest write and its
    ref publish, took the new manifest for the oldest excess version and evicted the head."""
    from conftest import race_before_publish

    fast, disk = str(tmp_path / "fast"), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=1), disk], create=True)
    repo.save(state(0), step=0)
    repo.drain()
    race_before_publish(repo, lambda: repo.placement.evict(0))
    v1 = repo.save(state(1), step=1)
    repo.drain()
    assert repo.where(v1.id)[0] == fp.Repo(fast).url, "the new head stays on the fast tier"
    assert repo.load(v1.id)["i"] == 1 and not repo.version(v1.id).pruned
    assert fp.Repo(disk).load(v1.id)["i"] == 1
    repo.close()


def test_memory_tier_adopts_captured_buffers_and_flushes_them_byte_exact(tmp_path, monkeypatch):
    """Raw chunks of a save into a memory tier are captured straight into the store's own
    buffers (no second copy); a chunk that already exists gives its buffer back; the flush to
    disk writes identical objects."""
    from forkpoint.format.objects import decode_object, object_key
    from forkpoint.storage.memory import MemoryStore

    adopted, released = [], []
    monkeypatch.setattr(MemoryStore, "adopt", lambda self, key, buf: (adopted.append(key), self._put(key, buf)))
    monkeypatch.setattr(MemoryStore, "release_buffer",
                        lambda self, buf: (released.append(buf.nbytes), self._keep_spare(buf)))
    fast, disk = mem(), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(fast, keep=2), disk], create=True)
    big = {"w": torch.randn(1_500_000), "b": torch.randn(700_000), "small": torch.ones(10)}
    first = repo.save(big, step=0)
    keys = {object_key(c.object) for leaf in repo.manifest(first.id).leaves for c in leaf.chunks
            if leaf.path in ("w", "b")}
    assert keys <= set(adopted), "large raw chunks are adopted, not copied"
    repo.save(big, step=1)
    assert len(released) >= 2, "a chunk already stored gives its captured buffer back"
    repo.drain()
    for key in keys:
        on_disk = (tmp_path / "disk" / key).read_bytes()
        assert on_disk == bytes(repo.stores[0].read(key))
        decode_object(on_disk, key.rsplit("/", 1)[-1], key)
    repo.close()
    again = fp.Repo(disk).load(first.id)
    assert torch.equal(again["w"], big["w"]) and torch.equal(again["b"], big["b"])


@pytest.mark.parametrize("shape", ["aligned", "aligned+tail", "header+aligned", "unaligned-small",
                                   "unaligned-large", "odd-pieces"])
def test_direct_writes_of_any_part_layout_read_back_exactly(tmp_path, shape, monkeypatch):
    import mmap

    import numpy as np

    from forkpoint.storage.local import LocalStore, direct_eligible

    def aligned(n):
        return np.frombuffer(mmap.mmap(-1, n), np.uint8)

    rng = np.random.default_rng(0)
    body = aligned(3 << 20)
    body[:] = rng.integers(0, 256, body.size, dtype=np.uint8)
    header = rng.integers(0, 256, 8192, dtype=np.uint8).tobytes()
    parts = {"aligned": [body], "aligned+tail": [body[:(2 << 20) + 777]],
             "header+aligned": [header, body], "unaligned-small": [bytes(body[:1 << 20])],
             "unaligned-large": [header[:100], body[1:], body[:5000]],
             "odd-pieces": [body[i * 333_333 + 7:(i + 1) * 333_333] for i in range(9)] + [header, body]}[shape]
    assert direct_eligible(parts)
    flags = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, f, *a: (flags.append(f), real_open(path, f, *a))[1])
    store = LocalStore(str(tmp_path / "s"))
    store.write("objects/x", parts)
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert (tmp_path / "s" / "objects" / "x").read_bytes() == expected
    if store.direct_io:
        assert any(f & os.O_DIRECT for f in flags), "the file system takes O_DIRECT, so it was used"
    assert not direct_eligible([header]), "small files go through the page cache"


def test_checkpointer_reserves_the_memory_tier_buffers_up_front(tmp_path, monkeypatch):
    """With a memory tier, building the Checkpointer faults in object buffers for keep + 1
    versions, and no staging buffers for the chunks the store adopts: the first keep + 1
    saves take no fresh memory (later ones reuse evicted versions' buffers)."""
    from forkpoint.storage import memory

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    repo = fp.Repo(tiers=[fp.tier(mem(), keep=2, flush_every=5), str(tmp_path / "disk")], create=True)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=1)
    store = repo.stores[0]
    large = [p for p in list(model.parameters()) + [s for st in opt.state.values() for s in st.values()]
             if p.nbytes >= 1 << 20]
    assert store._spare_bytes >= 3 * sum(p.nbytes for p in large), "keep + 1 versions reserved"
    assert repo.staging.kept < sum(p.nbytes for p in large), "adopted chunks take no staging"
    fresh = []
    real = memory._aligned
    monkeypatch.setattr(memory, "_aligned", lambda n: (fresh.append(n), real(n))[1])
    train(model, opt, ck, steps=3, inputs=(4, 1024))
    ck.close()
    repo.drain()
    assert not fresh, f"saves allocated fresh buffers of {fresh} bytes despite the reservation"
    restored = repo.load("main")
    assert restored["model"]["0.weight"].data_ptr() != model[0].weight.data_ptr()
    assert torch.equal(restored["model"]["0.weight"], model[0].weight.detach())
    assert len(repo.log()) == 3 and repo.where("main") == [store.url]
    repo.close()


def test_flush_between_file_tiers_maps_the_source_and_writes_direct(tmp_path, monkeypatch):
    """A flush from a file tier (say /dev/shm) maps each large object instead of reading it into
    fresh memory, so the destination disk takes it with O_DIRECT; objects arrive identical."""
    from forkpoint.storage import local

    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    repo = fp.Repo(tiers=[fp.tier(shm, keep=1), disk], create=True)
    reads, direct = [], []
    real_read, real_direct = local.LocalStore.read, local.LocalStore._write_direct
    monkeypatch.setattr(local.LocalStore, "read", lambda self, key: (reads.append(key), real_read(self, key))[1])
    monkeypatch.setattr(local.LocalStore, "_write_direct",
                        lambda self, tmp, parts: (direct.append(self.root), real_direct(self, tmp, parts))[1])
    v = repo.save({"w": torch.randn(600_000), "tiny": torch.ones(3)}, step=0)
    repo.drain()
    big = next(c.object for leaf in repo.manifest(v.id).leaves for c in leaf.chunks if leaf.path == "w")
    key = f"objects/{big[:2]}/{big}"
    assert key not in reads, "the large object was mapped, not read"
    assert (tmp_path / "disk" / key).read_bytes() == (tmp_path / "shm" / key).read_bytes()
    if repo.stores[1].direct_io:
        assert os.path.abspath(disk) in direct, "the flush wrote with O_DIRECT"
    repo.close()
    assert torch.equal(fp.Repo(disk).load(v.id)["w"], fp.Repo(shm).load(v.id)["w"])


def test_memory_tier_reserves_only_what_the_machine_can_spare(monkeypatch):
    from forkpoint.storage import memory

    store = memory.MemoryStore.named(uuid.uuid4().hex)
    monkeypatch.setattr(memory, "_available_bytes", lambda: 10 << 20)
    reserved = store.reserve([2 << 20] * 8 + [100])
    assert reserved == 4 << 20, "two 2 MiB buffers fit in half of 10 MiB; the tiny size is skipped"
    monkeypatch.setattr(memory, "_available_bytes", lambda: None)
    assert store.reserve([2 << 20] * 2) == 4 << 20, "unknown availability: reserve as asked"
    buf = store.object_buffer(2 << 20)
    assert buf is not None and buf.nbytes == 2 << 20 and store._spare_bytes == 6 << 20


def test_closing_the_last_repository_on_a_memory_tier_frees_its_spare_buffers(tmp_path):
    """The buffers reserved and recycled for saves go when the last repository on the name
    closes; the versions stay readable by the next one, and `discard` forgets the name."""
    from forkpoint.storage.memory import MemoryStore

    name = uuid.uuid4().hex
    tiers = [fp.tier(f"mem://{name}", keep=2), str(tmp_path / "disk")]
    state = {"w": torch.randn(1 << 20), "b": torch.randn(4 << 20)}
    repo = fp.Repo(tiers=tiers, create=True)
    other = fp.Repo(tiers=tiers)
    assert repo.warm_staging(state) >= 3 * (20 << 20), "keep + 1 versions of both large leaves reserved"
    for step in range(4):
        state["w"].add_(1)
        repo.save(state, step=step)
    store = repo.stores[0]
    assert store is other.stores[0] and store._spare_bytes > 0
    repo.close()
    assert store._spare_bytes > 0, "another repository still saves through the store"
    other.close()
    assert store._spare_bytes == 0 and store._reserved == 0
    with fp.Repo(tiers=tiers) as again:
        assert again.stores[0] is store
        assert store.list("objects"), "the kept versions' objects stay in memory"
        assert torch.equal(again.load("main")["w"], state["w"])
    MemoryStore.discard(name)
    fresh = MemoryStore.named(name)
    assert fresh is not store and fresh.list("") == []
    fresh.close()
    MemoryStore.discard(name)


def test_a_repository_that_fails_to_open_leaves_no_memory_store_open(tmp_path):
    """A constructor that raises (no repository there, a tier named twice) closes the stores it
    opened, so the last real repository's close still frees the spare buffers."""
    from forkpoint.errors import RepoNotFoundError
    from forkpoint.storage.memory import MemoryStore

    name = uuid.uuid4().hex
    with pytest.raises(RepoNotFoundError):
        fp.Repo(f"mem://{name}")
    with pytest.raises(ValueError, match="same store"):
        fp.Repo(tiers=[f"mem://{name}", str(tmp_path / "disk"), f"mem://{name}"], create=True)
    store = MemoryStore.named(name)
    assert store._opens == 1, "only this call holds the store open"
    store.reserve([2 << 20])
    store.close()
    assert store._spare_bytes == 0
    MemoryStore.discard(name)


def test_sweep_spares_young_unreferenced_objects_when_told(tmp_path):
    from forkpoint.storage import open_store
    from forkpoint.tiers.movement import sweep

    store = open_store(str(tmp_path / "s"))
    for name in ("old", "young", "live"):
        store.write(f"objects/{name}", [b"x" * 10])
    os.utime(store._path("objects/old"), (time.time() - 1000, time.time() - 1000))
    assert sweep(store, {"objects/live"}, lambda d: False, min_age=300) == (1, 10)
    assert sorted(store.list("objects")) == ["objects/live", "objects/young"]
    assert sweep(store, {"objects/live"}, lambda d: False) == (1, 10)


def test_direct_writes_of_random_part_layouts_read_back_exactly(tmp_path):
    """Any mix of part sizes and memory alignments (encoded payloads are lists of unaligned
    views) lands byte for byte, whether its runs go direct or through the bounce buffer, also
    with several threads writing at once."""
    import mmap

    import numpy as np

    from forkpoint.storage.local import LocalStore

    from concurrent.futures import ThreadPoolExecutor

    store = LocalStore(str(tmp_path / "s"))

    def layout(trial):
        rng = np.random.default_rng(trial)
        parts = []
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.choice([0, 1, 100, 4096, 5000, 1 << 20, (3 << 20) + 13, 5 << 20]))
            offset = int(rng.choice([0, 1, 17, 4096]))
            view = np.frombuffer(mmap.mmap(-1, n + 8192), np.uint8)[offset:offset + n]
            view[:] = rng.integers(0, 256, n, dtype=np.uint8)
            parts.append(view)
        store.write(f"objects/t{trial}", parts)
        return b"".join(bytes(p) for p in parts)

    with ThreadPoolExecutor(4) as pool:  # each writing thread has its own bounce buffer
        expected = list(pool.map(layout, range(60)))
    for trial, data in enumerate(expected):
        assert (tmp_path / "s" / "objects" / f"t{trial}").read_bytes() == data, f"layout {trial}"


def test_manifests_of_a_mib_or_more_read_back_from_a_memory_tier():
    """The memory store hands out large objects as views; a many-leaf manifest (over 1 MiB)
    must read from it like any other, once no longer cached in full."""
    url = f"mem://big-manifests-{uuid.uuid4().hex}"
    repo = fp.Repo(url, create=True)
    state = {f"layer{i}": torch.full((4,), float(i)) for i in range(4000)}
    first = repo.save(state, step=0)
    state["layer0"] += 1
    repo.save(state, step=1)
    assert len(repo.store.read(f"versions/{first.id}.json")) > 1 << 20
    fresh = fp.Repo(url)
    assert [v.step for v in fresh.log("main")] == [1, 0]
    assert torch.equal(fresh.load("main~1")["layer0"], torch.zeros(4))
    assert fresh.verify().ok
