"""The float codec's grid model of a matrix's exponents (row shift + column shift + residual)."""

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.engine.parallel import parallel_map
from forkpoint.codecs import floatcodec, kernels, planecoders, planeforms


def _outer(rows, cols, positive, dtype=torch.bfloat16, seed=0, scale=1e-6):
    """Adam-moment-like values: |x[r, c]| ~ u[r] * v[c] * noise (a sum of outer products), signed
    like a first moment or positive like a second."""
    rng = np.random.default_rng(seed)
    m = np.outer(np.exp(rng.normal(0, 2, rows)), np.exp(rng.normal(0, 2, cols)))
    m *= np.exp(rng.normal(0, 0.5, (rows, cols))) * scale
    if not positive:
        m *= rng.choice([-1, 1], size=m.shape)
    return torch.from_numpy(m).to(dtype)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


@pytest.fixture
def native():
    """The native kernels (the test is skipped where the extension was not built)."""
    if kernels.planes is None:
        pytest.skip("native kernels not built")
    return kernels.planes


def _payload(data, itemsize, row, **kw) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in floatcodec.encode_pieces(data, itemsize, row=row, **kw))


@pytest.mark.parametrize("dtype, scale, gain", [(torch.bfloat16, 1e-6, 0.9), (torch.float32, 1e-6, 0.96),
                                                (torch.float16, 1e-2, 0.97), (torch.float64, 1e-6, 1.0)], ids=str)
@pytest.mark.parametrize("positive", [True, False], ids=["second-moment", "first-moment"])
def test_rows_let_moments_code_smaller_and_round_trip_bit_exactly(dtype, scale, gain, positive, monkeypatch):
    t = _outer(512, 384, positive, dtype, scale=scale)
    data = _bytes(t)
    itemsize = t.element_size()
    with monkeypatch.context() as unmatched:  # against the layouts that know nothing of rows
        unmatched.setattr(floatcodec, "_matched_option", lambda *args: [])
        plain = floatcodec.encode(data, itemsize)
    grid = _payload(data, itemsize, 384)
    assert grid[0] >= floatcodec.GRID_VERSION and grid[floatcodec._HEAD.size + floatcodec._ROW.size] & floatcodec.GRID, \
        "the grid was chosen for an outer-product matrix"
    assert len(grid) <= gain * len(plain), f"{len(grid)} bytes with rows against {len(plain)} without"
    assert bytes(floatcodec.decode(grid, data.nbytes)) == data.tobytes()
    assert bytes(floatcodec.decode(grid, data.nbytes, pmap=None)) == data.tobytes()


def test_special_values_and_every_exponent_round_trip_through_the_grid():
    t = _outer(256, 128, False, torch.float32)
    t[::7, ::5] = 0.0
    t[3, :] = float("inf")
    t[:, 9] = float("nan")
    t[5, 5] = -float("inf")
    t[17, :64] = torch.tensor(1e-40)  # subnormal
    t[40] = torch.from_numpy(np.random.default_rng(1).integers(0, 2**32, 128, dtype=np.uint64).astype(np.uint32)
                             .view(np.float32))  # any bit pattern
    data = _bytes(t)
    payload = _payload(data, 4, 128)
    assert payload[0] >= floatcodec.GRID_VERSION and payload[floatcodec._HEAD.size + floatcodec._ROW.size] & floatcodec.GRID
    assert bytes(floatcodec.decode(payload, data.nbytes)) == data.tobytes()


def test_segments_hold_whole_rows_and_pick_the_grid_each(monkeypatch):
    monkeypatch.setattr(floatcodec, "SEGMENT_BYTES", 200_000)
    t = torch.cat([_outer(300, 768, True), _outer(300, 768, False, seed=1)])
    data = _bytes(t)
    payload = _payload(data, 2, 768, pmap=parallel_map)
    version, itemsize, _, count, per = floatcodec._HEAD.unpack_from(payload)
    (row,) = floatcodec._ROW.unpack_from(payload, floatcodec._HEAD.size)
    assert (version, row, count) == (floatcodec.GRID_VERSION, 768, 600 * 768)
    assert per % 768 == 0 and per * 2 <= 200_000
    segments = -(-count // per)
    forms = payload[floatcodec._HEAD.size + 4::3][:segments]
    assert all(form == floatcodec.ROTATED | floatcodec.GRID for form in forms)
    assert bytes(floatcodec.decode(payload, data.nbytes)) == data.tobytes()


def test_data_that_rows_do_not_tile_or_that_is_too_small_is_coded_as_before():
    t = _bytes(_outer(512, 384, True))
    for data, row in ((t[:-2 * 100], 384), (t[:2 * 384 * 8], 384), (t, 4), (t, 1 << 20)):
        payload = _payload(data, 2, row)
        assert payload == floatcodec.encode(data, 2)
        assert payload[0] < floatcodec.GRID_VERSION or floatcodec._ROW.unpack_from(payload, floatcodec._HEAD.size) == (0,)
        assert bytes(floatcodec.decode(payload, data.nbytes)) == data.tobytes()


def test_native_and_numpy_fit_the_same_grid_and_read_each_other(native, monkeypatch):
    rng = np.random.default_rng(7)
    for rows, cols in ((300, 200), (17, 1000), (1000, 8), (129, 65)):
        plane = rng.integers(0, 256, rows * cols, dtype=np.uint8)
        plane[: rows * cols // 2] = rng.integers(100, 110, rows * cols // 2, dtype=np.uint8)
        mine = planeforms.fit_grid(plane, cols)
        monkeypatch.setattr(kernels, "planes", None)
        reference = planeforms.fit_grid(plane, cols)
        residual = np.empty_like(plane)
        planeforms.apply_grid(plane, residual, reference, cols, add=False)
        monkeypatch.setattr(kernels, "planes", native)
        assert np.array_equal(mine, reference), (rows, cols)
        native_residual = np.empty_like(plane)
        planeforms.apply_grid(plane, native_residual, mine, cols, add=False)
        assert np.array_equal(native_residual, residual)
        planeforms.apply_grid(residual, residual, mine, cols, add=True)
        assert np.array_equal(residual, plane)
    data = _bytes(_outer(512, 384, False))
    with_native = _payload(data, 2, 384)
    monkeypatch.setattr(kernels, "planes", None)
    without = _payload(data, 2, 384)
    assert without[0] == floatcodec.GRID_VERSION and abs(len(without) - len(with_native)) < 0.02 * len(without)
    assert bytes(floatcodec.decode(with_native, data.nbytes)) == data.tobytes()
    monkeypatch.setattr(kernels, "planes", native)
    assert bytes(floatcodec.decode(without, data.nbytes)) == data.tobytes()


def _top_plane_cut_to_100_bytes(payload: bytes, lengths_at: int) -> bytes:
    """A one-segment bf16 payload whose top plane (the second coded length at `lengths_at`)
    lost all but its first 100 bytes."""
    top = struct.unpack_from("<I", payload, lengths_at + 4)[0]
    short = bytearray(payload)
    struct.pack_into("<I", short, lengths_at + 4, 100)
    return bytes(short[:len(short) - (top - 100)])


def test_damaged_grid_payloads_are_refused():
    data = _bytes(_outer(512, 384, True))
    payload = bytearray(_payload(data, 2, 384))
    head = floatcodec._HEAD.size
    wrong_row = payload[:head] + struct.pack("<I", 500) + payload[head + 4:]
    with pytest.raises(ValueError, match="rows of 500"):
        floatcodec.decode(bytes(wrong_row), data.nbytes)
    as_v2 = bytes([floatcodec.PLAIN_VERSION]) + payload[1:head] + payload[head + 4:]
    with pytest.raises(ValueError, match="form|table says|unknown plane coder"):
        floatcodec.decode(as_v2, data.nbytes)
    with pytest.raises(ValueError, match="grid shifts need"):
        floatcodec.decode(_top_plane_cut_to_100_bytes(bytes(payload), head + 4 + 3), data.nbytes)


def test_layouts_reused_from_save_to_save_keep_the_grid():
    first, second = _bytes(_outer(512, 384, True)), _bytes(_outer(512, 384, True, seed=1))
    layouts = floatcodec.Layouts()
    _payload(first, 2, 384, layouts=layouts)
    assert layouts.row == 384 and layouts.segments[0][0] == floatcodec.ROTATED | floatcodec.GRID
    again = _payload(second, 2, 384, layouts=layouts)
    assert layouts.uses == 1 and again[0] == floatcodec.GRID_VERSION
    assert bytes(floatcodec.decode(again, second.nbytes)) == second.tobytes()
    assert not layouts.fits(2, 1, row=0), "layouts chosen with rows are not reused without"


@pytest.mark.parametrize("encode_later", [False, True], ids=["inline", "later"])
def test_a_save_codes_matrices_by_their_rows(tmp_path, encode_later):
    """A repository passes each chunk's row length to the codec: the same moments stored as a
    matrix take fewer bytes than stored flat, and both load back bit-exactly."""
    m = _outer(1024, 512, True)
    stored = {}
    for name, t in (("matrix", m), ("flat", m.reshape(-1))):
        repo = fp.Repo(str(tmp_path / name), create=True, codec="lossless", encode_later=encode_later)
        repo.save({"exp_avg_sq": t}, sync=True)
        repo.drain()
        assert torch.equal(repo.load()["exp_avg_sq"], t)
        assert repo.verify().ok
        stored[name] = sum(p.stat().st_size for p in (tmp_path / name / "objects").rglob("*") if p.is_file())
        repo.close()
    assert stored["matrix"] < 0.93 * stored["flat"], stored


def test_compaction_codes_matrices_by_their_rows(tmp_path):
    m = _outer(1024, 512, False)
    sizes = {}
    for name, t in (("matrix", m), ("flat", m.reshape(-1))):
        repo = fp.Repo(str(tmp_path / name), create=True, codec="raw")
        repo.save({"exp_avg": t})
        repo.compact(codec="lossless")
        assert torch.equal(repo.load()["exp_avg"], t)
        sizes[name] = sum(p.stat().st_size for p in (tmp_path / name / "objects").rglob("*") if p.is_file())
        repo.close()
    assert sizes["matrix"] < 0.95 * sizes["flat"], sizes


def test_a_payload_of_a_newer_version_asks_for_an_upgrade(tmp_path):
    """A float-planes payload of a version this reader does not know is refused as a format
    error naming the object, not reported as corruption."""
    from forkpoint.errors import FormatError
    from forkpoint.format.objects import OBJECT_HEADER_SIZE, object_key, unpack_header

    m = _outer(2048, 512, True)
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    repo.save({"m": m})
    chunk = repo.manifest("main").leaves[0].chunks[0]
    path = tmp_path / "r" / object_key(chunk.object)
    blob = bytearray(path.read_bytes())
    _, _, header_size = unpack_header(bytes(blob[:OBJECT_HEADER_SIZE]), str(path))
    assert blob[header_size] in (floatcodec.GRID_VERSION, floatcodec.ALIGNED_VERSION)
    blob[header_size] = 9
    path.chmod(0o644)
    path.write_bytes(bytes(blob))
    with pytest.raises(FormatError, match=r"version 9 is newer.*upgrade"):
        repo.load()
    repo.close()


def _squares(n=400_000, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) ** 2 * 1e-6).astype(np.float32)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_a_positive_tensors_low_plane_packs_seven_bits_a_byte(itemsize):
    """Rotated, a positive tensor's low plane holds 7 mantissa bits over a zero sign bit: it is
    packed 8 bytes into 7 (payload version 3), and a segment whose full data has a negative
    value the sample missed stores that plane raw instead; both round-trip."""
    squares = _squares().view(np.uint32)
    if itemsize == 2:
        squares = (squares >> 16).astype(np.uint16)
    data = squares.view(np.uint8)
    payload = floatcodec.encode(data, itemsize)
    assert payload[0] == floatcodec.GRID_VERSION and floatcodec.SEVEN in payload[floatcodec._HEAD.size + 5:][:itemsize]
    assert bytes(floatcodec.decode(payload, data.nbytes)) == data.tobytes()
    signed = squares.copy()
    signed[5000] |= signed.dtype.type(1 << (8 * itemsize - 1))  # outside every sample piece
    data = signed.view(np.uint8)
    assert floatcodec.choose(data, itemsize)[1][-2] == floatcodec.SEVEN, "the sample sees no sign"
    layouts = floatcodec.Layouts()
    payload = _payload(data, itemsize, 0, layouts=layouts)
    assert layouts.segments[0][1][-2] == floatcodec.RAW
    assert bytes(floatcodec.decode(payload, data.nbytes)) == data.tobytes()


def test_native_and_numpy_seven_bit_packing_agree(native, monkeypatch):
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 1000, 100_003):
        plane = (rng.integers(0, 128, n, dtype=np.uint8) << 1).astype(np.uint8)
        mine = planecoders._pack_seven(plane)
        monkeypatch.setattr(kernels, "planes", None)
        reference = planecoders._pack_seven(plane)
        back = np.empty_like(plane)
        planecoders._unpack_seven(mine, back)
        monkeypatch.setattr(kernels, "planes", native)
        assert mine == reference and len(mine) == (7 * n + 7) // 8
        assert np.array_equal(back, plane)
        if n:
            plane[n // 2] |= 1
            assert planecoders._pack_seven(plane) is None
    with pytest.raises(ValueError, match="seven-bit"):
        planecoders._unpack_seven(b"\0" * 6, np.empty(8, np.uint8))


def test_zstds_repeats_at_long_distances_are_judged_on_a_stretch_of_rows(monkeypatch):
    """Rows that repeat hundreds of rows apart (an embedding's rarely seen tokens) code smaller
    with zstd on the whole plane, though the sample's short pieces show the grid ahead: a
    contiguous stretch of rows decides, and the payload is smaller than the grid's."""
    rng = np.random.default_rng(1)
    patterns = _outer(256, 256, False, torch.float64, seed=1).numpy()
    data = _bytes(torch.from_numpy(patterns[rng.integers(0, 256, 8192)]).to(torch.bfloat16))
    form, coders, _ = floatcodec.choose(data, 2, 256)
    assert not form & floatcodec.GRID and coders[-1] == floatcodec.ZSTD
    chosen = _payload(data, 2, 256)
    monkeypatch.setattr(floatcodec, "STRETCH_ELEMENTS", 1 << 40)
    assert floatcodec.choose(data, 2, 256)[0] & floatcodec.GRID, "the sample alone picks the grid"
    assert len(chosen) < 0.9 * len(_payload(data, 2, 256))
    assert bytes(floatcodec.decode(chosen, data.nbytes)) == data.tobytes()


def _near_multiples(rows=4096, width=256, patterns=4, seed=3) -> np.ndarray:
    """bf16 first-moment-like rows, no row length given: each one of `patterns` signed rows
    times 4**k, a fifth of its elements times 4 more (exponents that differ here and there,
    which break zstd's matches of 7 bytes), its mantissas nearly alike (rarely seen tokens of
    an embedding, whose gradients share a direction)."""
    rng = np.random.default_rng(seed)
    base = np.exp(rng.normal(0, 2, (patterns, width))) * rng.choice([-1, 1], (patterns, width))
    m = base[rng.integers(0, patterns, rows)] * np.exp2(2 * rng.integers(-10, -5, rows))[:, None]
    m *= np.exp2(2 * (rng.random(m.shape) < 0.2)) * (1 + rng.uniform(0, 0.01, m.shape))
    return _bytes(torch.from_numpy(m).to(torch.bfloat16))


def _segment_forms(data, itemsize, row=0) -> list[int]:
    layouts = floatcodec.Layouts()
    floatcodec.encode_pieces(data, itemsize, layouts=layouts, row=row)
    return [form for form, _ in layouts.segments]


def test_rows_near_multiples_of_rows_shortly_before_are_matched(monkeypatch):
    """Rows that repeat an earlier row's signs and exponents up to a shift (found by zstd at
    several times Huffman's cost) are coded as that row plus a constant plus a residual:
    payload version 4, smaller than the best layout without matching, bit-exact."""
    data = _near_multiples()
    assert all(form & floatcodec.MATCH for form in _segment_forms(data, 2))
    payload = floatcodec.encode(data, 2)
    assert payload[0] >= floatcodec.MATCH_VERSION
    with monkeypatch.context() as unmatched:
        unmatched.setattr(floatcodec, "_matched_option", lambda *args: [])
        without = floatcodec.encode(data, 2)
        assert without[0] < floatcodec.MATCH_VERSION and floatcodec.ZSTD in without[16:19]
    assert len(payload) < 0.9 * len(without), f"{len(payload)} bytes matched against {len(without)}"
    for pmap in (None, parallel_map):
        assert bytes(floatcodec.decode(payload, data.nbytes, pmap=pmap)) == data.tobytes()
    weights = _bytes(_outer(512, 384, False, scale=1e-2) * 0 + torch.randn(512, 384, dtype=torch.bfloat16))
    assert not any(form & floatcodec.MATCH for form in _segment_forms(weights, 2)), "weights: nothing to match"


def test_native_and_numpy_agree_at_the_farthest_reach(native, monkeypatch):
    """The native scorer ranks candidates by keys of their score and place in the search; at
    the farthest reach the API takes (255 rows back, 1020 candidates) it still picks the rows
    numpy picks."""
    monkeypatch.setattr(planeforms, "MATCH_REACH", 255)
    rows = np.random.default_rng(7).integers(0, 256, (600, floatcodec.MATCH_ROW), dtype=np.uint8)
    rows[250:500] = rows[:250] + np.uint8(3)
    plane = rows.reshape(-1)
    by_native = plane.copy()
    side = planeforms.match_rows(by_native)
    assert (side[250:500] == 250).all() and (side[600 + 250:600 + 500] == 3).all()
    monkeypatch.setattr(kernels, "planes", None)
    by_numpy = plane.copy()
    assert np.array_equal(planeforms.match_rows(by_numpy), side) and np.array_equal(by_numpy, by_native)


@pytest.mark.parametrize("size", [0, 1, 255, 256, 257, 511, 4096 * 256 + 77])
def test_native_and_numpy_match_the_same_rows_and_read_each_other(native, monkeypatch, size):
    rng = np.random.default_rng(size)
    structured = np.frombuffer(_near_multiples(rows=size // 256 + 1)[1::2][:size].tobytes(), np.uint8)
    for kind, plane in (("rows", structured), ("random", rng.integers(0, 256, size, dtype=np.uint8))):
        by_native = plane.copy()
        side = planeforms.match_rows(by_native)
        assert side[:side.size // 2].any() == (kind == "rows" and size >= 2 * floatcodec.MATCH_ROW)
        monkeypatch.setattr(kernels, "planes", None)
        by_numpy = plane.copy()
        assert np.array_equal(planeforms.match_rows(by_numpy), side) and np.array_equal(by_numpy, by_native)
        planeforms.unmatch_rows(by_numpy, side)
        monkeypatch.setattr(kernels, "planes", native)
        planeforms.unmatch_rows(by_native, side)
        assert np.array_equal(by_numpy, plane) and np.array_equal(by_native, plane)
    data = _near_multiples(rows=2048)
    with_native = floatcodec.encode(data, 2)
    monkeypatch.setattr(kernels, "planes", None)
    with_numpy = floatcodec.encode(data, 2)
    assert with_numpy[0] >= floatcodec.MATCH_VERSION
    assert bytes(floatcodec.decode(with_native, data.nbytes)) == data.tobytes()
    monkeypatch.setattr(kernels, "planes", native)
    assert bytes(floatcodec.decode(with_numpy, data.nbytes)) == data.tobytes()


@pytest.mark.parametrize("portable", ["avx512", "1"])
def test_portable_and_vector_match_scoring_pick_the_same_rows(native, tmp_path, portable):
    """FORKPOINT_PORTABLE_KERNELS keeps the native kernels off their run-time-chosen vector
    paths ("avx512": off AVX-512 scoring of row matches, onto AVX2; "1": off all): a process so
    started picks the same rows, at the longest reach too."""
    rng = np.random.default_rng(5)
    structured = np.frombuffer(_near_multiples(rows=600)[1::2].tobytes(), np.uint8)
    plane = np.concatenate([structured, rng.integers(0, 256, 3 * 256 + 17, dtype=np.uint8)])
    np.save(tmp_path / "plane.npy", plane)
    script = ("import sys, numpy as np; from forkpoint.codecs import kernels, planeforms as pf; "
              "p = np.load(sys.argv[1]); far = p.copy(); s = pf.match_rows(p); t = np.zeros_like(s)\n"
              "kernels.planes.match_rows(far, far, t, pf.MATCH_ROW, 255, pf.MATCH_LEAST)\n"
              "np.save(sys.argv[2], np.concatenate([s, p, t, far]))")
    env = {**os.environ, "FORKPOINT_PORTABLE_KERNELS": portable}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "plane.npy"), str(tmp_path / "portable.npy")],
                   env=env, check=True)
    here, far = plane.copy(), plane.copy()
    side, far_side = planeforms.match_rows(here), np.zeros(planeforms.match_side_bytes(plane.size), np.uint8)
    native.match_rows(far, far, far_side, floatcodec.MATCH_ROW, 255, planeforms.MATCH_LEAST)
    assert side[:side.size // 2].any() and (far_side[:far_side.size // 2] > planeforms.MATCH_REACH).any()
    assert np.array_equal(np.load(tmp_path / "portable.npy"), np.concatenate([side, here, far_side, far]))


@pytest.mark.parametrize("kind", ["native", "numpy"])
def test_damaged_row_matches_are_refused(monkeypatch, kind):
    data = _near_multiples(rows=1024)
    payload = floatcodec.encode(data, 2)
    head = floatcodec._HEAD.size + floatcodec._ROW.size
    assert payload[0] >= floatcodec.MATCH_VERSION and payload[head] & floatcodec.MATCH
    if kind == "numpy":
        monkeypatch.setattr(kernels, "planes", None)
    lengths_at = head + 3
    top_at = lengths_at + 8 + struct.unpack_from("<I", payload, lengths_at)[0]
    backwards = bytearray(payload)
    backwards[top_at] = 1  # row 0 refers to the row before it
    with pytest.raises(ValueError, match="row 0 refers to a row before the first"):
        floatcodec.decode(bytes(backwards), data.nbytes)
    with pytest.raises(ValueError, match="row matches need 2048 bytes"):
        floatcodec.decode(_top_plane_cut_to_100_bytes(payload, lengths_at), data.nbytes)
    as_v3 = bytes([floatcodec.GRID_VERSION]) + payload[1:]
    with pytest.raises(ValueError, match="unknown segment form"):
        floatcodec.decode(as_v3, data.nbytes)


def test_a_repository_stores_matched_rows(tmp_path):
    """Saves of a first moment whose rows repeat earlier ones (one flat leaf, so no rows are
    given) store version 4 payloads, the second one (which reuses the first's layouts) too;
    every version loads back bit-exactly and verifies."""
    from forkpoint.format.objects import OBJECT_HEADER_SIZE, object_key, unpack_header

    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    tensors = [torch.from_numpy(_near_multiples(seed=seed)).view(torch.bfloat16) for seed in (3, 4)]
    versions = [repo.save({"exp_avg": t}) for t in tensors]
    for version, t in zip(versions, tensors):
        assert torch.equal(repo.load(version.id)["exp_avg"], t)
        chunk = repo.manifest(version.id).leaves[0].chunks[0]
        path = tmp_path / "r" / object_key(chunk.object)
        blob = path.read_bytes()
        _, _, header_size = unpack_header(blob[:OBJECT_HEADER_SIZE], str(path))
        assert blob[header_size] >= floatcodec.MATCH_VERSION
    assert repo.verify().ok
    repo.close()


def test_native_row_matching_refuses_arguments_that_do_not_fit(native):
    plane = np.zeros(1000, np.uint8)
    with pytest.raises(ValueError, match="rows of 100"):
        native.match_rows(plane, plane, np.zeros(20, np.uint8), 100, 16, 8)
    with pytest.raises(ValueError, match="side bytes do not fit"):
        native.match_rows(plane, plane, np.zeros(6, np.uint8), 256, 16, 8)
    with pytest.raises(ValueError, match="side bytes do not fit"):
        native.match_rows(plane, plane[:500].copy(), np.zeros(8, np.uint8), 256, 16, 8)
    with pytest.raises(ValueError, match="side bytes do not fit"):
        native.unmatch_rows(plane, np.zeros(7, np.uint8), 256)
    with pytest.raises(TypeError):
        native.inflate_into(b"\x03\x00", b"read-only")
