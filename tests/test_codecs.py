"""Lossless codecs: byte planes + zstd for floats, zstd for the rest, raw when incompressible."""

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.engine.parallel import parallel_map
from helpers.unpaced import encode_every_chunk
from forkpoint.codecs.registry import CODECS, codec_for
from forkpoint.codecs import kernels, planecoders, planeforms


def _trained_like(dtype, n=300_000):
    torch.manual_seed(0)
    return (torch.randn(n) * 0.02).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.complex64], ids=str)
@pytest.mark.parametrize("encode_later", [True, False], ids=["later", "inline"])
def test_lossless_round_trip_is_bit_exact(tmp_path, dtype, encode_later):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless", encode_later=encode_later)
    t = _trained_like(torch.float64 if dtype.is_complex else dtype)
    if dtype.is_complex:
        t = torch.complex(t.float(), t.float().flip(0))
    odd = t[:12_345].clone()
    repo.save({"t": t, "odd": odd, "ints": torch.arange(300_000) % 7})
    for _ in range(2):  # while objects may be rewritten encoded, then after
        out = repo.load()
        assert torch.equal(out["t"], t) and torch.equal(out["odd"], odd)
        assert torch.equal(out["ints"], torch.arange(300_000) % 7)
        repo.drain()
    assert stored_codecs(repo)["ints"] == {"zstd"}
    assert repo.verify().ok
    repo.close()


def stored_codecs(repo) -> dict[str, set[str]]:
    """{leaf path: codecs its chunks' objects are stored with now (their headers)}."""
    from forkpoint.engine.objectwriter import stored_codec
    from forkpoint.format.objects import object_key

    return {leaf.path: {stored_codec(repo.store, object_key(c.object)) for c in leaf.chunks}
            for leaf in repo.manifest().leaves}


def test_synchronous_encoded_saves_read_live_memory_without_a_copy(tmp_path, monkeypatch):
    """A synchronous lossless save encodes large chunks straight from the tensors (no staging
    copy); an asynchronous one copies them first, so the caller may change them once the
    capture is done."""
    from forkpoint.engine import chunksave

    copied = []
    real = chunksave._copy_and_hash
    monkeypatch.setattr(chunksave, "_copy_and_hash", lambda src, dst: (copied.append(src.nbytes), real(src, dst))[1])
    big = _trained_like(torch.float32, 1_000_000)
    original = big.clone()
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless", encode_later=False)
    repo.save({"big": big})
    assert big.nbytes not in copied, "the sync save copied the chunk before encoding it"
    assert [c.codec for c in repo.manifest().leaves[0].chunks] == ["float-planes"]
    pending = repo.save({"big": big}, step=2, sync=False)
    pending.wait_capture()
    big.mul_(2)
    pending.wait()
    assert torch.equal(repo.load("main~1")["big"], original) and torch.equal(repo.load()["big"], original)
    assert repo.verify().ok
    repo.close()


def test_byte_planes_beat_plain_zstd_on_float_weights(tmp_path):
    sizes = {}
    for codec in ("raw", "zstd", "lossless"):
        repo = fp.Repo(str(tmp_path / codec), create=True, codec=codec)
        repo.save({"w": _trained_like(torch.bfloat16, 2_000_000), "f": _trained_like(torch.float32, 2_000_000)})
        repo.drain()
        sizes[codec] = repo.du()["objects_bytes"]
        repo.close()
    assert sizes["lossless"] < sizes["zstd"] < sizes["raw"]


def test_incompressible_chunks_are_stored_raw(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    noise = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 4_000_000, dtype=np.uint8))
    v = repo.save({"noise": noise.view(torch.float32)})
    repo.drain()
    assert stored_codecs(repo)["noise"] == {"raw"}
    assert v.stored_bytes <= noise.numel() + 4096 * 2
    assert torch.equal(repo.load()["noise"].view(torch.uint8), noise)


def test_codec_policy_errors_and_registry():
    with pytest.raises(ValueError, match="codec must be one of"):
        fp.Repo("mem://bad-codec", create=True, codec="lzma")
    assert codec_for("lossless", 4, True).name == "float-planes"
    assert codec_for("lossless", 8, False).name == "zstd"
    assert {c.name for c in CODECS.values()} >= {"raw", "zstd", "planes+zstd", "float-planes"}


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
    assert set(codecs) == {"float-planes", "zstd"}
    planes = codecs["float-planes"]
    assert planes["decoded_bytes"] == 2_000_000 and planes["stored_bytes"] < planes["decoded_bytes"]
    human = subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "du", "-r", url],
                           capture_output=True, text=True, check=True).stdout
    assert "float-planes" in human and "ratio" in human


def test_codec_per_path_pattern(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec={"optim/*": "lossless", "*": "raw"})
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    repo.save({"model": model, "optim": opt})
    repo.drain()
    codecs = stored_codecs(repo)
    assert codecs["model/weight"] == {"raw"}
    assert codecs["optim/state/0/exp_avg_sq"] == {"float-planes"}
    out = repo.load()
    assert torch.equal(out["optim"]["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])
    with pytest.raises(ValueError, match="for 'model/\\*'"):
        fp.Repo(str(tmp_path / "r2"), create=True, codec={"model/*": "fast"})
    repo.close()


def _weights_and_moments(n=400_000, seed=0):
    """Weights-like values (random signs and exponents around 2^-6) and moments with zero runs."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal(n) * 0.02).astype(np.float32)
    moments = (rng.standard_normal(n) * 1e-4).astype(np.float32)
    moments.reshape(-1, 1000)[::2] = 0.0
    return weights, moments


def _moments_with_runs(n=400_000, seed=0):
    """Moments whose every other 1000 values repeat one nonzero value: runs of a byte that is
    not zero, which no bitmap of zeros shortens."""
    rng = np.random.default_rng(seed)
    moments = (rng.standard_normal(n) * 1e-4).astype(np.float32)
    moments.reshape(-1, 1000)[::2] = (rng.standard_normal((n // 2000, 1)) * 1e-4).astype(np.float32)
    return moments


def test_float_codec_chooses_layout_and_coder_per_plane(monkeypatch):
    from forkpoint.codecs import floatcodec

    weights, moments = _weights_and_moments()
    tried = []
    real = planecoders.encode_plane
    monkeypatch.setattr(planecoders, "encode_plane", lambda plane, coder, block=0: tried.append(coder) or real(plane, coder, block))
    rotated, coders, _ = floatcodec.choose(weights.view(np.uint8), 4)
    assert floatcodec.RUNS not in tried, "planes with few runs are not trial-coded with runs"
    monkeypatch.setattr(planecoders, "encode_plane", real)
    assert rotated and coders[-1] == floatcodec.HUFFMAN and coders[:2] == [floatcodec.RAW] * 2, \
        "a weight's exponent is isolated and Huffman-coded, its low mantissa bytes stay raw"
    _, coders, _ = floatcodec.choose(moments.view(np.uint8), 4)
    assert coders[-1] == floatcodec.SPARSE, "half the values zero: a bitmap of the nonzero bytes, then those"
    _, coders, _ = floatcodec.choose(_moments_with_runs().view(np.uint8), 4)
    assert coders[-1] == floatcodec.RUNS, "runs of a nonzero byte are coded by deflate with runs as matches"
    repeats = _long_repeats(400_000)
    _, coders, _ = floatcodec.choose(repeats.view(np.uint8), 4)
    assert coders == [floatcodec.ZSTD] * 4, "values repeating at long distances: every plane by zstd"
    tried.clear()
    monkeypatch.setattr(planecoders, "encode_plane", lambda plane, coder, block=0: tried.append(coder) or real(plane, coder, block))
    floatcodec.choose(moments.view(np.uint8), 4)
    monkeypatch.setattr(planecoders, "encode_plane", real)
    assert tried.count(floatcodec.ZSTD) == 2, \
        "zstd is tried below the top plane only where the top took it (here sparse, in both rotations)"
    import zstandard
    for data in (weights, moments, repeats):
        raw = data.view(np.uint8)
        coded = floatcodec.encode(raw, 4)
        assert len(coded) < len(zstandard.ZstdCompressor(level=3).compress(raw.tobytes()))
        assert bytes(floatcodec.decode(coded, raw.nbytes)) == raw.tobytes()


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("pmap", [None, parallel_map], ids=["serial", "parallel"])
def test_float_codec_round_trips_every_bit_pattern(itemsize, pmap):
    from forkpoint.codecs import floatcodec

    rng = np.random.default_rng(itemsize)
    raw = rng.integers(0, 256, 3 * floatcodec.SEGMENT_BYTES + 5 * itemsize, dtype=np.uint8)
    raw[: raw.nbytes // 2] = 0
    specials = np.array([np.inf, -np.inf, np.nan, -0.0, 1e-45, -3e38], np.float32).view(np.uint8)
    raw[1000:1000 + specials.nbytes] = specials
    for data in (raw, raw[:7 * itemsize + 3], raw[:0]):
        coded = floatcodec.encode(data, itemsize, pmap)
        assert bytes(floatcodec.decode(coded, data.nbytes, pmap)) == data.tobytes()


def test_float_codec_pieces_are_the_payload_and_outlive_later_encodes():
    from forkpoint.codecs import floatcodec
    from forkpoint.codecs.registry import codec_by_name

    weights, moments = _weights_and_moments()
    first = floatcodec.encode_pieces(weights.view(np.uint8), 4, parallel_map)
    joined = b"".join(first)
    floatcodec.encode_pieces(moments.view(np.uint8), 4, parallel_map)
    assert b"".join(first) == joined, "a later encode must not overwrite the pieces of an earlier one"
    assert joined == floatcodec.encode(weights.view(np.uint8), 4, parallel_map)
    assert bytes(floatcodec.decode(joined, weights.nbytes)) == weights.tobytes()
    zstd = codec_by_name("zstd")
    assert b"".join(zstd.pieces(memoryview(moments.view(np.uint8)), 4)) == zstd.encode(memoryview(moments.view(np.uint8)), 4)
    scratch = np.full(weights.nbytes + 100, 0xAB, np.uint8)
    assert b"".join(codec_by_name("float-planes").pieces(weights.view(np.uint8), 4, parallel_map, scratch)) == joined, \
        "a caller's scratch buffer gives the same payload"


@pytest.mark.parametrize("shape", [(1024, 1024), (3000, 768), (1000, 1000), (333,)])
def test_aligned_float_payloads_place_raw_planes_on_block_boundaries(shape):
    """With `at` (the payload's offset in its file), each raw plane of a segment whose element
    count is a multiple of 4096 starts at a file offset that is a multiple of 4096, as a view
    of the page-aligned work buffer (so direct I/O sends it from there); where rows allow,
    segments are sized so (768-wide rows: 1360 of them). The payload is version 6, decodes
    bit-exact, costs at most a block more per segment, and refuses a skew of a block or more."""
    from forkpoint.codecs import floatcodec
    from forkpoint.storage.memory import aligned_buffer

    rng = np.random.default_rng(5)
    data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    plain = b"".join(floatcodec.encode_pieces(data.view(np.uint8), 4, row=shape[-1] if len(shape) > 1 else 0))
    out = aligned_buffer(data.nbytes)
    pieces = floatcodec.encode_pieces(data.view(np.uint8), 4, out=out, row=shape[-1] if len(shape) > 1 else 0, at=16)
    payload = b"".join(pieces)
    assert payload[0] == floatcodec.ALIGNED_VERSION and bytes(floatcodec.decode(payload, data.nbytes)) == data.tobytes()
    per = floatcodec._HEAD.unpack_from(payload)[4]
    segments = -(-data.size // per)
    assert len(payload) <= len(plain) + 4 + segments * 4096
    if len(shape) > 1 and shape[-1] in (768, 1024):
        assert per % 4096 == 0
    base = out.__array_interface__["data"][0]
    pos, aligned_planes = 16, 0
    for piece in pieces:
        view = np.frombuffer(piece, np.uint8) if len(piece) else None
        if view is not None and np.shares_memory(view, out):  # a raw plane
            offset = view.__array_interface__["data"][0] - base
            lo = offset // (4 * per) * per
            if (min(data.size, lo + per) - lo) % 4096 == 0:
                assert pos % 4096 == 0 and offset % 4096 == 0
                aligned_planes += 1
        pos += len(piece)
    assert aligned_planes >= 3 * (data.size // per if per % 4096 == 0 else 0)
    skewed = bytearray(payload)
    skewed[2:4] = (4096).to_bytes(2, "little")
    with pytest.raises(ValueError):
        floatcodec.decode(bytes(skewed), data.nbytes)


def test_a_lossless_save_sends_raw_planes_to_disk_without_copying_them(tmp_path, monkeypatch):
    """Saved with direct I/O, a lossless object's raw planes (three of a float32 weight's four)
    go to disk from the encoder's buffer: what passes through the bounce buffer is the coded
    planes and heads, a third of the stored bytes at most; the version round-trips."""
    from forkpoint.storage import local

    copied = []
    copy = local._copy
    monkeypatch.setattr(local, "_copy", lambda dst, src: copied.append(src.nbytes) or copy(dst, src))
    repo = encode_every_chunk(fp.Repo(str(tmp_path / "r"), create=True, codec="lossless"))
    state = {f"w{i}": torch.randn(1024, 1024) * 0.02 for i in range(4)}
    version = repo.save(state)
    if not repo.store.direct_io:
        pytest.skip("this file system refuses O_DIRECT")
    assert {c.codec for leaf in repo.manifest(version.id).leaves for c in leaf.chunks} == {"float-planes"}
    assert 0 < sum(copied) < version.stored_bytes / 3, (sum(copied), version.stored_bytes)
    loaded = repo.load(version.id)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    repo.close()


def test_damaged_float_payload_is_refused(tmp_path):
    from forkpoint.errors import CorruptObjectError

    weights, _ = _weights_and_moments()
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    repo.save({"w": torch.from_numpy(weights)})
    repo.drain()
    chunk = repo.manifest().leaves[0].chunks[0]
    path = tmp_path / "r" / "objects" / chunk.object[:2] / chunk.object
    data = bytearray(path.read_bytes())
    data[40] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError, match=chunk.object):
        fp.Repo(str(tmp_path / "r")).load()


def test_restore_in_place_decodes_into_the_tensor_and_refuses_damage(tmp_path, monkeypatch):
    """Restoring encoded chunks into existing tensors decodes straight into their memory (no
    decoded copy), bit-exactly; a damaged payload or one that decodes to other bytes is
    refused naming the object; chunks whose codec cannot decode in place still restore."""
    from forkpoint.errors import CorruptObjectError, MissingObjectError
    from forkpoint.codecs import floatcodec

    weights, moments = _weights_and_moments()
    state = {"w": torch.from_numpy(weights), "m": torch.from_numpy(moments),
             "ints": torch.arange(500_000) % 11}
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    repo.save(state)
    repo.drain()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    decoded = []
    real = floatcodec.decode
    monkeypatch.setattr(floatcodec, "decode", lambda *a, **k: (decoded.append(k.get("out") is not None), real(*a, **k))[1])
    fresh = fp.Repo(str(tmp_path / "r"))
    fresh.restore(target, "main")
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert decoded and all(decoded), "every float-planes chunk was decoded into the target"
    leaf = next(lf for lf in repo.manifest().leaves if lf.path == "w")
    path = tmp_path / "r" / "objects" / leaf.chunks[0].object[:2] / leaf.chunks[0].object
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError, match=leaf.chunks[0].object):
        fp.Repo(str(tmp_path / "r")).restore({k: torch.zeros_like(v) for k, v in state.items()}, "main")
    path.unlink()
    with pytest.raises(MissingObjectError, match=leaf.chunks[0].object):
        fp.Repo(str(tmp_path / "r")).restore({k: torch.zeros_like(v) for k, v in state.items()}, "main")
    payload = floatcodec.encode(weights.view(np.uint8), 4)
    for wrong in (np.empty(weights.nbytes - 4, np.uint8), np.empty(weights.size, np.float32),
                  np.empty(2 * weights.nbytes, np.uint8)[::2]):
        with pytest.raises(ValueError, match="decode target"):
            floatcodec.decode_into(payload, weights.nbytes, wrong)


def test_objects_of_the_previous_float_codec_still_read():
    planes = CODECS[2]
    data = np.arange(10_000, dtype=np.float32).view(np.uint8)
    assert bytes(planes.decode(planes.encode(memoryview(data), 4), data.nbytes)) == data.tobytes()


def test_rotated_layout_is_the_documented_16_bit_rotation():

    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 9, 1003):
        top, below = rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8)
        word = (top.astype(np.uint32) << 8) | below
        turned = ((word << 1) | (word >> 15)) & 0xFFFF
        t, b = top.copy(), below.copy()
        planeforms._rotate(t, b, True)
        assert np.array_equal(t, turned >> 8) and np.array_equal(b, turned & 0xFF)
        planeforms._rotate(t, b, False)
        assert np.array_equal(t, top) and np.array_equal(b, below)
    exponent = np.array([1.0, -2.0, 3e-5, 1e30], np.float32).view(np.uint8).reshape(-1, 4)
    t, b = exponent[:, 3].copy(), exponent[:, 2].copy()
    planeforms._rotate(t, b, True)
    assert list(t) == [127, 128, 127 - 16, 127 + 99], "the top plane holds the biased exponent"


def _skewed_bytes(kind: str, n: int, rng) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "constant":
        return np.full(n, 7, np.uint8)
    if kind == "geometric":
        return (rng.geometric(0.3, n) % 256).astype(np.uint8)
    if kind == "two":
        return rng.choice(np.array([3, 200], np.uint8), n)
    if kind == "runs":
        values = (rng.geometric(0.4, n // 8 + 1) % 256).astype(np.uint8)
        lengths = rng.choice(np.array([1, 2, 3, 4, 257, 258, 259, 260, 261, 600, 5000]), values.size)
        return np.repeat(values, lengths)[:n]
    fib = [1, 1]
    while len(fib) < 28:
        fib.append(fib[-1] + fib[-2])
    data = np.concatenate([np.full(f, i, np.uint8) for i, f in enumerate(fib)])[:n]
    rng.shuffle(data)
    return data


@pytest.mark.parametrize("kind", ["uniform", "constant", "geometric", "two", "fibonacci", "runs"])
def test_native_huffman_writes_standard_deflate_streams(kind):
    """The native coder's output inflates with the standard zlib, for every block size and
    length, including frequencies that need codes longer than the 14-bit limit, with and
    without runs (every run length around deflate's 258 cap, runs across block edges)."""
    import zlib

    if kernels.planes is None:
        pytest.skip("native kernels not built (no C compiler at install time)")
    rng = np.random.default_rng(1)
    for n in (0, 1, 3, 1023, 16384, 16385, 100_003, 600_000):
        data = _skewed_bytes(kind, n, rng).tobytes()
        for block in (1024, 16384, 1 << 20):
            for runs in (False, True):
                coded = kernels.planes.huffman_deflate(data, block, runs)
                assert zlib.decompress(coded, -15) == data, (kind, n, block, runs)
    if kind in ("constant", "runs") and n:
        assert len(kernels.planes.huffman_deflate(data, 16384, True)) < \
            0.5 * len(kernels.planes.huffman_deflate(data, 16384)), "runs shrink what literals cannot"
    if kind == "geometric":
        packer = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
        reference = len(packer.compress(data) + packer.flush())
        assert len(kernels.planes.huffman_deflate(data, 16384)) < 1.01 * reference
    with pytest.raises(ValueError, match="block"):
        kernels.planes.huffman_deflate(b"abc", 10)


@pytest.mark.parametrize("runs", [False, True])
def test_native_huffman_joins_pieces_of_one_distribution_and_splits_where_it_changes(runs):
    """Pieces of a plane whose bytes keep one distribution share one block (no header and code
    per piece: within a few bytes of coding the plane as a single block), with and without
    runs; where the distribution changes, a new block starts (smaller than one block over both
    halves)."""
    import zlib

    if kernels.planes is None:
        pytest.skip("native kernels not built (no C compiler at install time)")
    rng = np.random.default_rng(3)
    steady = (rng.geometric(0.3, 1 << 20) % 256).astype(np.uint8)
    if runs:
        steady[rng.integers(0, steady.size - 64, 2000)[:, None] + np.arange(64)] = 0
    pieces = kernels.planes.huffman_deflate(steady, 16384, runs)
    whole = kernels.planes.huffman_deflate(steady, 1 << 20, runs)
    assert zlib.decompress(pieces, -15) == steady.tobytes()
    assert len(pieces) <= len(whole) + 64 * (runs + 1), "pieces of one distribution should code as few blocks"
    shifted = np.concatenate([steady[: 1 << 19], (steady[: 1 << 19] + 128).astype(np.uint8)])
    pieces = kernels.planes.huffman_deflate(shifted, 16384, runs)
    assert zlib.decompress(pieces, -15) == shifted.tobytes()
    assert len(pieces) < 0.9 * len(kernels.planes.huffman_deflate(shifted, 1 << 20, runs))


@pytest.mark.parametrize("kind", ["uniform", "constant", "geometric", "two", "fibonacci", "runs"])
def test_native_huffman_size_is_counted_exactly_without_coding(kind):
    """huffman_bytes(data, block), which choose uses instead of a trial encode, is the size of
    the stream huffman_deflate(data, block) writes, to the byte: the same blocks (a plane whose
    distribution changes halfway splits), the same codes, clamped at the 14-bit limit."""
    native = kernels.planes
    if native is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(11)
    for n in (0, 1, 3, 1023, 16384, 100_003):
        data = _skewed_bytes(kind, n, rng)
        shifted = np.concatenate([data, (data + 128).astype(np.uint8)])
        for block in (1024, 16384, 1 << 20):
            for plane in (data, shifted):
                assert native.huffman_bytes(plane, block) == len(native.huffman_deflate(plane, block)), (kind, n, block)
    with pytest.raises(ValueError, match="block"):
        native.huffman_bytes(b"abc", 10)


def test_an_encode_samples_a_sixteenth_of_a_small_chunk_and_estimates_keep_the_full_sample(monkeypatch):
    """Choosing a 1 MiB float32 chunk's layout for an encode looks at 1/SAMPLE_SHARE of it (half
    the fixed sample: its choice costs half as much); `estimate` still codes the fixed sample,
    and estimate(sample(data)) == estimate(data) holds."""
    from forkpoint.codecs import floatcodec
    weights = (np.random.default_rng(2).standard_normal(1 << 18) * 0.02).astype(np.float32)
    data = weights.view(np.uint8)
    seen = []
    real = planeforms.to_planes
    monkeypatch.setattr(floatcodec, "to_planes", lambda e, i, r, p: seen.append(p.shape[1]) or real(e, i, r, p))
    floatcodec.encode_pieces(data, 4)
    assert seen[0] == (1 << 18) // floatcodec.SAMPLE_SHARE
    seen.clear()
    estimated = floatcodec.estimate(data, 4)
    assert seen[0] == floatcodec.SAMPLE_PIECES * floatcodec.SAMPLE_ELEMENTS
    assert floatcodec.estimate(floatcodec.sample(data, 4), 4) == estimated
    big = np.tile(weights, 8).view(np.uint8)
    seen.clear()
    floatcodec.encode_pieces(big[:floatcodec.SEGMENT_BYTES], 4)
    assert seen[0] == floatcodec.SAMPLE_PIECES * floatcodec.SAMPLE_ELEMENTS, "a full segment keeps the fixed sample"


def _sparse_bytes_cases(rng):
    for n in [*range(70), 1000, 4097, 100_003]:
        for zeros in (0.0, 0.5, 0.9, 1.0):
            plane = rng.integers(1, 256, n, dtype=np.uint8)
            plane[rng.random(n) < zeros] = 0
            yield plane


def test_sparse_planes_split_join_and_read_back_across_builds(monkeypatch):
    """A sparse plane is a bitmap of its nonzero bytes (least significant bit first) and those
    bytes: the native split matches numpy's, at every length around the kernels' 8- and 16-byte
    steps and every share of zeros, and what either build writes the other reads."""
    native = kernels.planes
    rng = np.random.default_rng(13)
    for plane in _sparse_bytes_cases(rng):
        if native is not None:
            bitmap, nonzero = planecoders._split_sparse(plane)
            assert np.array_equal(bitmap, np.packbits(plane != 0, bitorder="little"))
            assert np.array_equal(nonzero, plane[plane != 0])
        coded = planecoders._pack_sparse(plane)
        monkeypatch.setattr(kernels, "planes", None)
        by_numpy = planecoders._pack_sparse(plane)
        for payload in (coded, by_numpy):
            out = np.full(plane.size, 7, np.uint8)
            planecoders._unpack_sparse(payload, out)
            assert np.array_equal(out, plane)
        monkeypatch.setattr(kernels, "planes", native)
        out = np.full(plane.size, 7, np.uint8)
        planecoders._unpack_sparse(by_numpy, out)
        assert np.array_equal(out, plane)


def test_a_sparse_planes_bitmap_codes_runs_only_where_it_has_them():
    """Scattered nonzero bytes give a bitmap without runs, coded Huffman-only (as small, and
    faster); rows that are all zero give stretches of zero bitmap bytes, coded with runs. The
    trial size (_sparse_bytes) is the packed size either way, and both read back."""
    from forkpoint.codecs import floatcodec
    rng = np.random.default_rng(5)
    scattered = rng.integers(1, 256, 1 << 18, dtype=np.uint8)
    scattered[rng.random(scattered.size) < 0.6] = 0
    stretches = scattered.copy()
    stretches.reshape(-1, 256)[::2] = 0
    for plane, coder in ((scattered, floatcodec.HUFFMAN), (stretches, floatcodec.RUNS)):
        bitmap, _ = planecoders._split_sparse(plane)
        assert planecoders._bitmap_coder(bitmap)[0] == coder
        packed = planecoders._pack_sparse(plane)
        assert planecoders._sparse_bytes(plane) == len(packed)
        out = np.empty(plane.size, np.uint8)
        planecoders._unpack_sparse(packed, out)
        assert np.array_equal(out, plane)


def test_native_sparse_kernels_refuse_wrong_buffers():
    """split_sparse refuses a bitmap or nonzero room too small for the data; join_sparse refuses
    a bitmap of the wrong length, one that marks bytes past the plane's end, and one that marks
    more or fewer bytes than it is given; none writes out of bounds."""
    native = kernels.planes
    if native is None:
        pytest.skip("native kernels not built")
    data = np.array([0, 5, 0, 7, 9, 0, 0, 0, 0, 3], np.uint8)
    with pytest.raises(ValueError, match="bitmap of 2 bytes"):
        native.split_sparse(data, np.empty(1, np.uint8), np.empty(18, np.uint8))
    with pytest.raises(ValueError, match="room for 18"):
        native.split_sparse(data, np.empty(2, np.uint8), np.empty(10, np.uint8))
    bitmap, nonzero = np.empty(2, np.uint8), np.empty(18, np.uint8)
    count = native.split_sparse(data, bitmap, nonzero)
    out = np.empty(10, np.uint8)
    with pytest.raises(ValueError, match="bitmap of 2 bytes, not 3"):
        native.join_sparse(np.zeros(3, np.uint8), nonzero[:count].copy(), out)
    past = bitmap.copy()
    past[1] |= 1 << 5
    with pytest.raises(ValueError, match="past its end"):
        native.join_sparse(past, nonzero[:count].copy(), out)
    with pytest.raises(ValueError, match="marks 4 nonzero bytes, it holds 3"):
        native.join_sparse(bitmap, nonzero[:count - 1].copy(), out)
    native.join_sparse(bitmap, nonzero[:count].copy(), out)
    assert np.array_equal(out, data)


def test_portable_and_vector_sparse_kernels_agree(tmp_path):
    """FORKPOINT_PORTABLE_KERNELS=1 keeps the sparse split and join off their SSSE3 path: a
    process so started writes the same bitmap and bytes and joins them back."""
    import os
    import subprocess
    import sys

    if kernels.planes is None:
        pytest.skip("native kernels not built")
    planes = list(_sparse_bytes_cases(np.random.default_rng(17)))
    np.savez(tmp_path / "planes.npz", *planes)
    script = ("import sys, numpy as np; from forkpoint.codecs import kernels, planecoders as c; "
              "d = np.load(sys.argv[1]); out = {}\n"
              "for k in d.files:\n"
              "    b, z = (x.copy() for x in c._split_sparse(d[k])); back = np.empty_like(d[k])\n"
              "    kernels.planes.join_sparse(b, z, back); assert (back == d[k]).all(); out[k] = np.concatenate([b, z])\n"
              "np.savez(sys.argv[2], **out)")
    env = {**os.environ, "FORKPOINT_PORTABLE_KERNELS": "1"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "planes.npz"), str(tmp_path / "portable.npz")],
                   env=env, check=True)
    portable = np.load(tmp_path / "portable.npz")
    for i, plane in enumerate(planes):
        assert np.array_equal(portable[f"arr_{i}"], np.concatenate(planecoders._split_sparse(plane)))


def _kernel_cases() -> list[tuple[np.ndarray, int]]:
    """Buffers that take every vector path: trained-like bf16, fp32 and fp64 of odd lengths (the
    plane split's tails), wide byte planes (Huffman blocks too varied for pair tables), rows
    that match earlier rows, a scattered delta (sparse planes)."""
    rng = np.random.default_rng(23)
    weights, moments = _weights_and_moments(n=200_000)
    cases = [(np.concatenate([weights, moments[:-3]]).view(np.uint8), 4),
             (torch.from_numpy(weights[:-5]).to(torch.bfloat16).view(torch.uint8).numpy(), 2),
             (rng.standard_normal(30_001).view(np.uint8), 8),
             (_skewed_bytes("geometric", 300_000, rng) * 3 + rng.integers(0, 3, 300_000, dtype=np.uint8), 2),
             (_scattered_delta(n=1 << 18), 2)]
    rows = np.exp(rng.normal(0, 2, (4, 256)))[rng.integers(0, 4, 2000)] * np.exp2(2 * rng.integers(-10, -5, 2000))[:, None]
    cases.append((torch.from_numpy(rows).to(torch.bfloat16).view(torch.uint8).numpy().reshape(-1), 2))
    return cases


@pytest.mark.parametrize("portable", ["avx512", "1"])
def test_vector_kernels_write_and_read_the_payloads_of_the_portable_ones(tmp_path, portable):
    """A process started with FORKPOINT_PORTABLE_KERNELS ("avx512": no AVX-512 path; "1": no
    vector path) writes the same payloads as this one, byte for byte, and each process decodes
    the other's."""
    import json
    import os
    import subprocess
    import sys

    from forkpoint.codecs import floatcodec
    if kernels.planes is None:
        pytest.skip("native kernels not built")
    cases = _kernel_cases()
    here = kernels.planes.kernels()
    if portable == "avx512" and "avx512" not in here.values():
        pytest.skip(f"this processor takes no AVX-512 path ({here})")
    np.savez(tmp_path / "cases.npz", *[data for data, _ in cases])
    mine = [floatcodec.encode(data, itemsize) for data, itemsize in cases]
    for i, payload in enumerate(mine):
        (tmp_path / f"mine{i}").write_bytes(payload)
    script = ("import sys, json, numpy as np; from pathlib import Path; from forkpoint.codecs import floatcodec as f, kernels\n"
              "d = np.load(sys.argv[1]); sizes = json.loads(sys.argv[2]); at = Path(sys.argv[3])\n"
              "for i, k in enumerate(d.files):\n"
              "    (at / f'theirs{i}').write_bytes(f.encode(d[k], sizes[i]))\n"
              "    mine = f.decode((at / f'mine{i}').read_bytes(), d[k].nbytes)\n"
              "    assert mine.tobytes() == d[k].tobytes(), i\n"
              "print(json.dumps(kernels.planes.kernels()))")
    env = {**os.environ, "FORKPOINT_PORTABLE_KERNELS": portable}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.npz"),
                           json.dumps([itemsize for _, itemsize in cases]), str(tmp_path)],
                          env=env, check=True, capture_output=True, text=True)
    theirs = json.loads(done.stdout)
    assert "avx512" not in theirs.values() and (portable == "avx512" or set(theirs.values()) == {"portable"})
    for i, (data, _) in enumerate(cases):
        assert (tmp_path / f"theirs{i}").read_bytes() == mine[i], i
        assert bytes(floatcodec.decode(mine[i], data.nbytes)) == data.tobytes()


def test_kernels_report_takes_no_argument_and_unknown_settings_mean_portable(kernels_setting):
    """kernels() refuses arguments; a FORKPOINT_PORTABLE_KERNELS value other than "0", "" or
    "avx512" keeps every kernel portable."""
    import json

    if kernels.planes is None:
        pytest.skip("native kernels not built")
    with pytest.raises(TypeError):
        kernels.planes.kernels(1)

    def chosen(value):
        return json.loads(kernels_setting(value, "import json; from forkpoint.codecs import _planes; "
                                                 "print(json.dumps(_planes.kernels()))"))
    default = chosen(None)
    assert set(default) == {"match_rows", "planes", "literals", "sparse"}
    assert set(chosen("yes").values()) == {"portable"}
    assert chosen("0") == chosen("") == default


def _scattered_delta(n=1 << 20, unchanged=0.85, seed=0):
    """The XOR of two bf16 tensors of which `unchanged` of the elements are equal, scattered
    (an optimizer step that rounds most updates away): zero bytes with no long runs."""
    import torch

    from forkpoint.codecs.delta import make_delta
    rng = np.random.default_rng(seed)
    before = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    after = before.clone()
    moved = torch.from_numpy(rng.random(n) >= unchanged)
    noise = torch.from_numpy(rng.standard_normal(int(moved.sum())).astype(np.float32))
    after[moved] = (after[moved].float() * (1 + 0.01 * noise)).to(torch.bfloat16)
    view = lambda t: t.view(torch.uint8).numpy()  # noqa: E731
    return make_delta("xor", view(after), view(before), 2)


def test_scattered_zeros_are_coded_as_a_bitmap_and_the_nonzero_bytes(monkeypatch):
    """Deltas where most elements did not change, scattered: both planes are coded sparse
    (payload version 5), smaller than the best coding without it, bit-exact."""
    from forkpoint.codecs import floatcodec
    data = _scattered_delta()
    _, coders, _ = floatcodec.choose(data, 2)
    assert coders == [floatcodec.SPARSE, floatcodec.SPARSE]
    payload = floatcodec.encode(data, 2)
    assert payload[0] == floatcodec.SPARSE_VERSION == 5
    with monkeypatch.context() as without:
        without.setattr(planecoders, "SPARSE_MIN_ZEROS", 2.0)
        plain = floatcodec.encode(data, 2)
        assert plain[0] < floatcodec.SPARSE_VERSION
    assert len(payload) < 0.95 * len(plain), f"{len(payload)} bytes sparse against {len(plain)}"
    for pmap in (None, parallel_map):
        assert bytes(floatcodec.decode(payload, data.nbytes, pmap)) == data.tobytes()


@pytest.mark.parametrize("kind", ["native", "numpy"])
def test_damaged_sparse_planes_are_refused(monkeypatch, kind):
    """A sparse plane whose head names more bytes than it has, whose bitmap does not mark as
    many bytes as it holds, or that a payload of version 4 names, is refused with what is wrong."""
    import struct

    from forkpoint.codecs import floatcodec
    data = _scattered_delta(n=100_000)
    payload = bytearray(floatcodec.encode(data, 2))
    if kind == "numpy":
        monkeypatch.setattr(kernels, "planes", None)
    head = floatcodec._HEAD.size + floatcodec._ROW.size
    assert payload[head + 1] == floatcodec.SPARSE, "the low plane is coded sparse"
    low_at = head + 3 + 8
    bitmap_bytes, count = struct.unpack_from("<II", payload, low_at)
    for damage, message in (((bitmap_bytes, count + 1), "damaged"), ((bitmap_bytes + 10 ** 6, count), "damaged"),
                            ((bitmap_bytes, data.nbytes), "damaged")):
        bad = bytearray(payload)
        struct.pack_into("<II", bad, low_at, *damage)
        with pytest.raises(ValueError, match=message):
            floatcodec.decode(bytes(bad), data.nbytes)
    as_v4 = bytes([floatcodec.MATCH_VERSION]) + bytes(payload[1:])
    with pytest.raises(ValueError, match="unknown plane coder"):
        floatcodec.decode(as_v4, data.nbytes)
    assert bytes(floatcodec.decode(bytes(payload), data.nbytes)) == data.tobytes()


def test_native_kernels_are_built_where_a_compiler_is():
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert kernels.planes is not None, "pip install should have built forkpoint.codecs._planes"


def test_native_plane_stats_match_numpy(monkeypatch):
    """plane_stats, which choose asks of every sample plane without holding the GIL, gives what
    the numpy fallback computes: entropy, zero bytes, bit 0 seen, and the share of bytes equal to
    the two before them (runs across the native kernel's 64-byte masks)."""
    native = kernels.planes
    if native is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(9)
    cases = [np.empty(0, np.uint8), np.full(1, 3, np.uint8), np.full(3, 3, np.uint8)]
    for n in (63, 64, 65, 127, 128, 129, 1000, 100_003):
        cases += [(rng.geometric(0.3, n) % 256).astype(np.uint8), np.repeat(rng.integers(0, 256, n, dtype=np.uint8), 5)[:n],
                  (rng.integers(0, 128, n, dtype=np.uint8) * 2)]
    for plane in cases:
        entropy, zeros, odd, share = native.plane_stats(plane, True)
        monkeypatch.setattr(kernels, "planes", None)
        want = planecoders.plane_stats(plane, runs=True)
        monkeypatch.setattr(kernels, "planes", native)
        assert abs(entropy - want[0]) <= 1e-9 * max(1, plane.size) and (zeros, odd) == want[1:3]
        assert share == pytest.approx(want[3], abs=1e-12)
        assert native.plane_stats(plane)[3] == 0.0, "the run share is counted only where asked"


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_native_planes_match_numpy_and_payloads_cross_read(itemsize, monkeypatch):
    from forkpoint.codecs import floatcodec
    native = kernels.planes
    if native is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(itemsize)
    raw = rng.integers(0, 256, itemsize * 10_001, dtype=np.uint8)
    for rotated in (False, True):
        mine = np.empty((itemsize, 10_001), np.uint8)
        native.to_planes(raw, mine, itemsize, rotated)
        monkeypatch.setattr(kernels, "planes", None)
        reference = np.empty_like(mine)
        planeforms.to_planes(raw, itemsize, rotated, reference)
        monkeypatch.setattr(kernels, "planes", native)
        assert np.array_equal(mine, reference)
        back = np.empty_like(raw)
        native.from_planes(mine, back, itemsize, rotated)
        assert np.array_equal(back, raw)
    with pytest.raises(ValueError, match="itemsize"):
        native.to_planes(raw, np.empty(raw.nbytes - itemsize, np.uint8), itemsize, False)
    with pytest.raises(ValueError, match="itemsize 3"):
        native.from_planes(raw[:9], np.empty(9, np.uint8), 3, False)
    weights, moments = _weights_and_moments()
    data = np.concatenate([weights, moments]).view(np.uint8)
    with_native = floatcodec.encode(data, 4)
    monkeypatch.setattr(kernels, "planes", None)
    without = floatcodec.encode(data, 4)
    assert bytes(floatcodec.decode(with_native, data.nbytes)) == data.tobytes()
    monkeypatch.setattr(kernels, "planes", native)
    assert bytes(floatcodec.decode(without, data.nbytes)) == data.tobytes()


def _long_repeats(n, seed=3):
    """Moment-like values that repeat a 1000-element pattern: matches far apart, few runs."""
    rng = np.random.default_rng(seed)
    return np.tile((rng.standard_normal(1000) * 1e-4).astype(np.float32), n // 1000)


def test_each_segment_picks_its_own_coders():
    """A chunk holding weights, values repeating far apart, then moments with zero runs codes
    the first's exponents with Huffman, the second's with zstd and the third's with deflate
    runs (payload version 2 records a layout per segment; runs are a deflate stream, coder 2)."""
    import struct

    from forkpoint.codecs import floatcodec
    n = floatcodec.SEGMENT_BYTES // 4 // 1000 * 1000
    weights, _ = _weights_and_moments(n=n)
    data = np.concatenate([weights, _long_repeats(n), _moments_with_runs(n)]).view(np.uint8)
    layouts = floatcodec.Layouts()
    coded = b"".join(floatcodec.encode_pieces(data, 4, layouts=layouts))
    version, itemsize, _, count, per = struct.unpack_from("<BBBxQI", coded)
    assert (version, itemsize, count, per) == (2, 4, 3 * n, floatcodec.SEGMENT_BYTES // 4)
    first, second, third = coded[16:21], coded[21:26], coded[26:31]
    assert first[0] == 1 and first[4] == floatcodec.HUFFMAN, "weights: rotated, exponent by Huffman"
    assert second[4] == floatcodec.ZSTD, "repeats far apart: exponent by zstd"
    assert third[4] == floatcodec.HUFFMAN and layouts.segments[2][1][3] == floatcodec.RUNS, \
        "zero runs: a deflate stream with runs, which the reused layouts remember as such"
    assert bytes(floatcodec.decode(coded, data.nbytes)) == data.tobytes()
    damaged = bytearray(coded)
    damaged[20] = 9
    with pytest.raises(ValueError, match="unknown plane coder"):
        floatcodec.decode(bytes(damaged), data.nbytes)


def test_runs_coder_reads_stretches_across_its_64_byte_masks():
    """The runs coder compares bytes 64 at a time: stretches of one value, of every length
    from 1 to 70, starting at every offset around a 64-byte edge (and at the very start),
    inflate back to the data, and a long stretch costs a few match codes, not a byte each."""
    import zlib

    if kernels.planes is None:
        pytest.skip("native kernels not built (no C compiler at install time)")
    rng = np.random.default_rng(64)
    for offset in [0, 1, *range(56, 73), *range(120, 131)]:
        for length in range(1, 71):
            data = bytearray(rng.integers(0, 256, 220, dtype=np.uint8).tobytes())
            data[max(0, offset - 1):offset + length] = bytes([7]) * (offset + length - max(0, offset - 1))
            coded = kernels.planes.huffman_deflate(bytes(data), 1024, True)
            assert zlib.decompress(coded, -15) == data, (offset, length)
    literals = rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    stretched = literals[:500] + bytes([literals[499]]) * 5000 + literals[500:]
    assert len(kernels.planes.huffman_deflate(stretched, 1 << 14, True)) < \
        len(kernels.planes.huffman_deflate(literals, 1 << 14, True)) + 40


def test_version_1_float_payloads_still_decode():
    """Objects written before per-segment layouts (one layout for every segment) read back."""
    import struct

    from forkpoint.codecs import floatcodec
    weights, _ = _weights_and_moments()
    raw = weights.view(np.uint8)
    rotated, coders = True, [floatcodec.RAW, floatcodec.RAW, floatcodec.ZSTD, floatcodec.HUFFMAN]
    per = 20_000
    parts = []
    for lo in range(0, weights.size, per):
        piece = raw[lo * 4:(lo + per) * 4]
        planes = np.empty((4, piece.nbytes // 4), np.uint8)
        planeforms.to_planes(piece, 4, rotated, planes)
        parts += [bytes(planecoders.encode_plane(p, c)) for p, c in zip(planes, coders)]
    payload = (struct.pack("<BBBxQI", 1, 4, 1, weights.size, per) + bytes(coders)
               + struct.pack(f"<{len(parts)}I", *map(len, parts)) + b"".join(parts))
    assert bytes(floatcodec.decode(payload, raw.nbytes)) == raw.tobytes()


def test_float_codec_reuses_layouts_and_chooses_again_when_stale(monkeypatch):
    """An encode given the Layouts of an earlier one skips the sampling, stays bit-exact, leaves
    a plane raw where the reused coder no longer gains, and chooses afresh after REUSE_LIMIT
    reuses or once the payload grows."""
    from forkpoint.codecs import floatcodec

    weights, moments = _weights_and_moments()
    nudged = np.nextafter(weights, np.float32(1))
    fresh = floatcodec.encode(nudged.view(np.uint8), 4)
    chosen = []
    real_choose = floatcodec.choose
    monkeypatch.setattr(floatcodec, "choose", lambda *a: chosen.append(1) or real_choose(*a))
    layouts = floatcodec.Layouts()
    first = b"".join(floatcodec.encode_pieces(weights.view(np.uint8), 4, layouts=layouts))
    assert len(chosen) == 1 and layouts.uses == 0 and layouts.coded < len(first) < layouts.coded + 64
    assert layouts.segments == [(True, [floatcodec.RAW] * 3 + [floatcodec.HUFFMAN])]
    again = b"".join(floatcodec.encode_pieces(nudged.view(np.uint8), 4, layouts=layouts))
    assert len(chosen) == 1 and layouts.uses == 1, "the second encode reuses the layout"
    assert again == fresh, "same payload as a fresh choice here"
    for _ in range(floatcodec.REUSE_LIMIT - 1):
        floatcodec.encode_pieces(nudged.view(np.uint8), 4, layouts=layouts)
    assert len(chosen) == 1 and layouts.uses == floatcodec.REUSE_LIMIT
    floatcodec.encode_pieces(nudged.view(np.uint8), 4, layouts=layouts)
    assert len(chosen) == 2 and layouts.uses == 0, "chosen afresh after REUSE_LIMIT reuses"

    random_bytes = np.random.default_rng(1).integers(0, 256, weights.nbytes, dtype=np.uint8)
    coded = b"".join(floatcodec.encode_pieces(random_bytes, 4, layouts=layouts))
    assert len(chosen) == 2, "reused although the data changed"
    assert bytes(floatcodec.decode(coded, random_bytes.nbytes)) == random_bytes.tobytes()
    assert layouts.segments == [(True, [floatcodec.RAW] * 4)], "the stale Huffman plane was left raw"
    assert len(coded) < random_bytes.nbytes + 64
    assert layouts.uses == floatcodec.REUSE_LIMIT, "a payload that grew has its layout chosen afresh"
    floatcodec.encode_pieces(moments.view(np.uint8), 4, layouts=layouts)
    assert len(chosen) == 3

    floatcodec.encode_pieces(np.tile(moments, 3).view(np.uint8), 4, layouts=layouts)
    assert len(chosen) == 5, "layouts for another number of segments are not reused: each of 2 is chosen"


def test_saves_reuse_each_chunks_layouts(tmp_path):
    """A repository keeps the codec's layouts per chunk (values and deltas apart), so a later
    save of the same chunks samples nothing, and every version loads bit-exactly."""
    weights, moments = _weights_and_moments(n=600_000)
    for delta in (None, fp.Delta()):
        repo = fp.Repo(str(tmp_path / f"r{delta is None}"), create=True, codec="lossless", delta=delta)
        state = {"w": torch.from_numpy(weights.copy()), "m": torch.from_numpy(moments.copy())}
        saved = []
        for step in range(3):
            state["w"].add_(1e-3 * torch.randn(state["w"].shape))
            state["m"].mul_(0.9)
            repo.save(state, step=step)
            saved.append({k: v.clone() for k, v in state.items()})
        slots = repo._layouts.slots
        if delta is None:
            assert set(slots) == {("w", (0,)), ("m", (0,))}
            assert all(layouts.uses == 2 for layouts in slots.values()), \
                "the second and third saves reused what the first chose"
        else:
            assert ("delta", "w", (0,)) in slots, "delta chunks keep layouts of their own"
        for step, expect in enumerate(saved):
            out = repo.load(f"main~{2 - step}")
            assert all(torch.equal(out[k], expect[k]) for k in expect)
        assert repo.verify().ok
        repo.close()


def test_a_deflate_plane_that_inflates_past_its_size_is_refused_without_inflating_it_all():
    """A damaged or hostile payload whose deflate plane expands beyond the plane (runs make
    1000:1 easy) is refused after at most the plane's bytes, and a short one too."""
    import struct
    import zlib

    from forkpoint.codecs import floatcodec
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = packer.compress(bytes(50 << 20)) + packer.flush()
    head = struct.pack("<BBBxQI", 2, 1, 0, 1000, 1000) + bytes([0, floatcodec.HUFFMAN])
    payload = head + struct.pack("<I", len(bomb)) + bomb
    with pytest.raises(ValueError, match="inflates to more"):
        floatcodec.decode(payload, 1000)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    short = packer.compress(bytes(10)) + packer.flush()
    with pytest.raises(ValueError, match="inflates to 10"):
        floatcodec.decode(head + struct.pack("<I", len(short)) + short, 1000)


def test_runs_without_the_native_coder_use_zlib_rle_and_read_back(monkeypatch):
    """Without the extension, runs are coded by zlib-ng's Z_RLE: the same kind of stream, chosen
    the same way, read by either build."""
    from forkpoint.codecs import floatcodec
    data = _moments_with_runs().view(np.uint8)
    native = kernels.planes
    monkeypatch.setattr(kernels, "planes", None)
    layouts = floatcodec.Layouts()
    without = b"".join(floatcodec.encode_pieces(data, 4, layouts=layouts))
    assert layouts.segments[0][1][3] == floatcodec.RUNS
    assert bytes(floatcodec.decode(without, data.nbytes)) == data.tobytes()
    monkeypatch.setattr(kernels, "planes", native)
    assert bytes(floatcodec.decode(without, data.nbytes)) == data.tobytes()
    if native is not None:
        assert len(floatcodec.encode(data, 4)) < 1.05 * len(without), "the native runs coder codes about as small"


@pytest.mark.parametrize("itemsize", [2, 4])
def test_a_layout_that_codes_one_more_plane_must_save_what_coding_a_plane_costs(itemsize):
    """Second moments (positive, random mantissas): rotating puts 7 random bits over the
    constant sign in the low plane, which Huffman codes to 7 bits, only 0.2-0.3% smaller in all
    than leaving that plane raw unrotated; the chooser never pays a Huffman pass for it: it
    packs that plane seven bits a byte (several times faster than Huffman, as small), or leaves
    the layout unrotated. A weight's layout, where rotation isolates the exponent at no extra
    plane, stays rotated."""
    from forkpoint.codecs import floatcodec
    rng = np.random.default_rng(0)
    squares = (rng.standard_normal(400_000) ** 2 * 1e-6).astype(np.float32)
    weights = (rng.standard_normal(400_000) * 0.02).astype(np.float32)
    if itemsize == 2:
        squares, weights = ((x.view(np.uint32) >> 16).astype(np.uint16) for x in (squares, weights))
    rotated, coders, _ = floatcodec.choose(squares.view(np.uint8), itemsize)
    assert coders[-2] == (floatcodec.SEVEN if rotated else floatcodec.RAW) and coders[-1] != floatcodec.RAW
    assert floatcodec.choose(weights.view(np.uint8), itemsize)[0]
    coded = floatcodec.encode(squares.view(np.uint8), itemsize)
    assert bytes(floatcodec.decode(coded, squares.nbytes)) == squares.tobytes()


def test_small_float_leaves_pack_by_element_size_and_code_as_floats(tmp_path):
    """Leaves below small_leaf_bytes share packs by element size when they are floating point,
    so a pack of biases and small matrices is coded by the float codec (not as bytes); other
    leaves pack together as before. Before, a bf16 GPT-2 of 6.9M parameters stored its state
    1.36x smaller under "lossless" (most of it in zstd-coded mixed packs), now 1.53x."""
    torch.manual_seed(0)
    state = {f"b{i}": (torch.randn(3000) * 0.02).to(torch.bfloat16) for i in range(6)}
    state.update({f"f{i}": torch.randn(2000) * 0.02 for i in range(6)})
    state.update({"ints": torch.arange(5000) % 3, "mask": torch.rand(999) > 0.5, "h": torch.randn(10).half()})
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    repo.save(state)
    leaves = {leaf.path: leaf.chunks[0].object for leaf in repo.manifest().leaves}
    codecs = stored_codecs(repo)
    assert len({leaves[f"b{i}"] for i in range(6)}) == 1 and len({leaves[f"f{i}"] for i in range(6)}) == 1
    assert len({leaves["b0"], leaves["f0"], leaves["ints"]}) == 3 and leaves["h"] == leaves["b0"]
    assert leaves["mask"] == leaves["ints"], "leaves that are not floats still share a pack"
    slot = ("pack", "b0", 7)
    assert repo._layouts.slots[slot].uses == 0, "the bf16 pack (with the fp16 leaf) keeps its layouts"
    assert codecs["b0"] == codecs["f0"] == {"float-planes"} and codecs["ints"] == {"zstd"}
    bytes_only = fp.Repo(str(tmp_path / "z"), create=True, codec="zstd")
    bytes_only.save(state)
    assert repo.versions()[0].stored_bytes < 0.95 * bytes_only.versions()[0].stored_bytes
    out = repo.load()
    assert all(torch.equal(out[k], v) for k, v in state.items())
    for k in state:
        if state[k].is_floating_point():
            state[k] = state[k] * 1.01
    repo.save(state, step=2)
    assert repo._layouts.slots[slot].uses == 1, "the next save reused them"
    assert all(torch.equal(repo.load()[k], v) for k, v in state.items())
    assert repo.verify().ok
    repo.close()
    bytes_only.close()


def test_native_inflater_reads_every_kind_of_deflate_stream_as_zlib_does():
    """The native inflater (which decodes the codec's Huffman planes) gives zlib's bytes for
    streams of every block type and strategy zlib writes and for the codec's own coders, and
    refuses a truncated or damaged stream with ValueError (never reads past either buffer)."""
    import zlib

    native = kernels.planes
    if native is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(5)
    weights, moments = _weights_and_moments()
    planes = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 999, 70_000)]
    planes += [(rng.geometric(0.3, 200_000) % 256).astype(np.uint8), np.zeros(100_000, np.uint8),
               weights.view(np.uint8)[3::4].copy(), moments.view(np.uint8)[2::4].copy()]
    for plane in planes:
        streams = [native.huffman_deflate(plane, block, runs) for block in (16384, 65536) for runs in (False, True)]
        for level, strategy in ((0, zlib.Z_DEFAULT_STRATEGY), (1, zlib.Z_DEFAULT_STRATEGY), (6, zlib.Z_FILTERED),
                                (9, zlib.Z_DEFAULT_STRATEGY), (6, zlib.Z_FIXED), (6, zlib.Z_RLE), (6, zlib.Z_HUFFMAN_ONLY)):
            packer = zlib.compressobj(level, zlib.DEFLATED, -15, 9, strategy)
            streams.append(packer.compress(plane.tobytes()) + packer.flush())
        for stream in streams:
            out = np.full(plane.size, 7, np.uint8)
            native.inflate_into(stream, out)
            assert out.tobytes() == zlib.decompress(stream, -15) == plane.tobytes()
    stream = native.huffman_deflate(planes[-1], 16384, False)
    with pytest.raises(ValueError, match="damaged"):
        native.inflate_into(stream[:len(stream) // 2], np.empty(planes[-1].size, np.uint8))
    refused = 0
    for _ in range(300):
        damaged = bytearray(stream)
        damaged[rng.integers(0, len(damaged))] ^= 1 << int(rng.integers(0, 8))
        try:
            native.inflate_into(bytes(damaged), np.empty(planes[-1].size, np.uint8))
        except ValueError:
            refused += 1
    assert refused > 50, "a flipped bit in a header or code lengths is caught (the chunk hash catches the rest)"
