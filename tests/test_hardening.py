"""Hostile and damaged repositories: crafted manifests, refs and stubs, partial copies,
symlinks and decompression bombs. None may load as wrong bytes, and gc must never delete
what it cannot prove unreachable."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import zstandard

import forkpoint as fp
from forkpoint.errors import (CorruptObjectError, ForkpointError, FormatError, MissingObjectError,
                              OutOfMemoryError, StateMismatchError, UnsafePathError)
from forkpoint.format.manifest import _record_id
from forkpoint.format.objects import object_key, pack_header
from forkpoint.format.refs import encode_record, record_key, seq_of
import procs


def manifest_path(repo, vid):
    return os.path.join(repo.url, "versions", f"{vid}.json")


def craft(repo, vid, mutate, branch="main"):
    """Write a copy of version `vid`'s manifest changed by `mutate(record)`, under the id it
    hashes to (what a crafted file would carry), point `branch` at it and return the id."""
    record = json.load(open(manifest_path(repo, vid)))
    mutate(record)
    record["id"] = ""
    record["id"] = _record_id(record)
    with open(manifest_path(repo, record["id"]), "w") as f:
        json.dump(record, f)
    point(repo, branch, record["id"])
    return record["id"]


def point(repo, branch, vid):
    """Publish a ref record moving `branch` to `vid` without reading anything (a crafted file)."""
    seqs = [seq_of(k) for k in repo.store.list(f"refs/heads/{branch}")]
    seq = max([s for s in seqs if s is not None], default=-1) + 1
    assert repo.store.create_exclusive(record_key("heads", branch, seq), encode_record(seq, vid, 0.0, "crafted"))


def objects_on_disk(repo):
    return sorted(repo.store.list("objects"))


# ------------------------------------------------------------------ chunk boxes
BOX_DAMAGE = {
    "no chunks": lambda leaf: leaf.update(chunks=[]),
    "negative offset": lambda leaf: leaf["chunks"][0].update(offsets=[-2, 0]),
    "past the end": lambda leaf: leaf["chunks"][0].update(offsets=[2, 0]),
    "short box": lambda leaf: leaf["chunks"][0].update(lengths=[3, 4], size=48),
    "size not the box's": lambda leaf: leaf["chunks"][0].update(size=40),
    "overlap": lambda leaf: leaf["chunks"].append(dict(leaf["chunks"][0])),
    "wrong dims": lambda leaf: leaf["chunks"][0].update(offsets=[0], lengths=[20]),
    "string offsets": lambda leaf: leaf["chunks"][0].update(offsets=["0", "0"]),
    "nbytes lies": lambda leaf: leaf.update(nbytes=8),
    "huge shape": lambda leaf: leaf.update(shape=[2**62, 1], nbytes=2**64),
    "unknown dtype": lambda leaf: leaf.update(dtype="float33"),
    "object dtype": lambda leaf: leaf.update(dtype="object"),
    "dtype not a string": lambda leaf: leaf.update(dtype=["float32"]),
    "unknown kind": lambda leaf: leaf.update(kind="module"),
    "leaf not an object": lambda leaf: leaf.clear(),
}


@pytest.mark.parametrize("damage", sorted(BOX_DAMAGE))
def test_a_leaf_whose_chunks_do_not_tile_its_shape_is_refused_everywhere(repo, damage):
    """Load, restore, partial reads and verify all refuse a leaf whose chunk boxes leave a gap,
    overlap, leave the shape or disagree with its dtype; the error names the version and leaf."""
    v = repo.save({"w": torch.arange(20.0).reshape(5, 4), "b": torch.ones(3)})
    bad = craft(repo, v.id, lambda r: BOX_DAMAGE[damage](next(x for x in r["leaves"] if x["path"] == "w")))
    fresh = fp.Repo(repo.url)
    for read in (lambda: fresh.load(bad), lambda: fresh.load(bad, paths=["b"]),
                 lambda: fresh.restore({"w": torch.zeros(5, 4), "b": torch.zeros(3)}, bad)):
        with pytest.raises(FormatError, match=bad):
            read()
    report = fresh.verify()
    assert not report.ok and any(bad in p for p in report.problems)
    assert torch.equal(fresh.load(v.id)["w"], torch.arange(20.0).reshape(5, 4))


def test_boxes_of_sharded_leaves_are_checked_as_a_grid(repo):
    """Boxes from a 2-D sharding tile their leaf; one moved into its neighbour is refused."""
    from forkpoint.format.validate import check_leaf

    def leaf(boxes):
        chunks = [{"offsets": o, "lengths": n, "hash": "a" * 64, "object": "a" * 64, "start": 0,
                   "size": n[0] * n[1] * 4} for o, n in boxes]
        return {"path": "w", "kind": "torch", "dtype": "float32", "shape": [4, 6], "nbytes": 96, "chunks": chunks}

    grid = [([i, j], [2, 3]) for i in (0, 2) for j in (0, 3)]
    check_leaf(leaf(grid), 0, [], "m")
    moved = grid[:3] + [([2, 2], [2, 3])]
    with pytest.raises(FormatError, match="overlap or leave a gap"):
        check_leaf(leaf(moved), 0, [], "m")


# ------------------------------------------------------------------ tree nodes
TREE_DAMAGE = {
    "leaf index -1": ({"t": "leaf", "i": -1}, "outside the leaf table"),
    "leaf index past the table": ({"t": "leaf", "i": 7}, "outside the leaf table"),
    "dtype names a module": ({"t": "torch.dtype", "v": "os"}, "not a dtype"),
    "bytes not base64": ({"t": "bytes", "v": "%%%"}, "not base64"),
    "int holds a string": ({"t": "int", "v": "3"}, "int node"),
    "float not hex": ({"t": "float", "v": "1e5; import os"}, "not a hex float"),
    "unknown node": ({"t": "eval", "v": "1"}, "unknown node"),
    "dict of unequal lists": ({"t": "dict", "k": ["a", "b"], "v": []}, "one length"),
}


@pytest.mark.parametrize("damage", sorted(TREE_DAMAGE))
def test_every_tree_node_is_checked_against_the_schema(repo, damage):
    node, message = TREE_DAMAGE[damage]
    v = repo.save({"x": torch.ones(2), "y": 1})
    bad = craft(repo, v.id, lambda r: r["tree"]["v"].__setitem__(1, node))
    with pytest.raises(FormatError, match=message):
        fp.Repo(repo.url).load(bad)


def test_a_deeply_nested_manifest_is_a_format_error_and_one_line_in_the_cli(repo):
    v = repo.save({"x": torch.ones(2)})
    path = manifest_path(repo, v.id)
    text = open(path).read()
    deep = '{"t":"list","v":[' * 5000 + '{"t":"none"}' + "]}" * 5000
    tree = '"tree":{"k":["x"],"t":"dict","v":[{"i":0,"t":"leaf"}]}'
    assert tree in text
    open(path, "w").write(text.replace(tree, '"tree":{"k":["x","d"],"t":"dict","v":[{"i":0,"t":"leaf"},'
                                       + deep + "]}"))
    with pytest.raises(FormatError, match="nested too deeply"):
        fp.Repo(repo.url).load(v.id)
    out = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "show", v.id, "--repo", repo.url],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "nested too deeply" in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 3, out.stderr


def test_a_state_nested_past_the_limit_is_refused_at_save(repo):
    from forkpoint.errors import UnsupportedTypeError
    from forkpoint.format.validate import MAX_TREE_DEPTH

    deep = torch.ones(1)
    for _ in range(MAX_TREE_DEPTH + 1):
        deep = [deep]
    with pytest.raises(UnsupportedTypeError, match="nested deeper"):
        repo.save({"d": deep})


# ------------------------------------------------------------------ refs, stubs, lineage
def test_a_ref_to_a_missing_manifest_is_a_verify_error_and_gc_deletes_nothing(repo):
    """A partial copy: `main` points at a manifest that is gone. verify reports it, gc refuses
    before deleting anything, and the ancestors stay loadable."""
    vs = [repo.save({"w": torch.full((1000,), float(i))}, step=i) for i in range(4)]
    os.remove(manifest_path(repo, vs[-1].id))
    fresh = fp.Repo(repo.url)
    report = fresh.verify()
    assert not report.ok and any("main" in p and vs[-1].id in p for p in report.problems)
    before = objects_on_disk(repo)
    with pytest.raises(MissingObjectError, match="gc refused.*branch 'main'.*branch reset"):
        fresh.gc(keep=fp.Keep(last=1), grace=0)
    assert objects_on_disk(repo) == before
    for v in vs[:-1]:
        assert torch.equal(fresh.load(v.id)["w"], torch.full((1000,), float(v.step)))
    with pytest.raises(MissingObjectError, match="branch 'main'.*no tier"):
        fresh.load("main")
    fresh.reset_branch("main", vs[-2].id)
    assert fresh.verify().ok and fresh.load("main")["w"][0] == 2


def test_one_flipped_byte_in_a_ref_record_loses_nothing(repo):
    """The target of main's newest record damaged (still hex, or not hex at all): load names the
    record, verify reports it, gc deletes nothing; `forkpoint branch reset` repairs it."""
    vs = [repo.save({"w": torch.full((1000,), float(i))}, step=i) for i in range(3)]
    repo.gc(keep=fp.Keep(last=2), grace=0)
    records = sorted(k for k in repo.store.list("refs/heads/main"))
    path = os.path.join(repo.url, records[-1])
    raw = open(path).read()
    target = json.loads(raw)["target"]
    for flipped in (target[:5] + ("0" if target[5] != "0" else "1") + target[6:], target[:5] + "g" + target[6:]):
        open(path, "w").write(raw.replace(target, flipped))
        fresh = fp.Repo(repo.url)
        before = objects_on_disk(repo)
        with pytest.raises(ForkpointError, match="refs/heads/main"):
            fresh.load("main")
        assert not fresh.verify().ok
        with pytest.raises(ForkpointError, match="gc refused"):
            fresh.gc(keep=fp.Keep(last=1), grace=0)
        assert objects_on_disk(repo) == before
        assert os.path.exists(manifest_path(repo, vs[0].id))
    out = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "branch", "reset", "main", vs[2].id,
                          "--repo", repo.url], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    fresh = fp.Repo(repo.url)
    assert fresh.verify().ok and fresh.head("main") == vs[2].id
    assert [v.step for v in fresh.log("main")] == [2, 1, 0]


def test_a_damaged_stub_stops_log_verify_and_gc(repo):
    """One flipped byte in a pruned version's stub: it fails its stub_hash, so log and verify
    report it and gc keeps every version (before, gc deleted the kept version behind it)."""
    vs = [repo.save({"w": torch.full((1000,), float(i))}, step=i) for i in range(4)]
    repo.tag("first", vs[0].id)
    repo.gc(keep=fp.Keep(last=1), grace=0)
    stub_path = manifest_path(repo, vs[1].id)
    stub = json.load(open(stub_path))
    assert stub["pruned"] and "stub_hash" in stub
    text = open(stub_path).read()
    parent = stub["parents"][0]
    open(stub_path, "w").write(text.replace(parent, parent[:-1] + ("0" if parent[-1] != "0" else "1")))
    fresh = fp.Repo(repo.url)
    with pytest.raises(CorruptObjectError, match="stub_hash"):
        fresh.log("main")
    assert any("stub_hash" in p for p in fresh.verify().problems)
    before = objects_on_disk(repo)
    with pytest.raises(CorruptObjectError, match="gc refused"):
        fresh.gc(grace=0)
    assert objects_on_disk(repo) == before
    assert torch.equal(fresh.load("first")["w"], torch.zeros(1000))


def test_stubs_written_before_stub_hash_are_still_read(repo):
    from forkpoint.format.manifest import Manifest

    vs = [repo.save({"w": torch.full((10,), float(i))}, step=i) for i in range(3)]
    repo.gc(keep=fp.Keep(last=1), grace=0)
    path = manifest_path(repo, vs[0].id)
    record = json.load(open(path))
    del record["stub_hash"]
    open(path, "w").write(json.dumps(record))
    assert Manifest.from_bytes(open(path, "rb").read(), path).version.pruned
    assert [v.step for v in fp.Repo(repo.url).log("main")] == [2, 1, 0]


def test_cyclic_parents_are_an_error_not_a_hang(repo):
    """Crafted manifests whose first parents loop: log, gc and `forkpoint log` stop with an error."""
    v0 = repo.save({"w": torch.ones(4)}, step=0)
    a = craft(repo, v0.id, lambda r: r.update(parents=["b" * 24]))
    b = craft(repo, v0.id, lambda r: r.update(parents=[a], step=1))
    # point a at b: a manifest naming b as parent, under a's file name (ids of a loop cannot
    # both hash right, so this one is a hand-edited stub, which keeps its id)
    record = json.load(open(manifest_path(repo, a)))
    record.update(parents=[b], pruned=True, tree=None, leaves=[])
    open(manifest_path(repo, a), "w").write(json.dumps(record))
    point(repo, "main", b)
    fresh = fp.Repo(repo.url)
    with pytest.raises(FormatError, match="loops"):
        fresh.log("main")
    with pytest.raises(FormatError, match="gc refused.*loops"):
        fresh.gc(grace=0)
    out = procs.run([sys.executable, "-m", "forkpoint.cli.main", "log", "--repo", repo.url],
                    timeout=procs.CHILD_SECONDS)
    assert out.returncode == 2 and "loops" in out.stderr


# ------------------------------------------------------------------ symlinks
def test_gc_never_deletes_through_a_symlink_out_of_the_repository(repo, tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "thesis.tex").write_text("years of work")
    old = 1_000_000_000
    os.utime(outside / "thesis.tex", (old, old))
    repo.save({"w": torch.ones(3)})
    tmp_dir = os.path.join(repo.url, "tmp")
    if os.path.isdir(tmp_dir):
        shutil.rmtree(tmp_dir)
    os.symlink(outside, tmp_dir)
    with pytest.raises(UnsafePathError, match="outside the repository"):
        fp.Repo(repo.url).gc(grace=0)
    assert (outside / "thesis.tex").read_text() == "years of work"


def test_objects_are_never_written_through_a_symlinked_directory(tmp_path):
    from forkpoint.storage.local import LocalStore

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    store = LocalStore(str(tmp_path / "r"))
    os.makedirs(tmp_path / "r" / "objects")
    os.symlink(outside, tmp_path / "r" / "objects" / "ab")
    with pytest.raises(UnsafePathError):
        store.write("objects/ab/abcd", [b"x"])
    with pytest.raises(UnsafePathError):
        store.delete("objects/ab/abcd")
    assert not os.listdir(outside)


# ------------------------------------------------------------------ decompression bombs
def _bomb_object(repo, digest, codec_id, payload, declared):
    with open(os.path.join(repo.url, object_key(digest)), "wb") as f:
        f.write(pack_header(codec_id, declared) + payload)


LOAD_AND_MEASURE = """
import resource, sys
import forkpoint as fp
repo = fp.Repo(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    repo.load(sys.argv[2])
    print("loaded")
except fp.errors.CorruptObjectError as e:
    print("refused:", e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.parametrize("bomb", ["zstd header lies", "zstd frame lies", "float-planes segments", "pack"])
def test_a_small_object_that_lies_about_its_size_is_refused_before_allocating(repo, bomb):
    """A 16-32 KB object that declares (in its header, its zstd frame or its segment table) far
    more bytes than the chunk the manifest names is refused without allocating them (peak
    memory of a fresh process that loads it grows by less than 128 MiB)."""
    if bomb == "pack":
        v = repo.save({"a": torch.ones(100), "b": torch.zeros(50, dtype=torch.int64)})
    else:
        v = repo.save({"w": torch.ones(1 << 18)})  # a 1 MiB standalone chunk
    chunk = repo.manifest(v.id).leaves[0].chunks[0]
    gib = zstandard.ZstdCompressor().compress(bytes(1 << 30))
    if bomb == "zstd header lies":
        _bomb_object(repo, chunk.object, 1, gib, 1 << 31)
    elif bomb in ("zstd frame lies", "pack"):
        _bomb_object(repo, chunk.object, 1, gib, chunk.size if bomb != "pack" else 1 << 30)
    else:
        import struct

        head = struct.pack("<BBHQI", 2, 4, 0, chunk.size // 4, 1)  # one element a segment
        _bomb_object(repo, chunk.object, 3, head + bytes(16 << 10), chunk.size)
    out = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, repo.url, v.id], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0].startswith("refused:") and chunk.object in out[0], out
    assert int(out[-1]) < 128 << 20, out


def test_a_leaf_too_large_to_allocate_is_a_clear_error(repo):
    v = repo.save({"w": torch.ones(4)})

    def huge(record):
        leaf = record["leaves"][0]
        n = 1 << 46
        leaf.update(shape=[n], nbytes=n * 4)
        leaf["chunks"][0].update(lengths=[n], size=n * 4)

    bad = craft(repo, v.id, huge)
    with pytest.raises(OutOfMemoryError, match="'w'"):
        fp.Repo(repo.url).load(bad)


def test_a_numpy_leaf_with_a_crafted_dtype_is_refused(repo):
    v = repo.save({"a": np.arange(6, dtype=np.int32)})
    bad = craft(repo, v.id, lambda r: r["leaves"][0].update(dtype="V4"))
    with pytest.raises(FormatError, match="dtype 'V4'"):
        fp.Repo(repo.url).load(bad)


def test_branch_reset_and_delete_refuse_bad_input_in_one_line(repo, tmp_path):
    repo.save({"w": torch.ones(2)})
    cli = [sys.executable, "-m", "forkpoint.cli.main", "branch"]
    for args, message in ((["reset", "main", "nosuchref"], "no branch, tag or version"),
                          (["reset", "bad/name", "main"], "invalid branch name"),
                          (["delete", "ghost"], "no branch 'ghost'"),
                          (["reset", "main", "main", "--repo", str(tmp_path / "missing")], "repository")):
        out = subprocess.run(cli + args + (["--repo", repo.url] if "--repo" not in args else []),
                             capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    assert fp.Repo(repo.url).head("main") is not None


# ------------------------------------------------------------------ class records
@pytest.mark.parametrize("classes", [["o"], {"o": 3}, {"o": "x" * 5000}, "torch.optim.sgd:SGD"])
def test_a_malformed_class_record_is_a_format_error(repo, classes):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    v = repo.save({"o": opt})
    bad = craft(repo, v.id, lambda r: r.__setitem__("classes", classes))
    with pytest.raises(FormatError, match="classes is not an object"):
        fp.Repo(repo.url).restore({"o": opt}, bad)


def test_a_class_record_is_compared_as_text_and_never_imported(repo):
    """A crafted record naming a module to import is only a name that differs from the live
    object's class: the restore is refused and nothing is imported; a record naming a class
    outside torch is not compared."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    v = repo.save({"o": opt})
    bad = craft(repo, v.id, lambda r: r.__setitem__("classes", {"o": "torch.never_imported:SGD2"}))
    with pytest.raises(StateMismatchError, match="o: stored state of a torch.never_imported.SGD2, live"):
        fp.Repo(repo.url).restore({"o": opt}, bad)
    assert "torch.never_imported" not in sys.modules
    other = craft(repo, v.id, lambda r: r.__setitem__("classes", {"o": "accelerate.optimizer:AcceleratedOptimizer"}),
                  branch="wrapped")
    fp.Repo(repo.url).restore({"o": opt}, other)
