"""The public commit protocol (repo.begin_save): objects, durability, manifest, ref."""

import numpy as np
import pytest

import forkpoint as fp
from forkpoint.engine.restore import ReadRequest
from forkpoint.errors import SaveAbortedError
from forkpoint.format.manifest import Chunk, Leaf, Manifest, Version
from forkpoint.format.objects import content_hash, object_key
from forkpoint.repo.records import environment


def _manifest(branch: str, data: np.ndarray, digest: str, codec: str) -> Manifest:
    chunk = Chunk([0], [data.size], digest, digest, 0, data.nbytes, codec)
    leaf = Leaf("w", "numpy", str(data.dtype), [data.size], data.nbytes, [chunk])
    tree = {"t": "dict", "k": ["w"], "v": [{"t": "leaf", "i": 0}]}
    record = Version("", [], branch, 3, 0.0, "by hand", {}, {}, env=environment())
    return Manifest(record, tree, [leaf])


def test_a_version_written_object_by_object_reads_back_and_builds_on_the_head(tmp_path):
    repo = fp.Repo(tmp_path / "r", create=True, codec="lossless")
    first = repo.save({"w": np.zeros(4)}, step=1)
    data = np.random.default_rng(0).standard_normal(300_000)
    with repo.begin_save("main") as session:
        assert session.head.version.id == first.id
        writer = session.writer()
        digest = content_hash(data)
        codec = writer.put(digest, data, itemsize=8, floating=True)
        assert codec == "float-planes", "the repository's codec rules apply"
        session.make_durable(writer.written)
        version = session.commit(_manifest("main", data, digest, codec))
    assert version.parents == [first.id] and repo.version("main").id == version.id
    assert np.array_equal(repo.load("main")["w"], data)
    m = repo.readable("main")
    out = np.empty(100, np.float64)
    repo.read_into([ReadRequest(m.leaves[0], out.view(np.uint8), ([1000], [100]))], version.id)
    assert np.array_equal(out, data[1000:1100]), "a box of a leaf, read through the public API"
    assert repo.verify().ok
    repo.close()


def test_an_open_session_keeps_its_objects_from_gc_and_one_left_uncommitted_publishes_nothing(tmp_path):
    repo = fp.Repo(tmp_path / "r", create=True)
    data = np.arange(1000, dtype=np.int64)
    digest = content_hash(data)
    session = repo.begin_save("main")
    session.writer().put(digest, data)
    repo.gc(grace=0)
    assert repo.store.exists(object_key(digest)), "gc spares what an open session wrote"
    session.close()
    assert repo.branches() == {}, "nothing was published"
    repo.gc(grace=0)
    assert not repo.store.exists(object_key(digest)), "once the session ends, gc removes what nothing refers to"
    with pytest.raises(ValueError, match="cannot commit to 'other'"):
        repo.begin_save("main").commit(_manifest("other", data, digest, "raw"))
    repo.close()


def test_an_aborted_session_refuses_further_writes(tmp_path):
    repo = fp.Repo(tmp_path / "r", create=True)
    with repo.begin_save("main") as session:
        writer = session.writer()
        session.abort()
        with pytest.raises(SaveAbortedError):
            writer.put(content_hash(b"abc"), np.frombuffer(b"abc", np.uint8))
    with pytest.raises(ValueError, match="branch"):
        repo.begin_save("bad name")
    repo.close()
