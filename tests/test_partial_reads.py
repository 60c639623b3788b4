"""Reads of a box of a leaf (what resharding does) fetch only the 1 MiB blocks that cover
it, and each block is checked against the object's block table."""

import numpy as np
import pytest

import forkpoint as fp
from forkpoint.engine.restore import ReadRequest, read_leaves
from forkpoint.errors import CorruptObjectError
from forkpoint.format.objects import BLOCK_BYTES, OBJECT_HEADER_SIZE, content_hash, object_key


class Counting:
    """Wraps a store, counting payload bytes read."""

    def __init__(self, store):
        self.store, self.read_bytes = store, 0
        self.url = store.url

    def read(self, key):
        data = self.store.read(key)
        self.read_bytes += len(data)
        return data

    def read_into(self, key, offset, buf):
        got = self.store.read_into(key, offset, buf)
        self.read_bytes += got
        return got

    def __getattr__(self, name):
        return getattr(self.store, name)


def run(fn, nbytes):
    class Done:
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    return Done(fn())


@pytest.fixture
def saved(tmp_path):
    repo = fp.Repo(str(tmp_path / "repo"), create=True)
    a = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    version = repo.save({"a": a})
    leaf = repo.manifest(version.id).leaves[0]
    return repo, version, leaf, a


def test_box_read_fetches_only_covering_blocks(saved):
    repo, version, leaf, a = saved
    assert len(leaf.chunks) == 1 and leaf.chunks[0].hash == content_hash(a)
    store = Counting(repo.store)
    target = np.empty((200, 1024), dtype=np.float32)
    req = ReadRequest(leaf, target.reshape(-1).view(np.uint8), ([100, 0], [200, 1024]))
    read_leaves(store, [req], version.id, run)
    assert np.array_equal(target, a[100:300])
    needed = 200 * 1024 * 4
    assert store.read_bytes <= needed + 2 * BLOCK_BYTES + 8192, store.read_bytes
    assert store.read_bytes < a.nbytes / 3


def test_box_read_verifies_the_blocks_it_reads(saved):
    repo, version, leaf, a = saved
    key = object_key(leaf.chunks[0].object)
    with open(f"{repo.url}/{key}", "r+b") as f:
        f.seek(0, 2)
        f.seek(f.tell() - 10)
        f.write(b"\xff" * 4)
    target = np.empty((200, 1024), dtype=np.float32)
    req = ReadRequest(leaf, target.reshape(-1).view(np.uint8), ([100, 0], [200, 1024]))
    read_leaves(repo.store, [req], version.id, run)
    assert np.array_equal(target, a[100:300]), "a flipped byte in a block not read does not matter"
    tail = ReadRequest(leaf, np.empty(10 * 1024 * 4, dtype=np.uint8), ([2038, 0], [10, 1024]))
    with pytest.raises(CorruptObjectError, match="block 7 does not match"):
        read_leaves(repo.store, [tail], version.id, run)
    with pytest.raises(CorruptObjectError):
        repo.load(version.id)


def test_block_table_tamper_is_caught(saved):
    repo, version, leaf, a = saved
    key = object_key(leaf.chunks[0].object)
    with open(f"{repo.url}/{key}", "r+b") as f:
        f.seek(OBJECT_HEADER_SIZE + 5)
        f.write(b"\x00\x01")
    target = np.empty((10, 1024), dtype=np.float32)
    req = ReadRequest(leaf, target.reshape(-1).view(np.uint8), ([0, 0], [10, 1024]))
    read_leaves(repo.store, [req], version.id, run)
    assert np.array_equal(target, a[:10]), "a bad table is ignored and the whole chunk is verified instead"
