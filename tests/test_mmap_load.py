"""load(mmap=True): large raw leaves are mapped from local (or /dev/shm) storage instead of
copied, still verified, and writes to them never reach the repository."""

import numpy as np
import pytest

import forkpoint as fp
from forkpoint.errors import CorruptObjectError
from forkpoint.format.objects import object_key

torch = pytest.importorskip("torch")


def state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(1024, 512, generator=g), "b": torch.randn(8, generator=g),
            "h": torch.randn(700, 1024, generator=g).to(torch.bfloat16),
            "a": np.arange(300_000, dtype=np.int64), "step": 3}


def test_mmap_load_equals_load_and_is_copy_on_write(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    s = state()
    v = repo.save(s)
    mapped = repo.load(v.id, mmap=True)
    plain = repo.load(v.id)
    for k in ("w", "b", "h"):
        assert torch.equal(mapped[k], plain[k]) and mapped[k].dtype == s[k].dtype
    assert np.array_equal(mapped["a"], s["a"]) and mapped["step"] == 3
    mapped["w"].add_(1.0)
    mapped["a"][:] = 0
    assert torch.equal(repo.load(v.id)["w"], s["w"]), "writes to a mapped tensor stay private"
    assert repo.verify(v.id).ok


def test_mmap_load_verifies(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    v = repo.save(state())
    leaf = next(lf for lf in repo.manifest(v.id).leaves if lf.path == "w")
    with open(f"{repo.url}/{object_key(leaf.chunks[0].object)}", "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\x00\x01\x02")
    with pytest.raises(CorruptObjectError, match="'w'"):
        repo.load(v.id, mmap=True)


def test_mmap_falls_back_where_it_cannot_map(tmp_path):
    repo = fp.Repo("mem://mmap-fallback", create=True, codec="lossless")
    s = state()
    v = repo.save(s)
    assert torch.equal(repo.load(v.id, mmap=True)["w"], s["w"])
