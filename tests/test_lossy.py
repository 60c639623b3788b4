"""Opt-in lossy modes: value-relative error bounds (never range-relative), narrower-type
precision, per-path choice, recorded and shown, never the default."""

import numpy as np
import pytest
from click.testing import CliRunner

import forkpoint as fp
from forkpoint.cli.main import cli

torch = pytest.importorskip("torch")


def adam_like(n=1 << 19, seed=0):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(n).astype(np.float32)
    second = (rng.standard_normal(n).astype(np.float32) ** 2) * np.float32(1e-8) + np.float32(1e-12)
    second[:3] = [0.0, np.float32(3e-39), np.float32(1e-30)]
    weights[:3] = [np.inf, np.nan, -0.0]
    return weights, second


def rel_err(a, b):
    ok = np.isfinite(a) & (a != 0)
    return float(np.max(np.abs(b[ok].astype(np.float64) - a[ok]) / np.abs(a[ok])))


def test_value_relative_bound_keeps_small_moments(tmp_path):
    weights, second = adam_like()
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec={"optim/*": fp.Lossy(rel_error=1e-3), "*": "raw"})
    v = repo.save({"model": {"w": weights}, "optim": {"exp_avg_sq": second}})
    back = repo.load(v.id)
    assert np.array_equal(back["model"]["w"], weights, equal_nan=True), "other paths stay exact"
    got = back["optim"]["exp_avg_sq"]
    assert rel_err(second, got) <= 1e-3
    assert (got[second != 0] != 0).all(), "no small value became zero"
    assert got[1] == second[1] and got[0] == 0.0, "subnormals and zeros are kept exactly"
    leaf = next(lf for lf in repo.manifest(v.id).leaves if lf.path == "optim/exp_avg_sq")
    assert leaf.lossy["mode"] == "rel_error=0.001" and 0 < leaf.lossy["max_rel_error"] <= 1e-3
    assert leaf.lossy["max_rel_error"] == pytest.approx(rel_err(second, got))
    assert v.stored_bytes < weights.nbytes + 0.6 * second.nbytes
    assert repo.verify(v.id).ok
    out = CliRunner().invoke(cli, ["show", v.id, "--repo", str(tmp_path / "r")])
    assert out.exit_code == 0 and "LOSSY" in out.output and "optim/exp_avg_sq" in out.output


def test_bfloat16_precision_equals_a_cast_round_trip(tmp_path):
    weights, _ = adam_like(seed=1)
    weights[:3] = 1.0
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec=fp.Lossy(dtype="bfloat16"))
    v = repo.save({"w": torch.from_numpy(weights.copy())})
    got = repo.load(v.id)["w"]
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(weights).to(torch.bfloat16).float())
    assert repo.version(v.id).stored_bytes < 0.6 * weights.nbytes


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("policy", [fp.Lossy(rel_error=1e-3), fp.Lossy(dtype="bfloat16")], ids=["rel", "bf16"])
def test_complex_values_are_rounded_part_by_part_within_the_bound(tmp_path, dtype, policy):
    """The real and imaginary parts are rounded apart, so |stored - value| <= bound * |value|
    (a complex64 was rounded as one float64, which zeroed its real parts)."""
    g = torch.Generator().manual_seed(3)
    z = torch.complex(torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g) * 1e-6).to(dtype)
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec=policy)
    v = repo.save({"z": z})
    got = repo.load(v.id)["z"]
    bound = policy.rel_error or 2.0 ** -8
    wide, back = z.to(torch.complex128), got.to(torch.complex128)
    per_value = ((back - wide).abs() / wide.abs()).max().item()
    assert 0 < per_value <= bound
    for part in (torch.real, torch.imag):
        assert ((part(back) - part(wide)).abs() <= bound * part(wide).abs()).all()
    leaf = repo.manifest(v.id).leaves[0]
    assert per_value <= leaf.lossy["max_rel_error"] <= bound
    assert v.stored_bytes < 0.6 * v.logical_bytes


def test_default_is_exact_and_bad_policies_are_refused(tmp_path):
    weights, _ = adam_like(seed=2)
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    v = repo.save({"w": weights})
    assert np.array_equal(repo.load(v.id)["w"], weights, equal_nan=True)
    assert all(lf.lossy is None for lf in repo.manifest(v.id).leaves)
    with pytest.raises(ValueError):
        fp.Lossy()
    with pytest.raises(ValueError):
        fp.Lossy(rel_error=2.0)
    with pytest.raises(ValueError):
        fp.Lossy(dtype="int8")


@pytest.mark.parametrize("itemsize", [4, 8])
def test_native_rounding_matches_numpy_on_every_kind_of_value(itemsize):
    """The native kernel and the numpy fallback round the same bits and report the same
    error, on random bit patterns (NaNs, infinities, subnormals, zeros, values that would
    round to infinity) and ordinary values, for small and large drops; bad arguments are refused."""
    from forkpoint.codecs import kernels, lossy

    if kernels.planes is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(itemsize)
    uint, ftype = (np.uint32, np.float32) if itemsize == 4 else (np.uint64, np.float64)
    patterns = rng.integers(0, np.iinfo(uint).max, 50_000, dtype=uint, endpoint=True)
    specials = np.array([0, np.inf, -np.inf, np.nan, np.finfo(ftype).max, -np.finfo(ftype).max,
                         np.finfo(ftype).tiny, np.finfo(ftype).smallest_subnormal, 1.0, -1.5], ftype)
    values = np.concatenate([patterns.view(ftype), specials, rng.standard_normal(10_000).astype(ftype)])
    full = lossy.SIGNIFICAND_BITS[itemsize]
    for drop in (1, 5, full - 1):
        native, fallback = values.copy().view(np.uint8), values.copy().view(np.uint8)
        assert kernels.planes.round_significand(native, itemsize, drop) == lossy._round_numpy(fallback, itemsize, drop)
        assert np.array_equal(native, fallback), f"drop {drop}"
    with pytest.raises(ValueError, match="cannot round"):
        kernels.planes.round_significand(values.copy().view(np.uint8), itemsize, full)
    with pytest.raises(ValueError, match="cannot round"):
        kernels.planes.round_significand(bytearray(itemsize + 1), itemsize, 3)
