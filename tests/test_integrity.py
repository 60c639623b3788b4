"""Integrity: corruption and truncation are detected, ENOSPC leaves the repository intact."""

import concurrent.futures
import errno
import os
import shutil
import subprocess
import uuid

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.format.objects import object_key
from forkpoint.errors import CorruptObjectError, FormatError, MissingObjectError, StorageFullError
from forkpoint.storage import LocalStore


def _objects(repo, vid):
    return [c.object for leaf in repo.manifest(vid).leaves for c in leaf.chunks]


@pytest.mark.parametrize("size", [100, 3_000_000], ids=["packed", "standalone"])
def test_one_flipped_byte_is_detected(repo, size):
    v = repo.save({"w": torch.randn(size // 4)})
    obj = _objects(repo, v.id)[0]
    path = os.path.join(repo.url, object_key(obj))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    fresh = fp.Repo(repo.url)
    with pytest.raises(CorruptObjectError) as e:
        fresh.load(v.id)
    assert v.id in str(e.value) and "'w'" in str(e.value) and obj in str(e.value)
    report = fresh.verify()
    assert not report.ok and obj in report.problems[0]


def test_truncated_and_missing_objects(repo):
    v = repo.save({"a": torch.randn(1_000_000), "b": torch.randn(10)})
    big = repo.manifest(v.id).leaves[0].chunks[0].object
    path = os.path.join(repo.url, object_key(big))
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CorruptObjectError, match="truncated"):
        fp.Repo(repo.url).load(v.id)
    os.unlink(path)
    with pytest.raises(MissingObjectError, match=f"version {v.id}, leaf 'a'.*is missing"):
        fp.Repo(repo.url).load(v.id)
    assert fp.Repo(repo.url).load(v.id, paths=["b"])["b"].shape == (10,)


def test_verify_clean_repository(repo):
    for i in range(3):
        repo.save({"w": torch.randn(50_000) * i, "k": i})
    report = repo.verify()
    assert report.ok and report.versions == 3 and report.bytes == 3 * 200_000


class FullAfter(LocalStore):
    """A local store that fails with ENOSPC once `budget` bytes were written."""

    def __init__(self, root, budget):
        super().__init__(root)
        self.budget = budget

    def write(self, key, parts, durable=True):
        size = sum(memoryview(p).nbytes for p in parts)
        self.budget -= size
        if self.budget < 0:
            raise StorageFullError(f"no space left on the device holding {self.root} (simulated)")
        super().write(key, parts, durable)


def _mount_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    return r.returncode == 0


def _check_enospc(repo_for_full, reopen):
    state = {"w": torch.randn(100_000), "m": {"x": np.arange(10)}}
    v1 = repo_for_full.save(state, step=1)
    expected = v1.id
    with pytest.raises(StorageFullError, match="no space left.*"):
        repo_for_full.save({"w": torch.randn(4_000_000)}, step=2)
    repo = reopen()
    assert repo.head("main") == expected
    assert repo.verify().ok
    out = repo.load("main")
    assert torch.equal(out["w"], state["w"])


def test_enospc_real_tmpfs_or_simulated(tmp_path):
    mnt = str(tmp_path / "small")
    if _mount_tmpfs(mnt, "8m"):
        try:
            r = fp.Repo(os.path.join(mnt, "repo"), create=True)
            _check_enospc(r, lambda: fp.Repo(os.path.join(mnt, "repo")))
            r.close()
            leftovers = os.listdir(os.path.join(mnt, "repo", "tmp"))
            assert leftovers == [], "temp files of the failed save are removed"
        finally:
            subprocess.run(["umount", "-l", mnt])
    root = str(tmp_path / "sim")
    fp.Repo(root, create=True).close()
    r = fp.Repo(FullAfter(root, budget=2_000_000))
    _check_enospc(r, lambda: fp.Repo(root))


def test_real_enospc_maps_to_storage_full(tmp_path, monkeypatch):
    store = LocalStore(str(tmp_path / "s"))
    real_write = os.write

    def failing_write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(StorageFullError, match="no space left on the device holding"):
        store.write("objects/ab/" + uuid.uuid4().hex, [b"x" * 10])
    monkeypatch.setattr(os, "write", real_write)
    assert os.listdir(os.path.join(store.root, "tmp")) == []


def test_direct_writes_of_mixed_parts_store_exactly_their_bytes(tmp_path):
    """Objects written with O_DIRECT from parts of every alignment and size (page-aligned runs go
    to disk as they lie, the rest through the bounce buffer, the last block zero-padded and the
    file cut to its length) hold exactly the parts' bytes, whatever the length."""
    from forkpoint.storage.memory import aligned_buffer

    store = LocalStore(str(tmp_path / "s"))
    rng = np.random.default_rng(7)
    sizes = [0, 1, 16, 4095, 4096, 4097, 65_537, (1 << 20) + 3, 5 << 20]
    for trial in range(24):
        parts = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.choice(sizes))
            if rng.random() < 0.4 and n >= 4096:
                buf = aligned_buffer(n)
                buf[:] = rng.integers(0, 256, n, dtype=np.uint8)
                parts.append(buf)
            else:
                skew = int(rng.integers(0, 7))
                parts.append(rng.integers(0, 256, n + skew, dtype=np.uint8)[skew:])
        if sum(p.nbytes for p in parts) < (1 << 20):
            parts.append(rng.integers(0, 256, 1 << 20, dtype=np.uint8))
        key = f"objects/t/{trial}"
        store.write(key, parts)
        expected = b"".join(p.tobytes() for p in parts)
        assert store.direct_io and store.size(key) == len(expected)
        assert store.read(key) == expected, trial


def test_direct_writes_send_a_stretch_of_aligned_parts_in_one_request(tmp_path, monkeypatch):
    """Gathered bytes and the page-aligned parts around them go to disk together: a 4 KiB head
    gathered from small parts, three aligned 1 MiB parts and a short tail (zero-padded to a
    block) are one pwritev; a 17 MiB aligned
    part is cut into requests of at most 16 MiB; more aligned parts than one request takes
    views go out in several. The file holds exactly the parts' bytes."""
    from forkpoint.storage import local
    from forkpoint.storage.memory import aligned_buffer

    requests = []
    pwritev = os.pwritev
    monkeypatch.setattr(local.os, "pwritev", lambda fd, views, at: requests.append(
        (at, [memoryview(v).nbytes for v in views])) or pwritev(fd, views, at))
    store = LocalStore(str(tmp_path / "s"))
    rng = np.random.default_rng(3)

    def aligned(n):
        buf = aligned_buffer(n)
        buf[:] = rng.integers(0, 256, n, dtype=np.uint8)
        return buf

    cases = {
        "head and planes": [bytes(range(16)), bytes(4080), aligned(1 << 20), aligned(1 << 20), aligned(1 << 20), b"tail"],
        "large": [aligned(17 << 20)],
        "many": [aligned(64 << 10) for _ in range(local.DIRECT_VIEWS + 6)],
    }
    sent = {}
    for name, parts in cases.items():
        requests.clear()
        store.write(f"objects/t/{name}", parts)
        assert store.read(f"objects/t/{name}") == b"".join(bytes(memoryview(p)) for p in parts)
        sent[name] = list(requests)
    assert [(at, sum(n)) for at, n in sent["head and planes"]] == [(0, (3 << 20) + 2 * 4096)]
    assert [sum(n) for _, n in sent["large"]] == [16 << 20, 1 << 20]
    assert [len(n) for _, n in sent["many"]] == [local.DIRECT_VIEWS, 6]


def test_a_store_makes_its_directories_again_when_they_vanish(tmp_path):
    """The local store makes its tmp and object directories once; a write that finds one gone
    (another process wiped the directory) makes it again, and a save through a Repo works on."""
    store = LocalStore(str(tmp_path / "s"))
    store.write("objects/ab/one", [b"1" * 5000])
    store.write("objects/ab/two", [b"2" * 5000], durable=False)
    for gone in ("tmp", "objects"):
        subprocess.run(["rm", "-rf", str(tmp_path / "s" / gone)], check=True)
        store.write("objects/ab/three", [b"3" * 5000])
        assert store.read("objects/ab/three") == b"3" * 5000
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    repo.save({"w": torch.arange(100_000)})
    subprocess.run(["rm", "-rf", str(tmp_path / "r" / "tmp"), str(tmp_path / "r" / "objects")], check=True)
    v = repo.save({"w": torch.arange(100_000) * 2})
    assert torch.equal(fp.Repo(str(tmp_path / "r")).load(v.id)["w"], torch.arange(100_000) * 2)


def test_writers_racing_into_a_wiped_store_all_succeed(tmp_path):
    """Threads writing into directories another process wiped: whichever thread makes a
    directory again first, the others' writes go through too (none fails on the race)."""
    store = LocalStore(str(tmp_path / "s"))
    for round_ in range(60):
        keys = [f"objects/{d}/{round_}-{i}" for i in range(8) for d in ("ab", "cd")]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: store.write(k, [k.encode() * 600], durable=False), keys))
        assert all(store.read(k) == k.encode() * 600 for k in keys)
        shutil.rmtree(tmp_path / "s" / "objects")
        if round_ % 3 == 0:
            shutil.rmtree(tmp_path / "s" / "tmp")


def test_unsafe_keys_are_refused(tmp_path):
    store = LocalStore(str(tmp_path))
    with pytest.raises(ValueError, match="unsafe"):
        store.read("../etc/passwd")
    with pytest.raises(ValueError, match="unsafe"):
        store.read("/etc/passwd")


def test_paths_from_manifests_are_not_trusted(repo):
    import json

    v = repo.save({"w": torch.ones(3)})
    path = os.path.join(repo.url, "versions", f"{v.id}.json")
    record = json.load(open(path))
    record["leaves"][0]["chunks"][0]["object"] = "../../../../etc/passwd"
    json.dump(record, open(path, "w"))
    from forkpoint.errors import CorruptObjectError, FormatError
    from forkpoint.format.manifest import _record_id

    with pytest.raises(CorruptObjectError, match="does not match its id"):
        fp.Repo(repo.url).load(v.id)
    record["id"] = _record_id(record)
    json.dump(record, open(os.path.join(repo.url, "versions", f"{record['id']}.json"), "w"))
    with pytest.raises(FormatError, match="invalid object name"):
        fp.Repo(repo.url).load(record["id"])


def test_a_sealed_manifest_is_its_canonical_json_under_its_id():
    """`Manifest.seal` serializes once and splices the id in; the bytes must be exactly the
    canonical JSON a reader re-derives the id from, whatever the record holds (keys that sort
    before and after "id" at every level, optional chunk fields, aliases, odd paths)."""
    import dataclasses
    import json

    from forkpoint.format.manifest import (Chunk, Leaf, Manifest, Version, _canonical, _leaf_canonical,
                                          _record_id)

    lossy = Chunk([0, 0], [2, 3], "a" * 64, "a" * 64, 0, 24, "float-planes",
                  lossy={"mode": "rel_error=0.001", "keep_bits": 10, "max_rel_error": 0.0009})
    delta = Chunk([2, 0], [2, 3], "b" * 64, "c" * 64, 0, 24, "zstd",
                  delta={"base": "d" * 64, "chain": ["e" * 64], "op": "xor"})
    packed = Chunk([0], [5], "f" * 64, "9" * 64, 64, 20)
    leaves = [Leaf('w/"q\\uote"/é', "torch", "float32", [4, 3], 48, [lossy, delta]),
              Leaf("b", "numpy", "int32", [5], 20, [packed], device="cuda:1"),
              Leaf("tied", "torch", "float32", [4, 3], 48, [], alias_of=0)]
    tree = {"t": "dict", "k": ["a", "id", "zz"], "v": [{"t": "leaf", "i": 0}, {"t": "str", "v": "id"},
                                                      {"t": "leaf", "i": 2}]}
    record = Version("", ["1" * 24], "main", 7, 1.5, "msg", {"loss": 0.25}, {"id": "x", "aa": [1]},
                     env={"host": "n1", "id": ""})
    manifest = Manifest(record, tree, leaves)
    sealed = manifest.seal()
    assert sealed == _canonical(json.loads(sealed)) == manifest.to_bytes()
    parsed = json.loads(sealed)
    assert parsed["id"] == record.id == _record_id(parsed) and len(record.id) == 24
    back = Manifest.from_bytes(sealed, "test")
    assert back.leaves == leaves and back.tree == tree and back.version == record
    both = dataclasses.replace(delta, lossy=lossy.lossy)
    for obj in (both, leaves[2]):  # every field written where set: a new field must be added to to_json
        assert set(obj.to_json()) == {f.name for f in dataclasses.fields(obj)}
    assert Chunk(**both.to_json()) == both
    for leaf in [*leaves, Leaf("x", "torch", "bfloat16", [], 2, [both], alias_of=1)]:  # the direct writer
        assert _leaf_canonical(leaf).encode() == _canonical(leaf.to_json())
    assert "alias_of" not in leaves[0].to_json() and {"lossy", "delta"}.isdisjoint(packed.to_json())


def test_a_version_record_is_read_without_its_leaf_table_and_still_checked(tmp_path):
    """`log` of a many-leaf history reads records only: the record read must equal the full
    parse's, and any edit of the manifest (in the leaf table too) or a non-canonical layout
    must be caught or handled exactly as by the full parse."""
    import json

    from forkpoint.format.manifest import Manifest, version_from_bytes

    repo = fp.Repo(str(tmp_path / "r"), create=True)
    state = {f'l{i}],"logical_bytes":{i}': torch.full((3,), float(i)) for i in range(50)}
    state["tied"] = state['l0],"logical_bytes":0']
    repo.save(state, step=0, meta={"id": "x", "leaves": [1]})
    v = repo.save({**state, "x": 1}, step=1, message='],"logical_bytes":2', metrics={"loss": 0.5})
    key = f"versions/{v.id}.json"
    data = repo.store.read(key)
    assert version_from_bytes(data, "t") == Manifest.from_bytes(data, "t").version == v
    edited = data.replace(b'"nbytes":12', b'"nbytes":13', 1)
    assert edited != data
    for bad in (edited, data.replace(b'"step":1', b'"step":2')):
        with pytest.raises(CorruptObjectError, match="does not match its id"):
            version_from_bytes(bad, "t")
    for truncated in (data[:len(data) // 2], data[:-1], b""):
        with pytest.raises(FormatError, match="not valid JSON"):
            version_from_bytes(truncated, "t")
    pretty = json.dumps(json.loads(data), indent=2).encode()
    assert version_from_bytes(pretty, "t") == v
    fresh = fp.Repo(str(tmp_path / "r"))
    assert [x.step for x in fresh.log("main")] == [1, 0] and fresh.version("main~1").meta["id"] == "x"
    assert fresh.history.cache.get(v.id) is None, "the log parsed a leaf table"
    assert torch.equal(fresh.load("main")["tied"], torch.zeros(3))
    repo.store.write(key, [edited])
    with pytest.raises(CorruptObjectError, match=v.id):
        fp.Repo(str(tmp_path / "r")).log("main")
