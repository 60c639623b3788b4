"""Lossless codecs: byte planes + zstd for floats, zstd for the rest, raw when incompressible."""

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.format.codecs import CODECS, codec_for


def _trained_like(dtype, n=300_000):
    torch.manual_seed(0)
    return (torch.randn(n) * 0.02).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.complex64], ids=str)
def test_lossless_round_trip_is_bit_exact(tmp_path, dtype):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless",
                   options=None)
    t = _trained_like(torch.float64 if dtype.is_complex else dtype)
    if dtype.is_complex:
        t = torch.complex(t.float(), t.float().flip(0))
    odd = t[:12_345].clone()
    repo.save({"t": t, "odd": odd, "ints": torch.arange(300_000) % 7})
    out = repo.load()
    assert torch.equal(out["t"], t) and torch.equal(out["odd"], odd)
    assert torch.equal(out["ints"], torch.arange(300_000) % 7)
    codecs = {leaf.path: {c.codec for c in leaf.chunks} for leaf in repo.manifest().leaves}
    assert codecs["ints"] == {"zstd"}
    assert repo.verify().ok
    repo.close()


def test_byte_planes_beat_plain_zstd_on_float_weights(tmp_path):
    sizes = {}
    for codec in ("raw", "zstd", "lossless"):
        repo = fp.Repo(str(tmp_path / codec), create=True, codec=codec)
        sizes[codec] = repo.save({"w": _trained_like(torch.bfloat16, 2_000_000),
                                  "f": _trained_like(torch.float32, 2_000_000)}).stored_bytes
        repo.close()
    assert sizes["lossless"] < sizes["zstd"] < sizes["raw"]


def test_incompressible_chunks_are_stored_raw(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    noise = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 4_000_000, dtype=np.uint8))
    v = repo.save({"noise": noise.view(torch.float32)})
    assert {c.codec for c in repo.manifest().leaves[0].chunks} == {"raw"}
    assert v.stored_bytes <= noise.numel() + 4096 * 2
    assert torch.equal(repo.load()["noise"].view(torch.uint8), noise)


def test_codec_policy_errors_and_registry():
    with pytest.raises(ValueError, match="codec must be one of"):
        fp.Repo("mem://bad-codec", create=True, codec="lzma")
    assert codec_for("lossless", 4, True).name == "planes+zstd"
    assert codec_for("lossless", 8, False).name == "zstd"
    assert {c.name for c in CODECS.values()} >= {"raw", "zstd", "planes+zstd"}


def test_du_reports_ratio_by_codec(tmp_path):
    import json
    import subprocess
    import sys

    url = str(tmp_path / "r")
    repo = fp.Repo(url, create=True, codec="lossless")
    repo.save({"w": _trained_like(torch.bfloat16, 1_000_000), "i": torch.arange(500_000) % 3})
    repo.close()
    out = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "du", "-r", url, "--json"],
                         capture_output=True, text=True, check=True)
    codecs = json.loads(out.stdout)["codecs"]
    assert set(codecs) == {"planes+zstd", "zstd"}
    planes = codecs["planes+zstd"]
    assert planes["decoded_bytes"] == 2_000_000 and planes["stored_bytes"] < planes["decoded_bytes"]
    human = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "du", "-r", url],
                           capture_output=True, text=True, check=True).stdout
    assert "planes+zstd" in human and "ratio" in human


def test_codec_per_path_pattern(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec={"optim/*": "lossless", "*": "raw"})
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    repo.save({"model": model, "optim": opt})
    codecs = {leaf.path: {c.codec for c in leaf.chunks} for leaf in repo.manifest().leaves}
    assert codecs["model/weight"] == {"raw"}
    assert codecs["optim/state/0/exp_avg_sq"] == {"planes+zstd"}
    out = repo.load()
    assert torch.equal(out["optim"]["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])
    with pytest.raises(ValueError, match="for 'model/\\*'"):
        fp.Repo(str(tmp_path / "r2"), create=True, codec={"model/*": "fast"})
    repo.close()
