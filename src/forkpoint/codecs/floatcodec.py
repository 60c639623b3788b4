"""The float-aware lossless codec: byte planes, each entropy-coded by the coder that suits it.

Elements are split into byte planes (planeforms), and each plane is coded by the coder that
suits it (planecoders); the layout and each plane's coder are chosen on a sample. The plane
split, the deflate coders and the inflater run in native code (codecs/_planes.c) where the
extension was built, else in numpy and zlib-ng; both write payloads that either reads.
Segments of elements are coded independently (the caller may run them in parallel), each segment
with the layout and coders its own sample picks (a chunk that holds weights and then moments
codes each part as suits it). Payload (little-endian):

    u8 version (2; 3 where a segment uses the grid or a plane seven bits; 4 where one matches
    rows; 5 where a plane is sparse; 6 where raw planes are aligned) | u8 itemsize | u16 skew
    (version 6; else 0) | u64 elements | u32 segment elements
    | (versions 3 to 6: u32 row elements, 0 for none)
    | segments x (u8 form: bit 0 rotated, bit 1 grid, bit 2 matched; itemsize x u8 plane coder)
    | (segments x itemsize) x u32 coded length | coded bytes (version 6: zero bytes before each
    raw plane of a segment whose element count is a multiple of ALIGN, up to the next payload
    offset p where p + skew is a multiple of ALIGN)

A grid segment's top plane is its row shifts (one byte per row), its column shifts (one byte
per column of a row) and then the coded residual; its segment elements are whole rows. A
matched segment's top plane is each MATCH_ROW row's distance back (0: none), then each row's
constant, then the coded residual. Version 1 payloads (one layout and coder list for all
segments, right after the counts) still decode.
"""

import math
import struct
import threading
from dataclasses import dataclass, field

import numpy as np

from ..errors import FormatError
from .planecoders import (HUFFMAN, PLANE_MIN_GAIN, RAW, RUNS, SEVEN, SPARSE, ZSTD, decode_plane, encode_plane,
                          pass_price, plane_coder, plane_stats)
from .planeforms import (MATCH_ROW, WORDS, apply_grid, fit_grid, from_planes, match_rows, match_side_bytes,
                         to_planes, unmatch_rows)

_PAYLOAD_CODER = {RAW: RAW, ZSTD: ZSTD, HUFFMAN: HUFFMAN, RUNS: HUFFMAN, SEVEN: SEVEN, SPARSE: SPARSE}
_HEAD = struct.Struct("<BBHQI")
_ROW = struct.Struct("<I")
PLAIN_VERSION, GRID_VERSION, MATCH_VERSION, SPARSE_VERSION, ALIGNED_VERSION = 2, 3, 4, 5, 6
VERSION = ALIGNED_VERSION  # the newest this reader knows
ALIGN = 4096
_ZEROS = memoryview(bytes(ALIGN))
ROTATED, GRID, MATCH = 1, 2, 4
SEGMENT_BYTES = 4 << 20
SAMPLE_PIECES, SAMPLE_ELEMENTS = 8, 4 << 10
SAMPLE_SHARE, SAMPLE_MIN_ELEMENTS = 16, 1 << 10  # an encode samples at most 1/16 of a small chunk
GRID_MIN_GAIN = 0.97
STRETCH_ELEMENTS = 1 << 18
GRID_MIN_ROWS, GRID_MIN_COLS, GRID_MAX_COLS = 16, 8, 16384
_scratch = threading.local()


def _planes_buffer(itemsize: int, count: int) -> np.ndarray:
    """An (itemsize x count) uint8 work array, reused by the calling thread (no page faults
    on every segment)."""
    need = itemsize * count
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < need:
        buffer = _scratch.buffer = np.empty(max(need, SEGMENT_BYTES), np.uint8)
    return buffer[:need].reshape(itemsize, count)


def _sample(data: np.ndarray, itemsize: int, row: int = 1, share: int = 1) -> np.ndarray:
    """SAMPLE_PIECES evenly spaced runs of SAMPLE_ELEMENTS' worth of whole rows of `row`
    elements (one row at least) from `data`, or all of it where that is no more; with `share`
    above 1, runs of at most 1/share of the data (SAMPLE_MIN_ELEMENTS at least). Data without
    rows is sampled in MATCH_ROW's (row matching then sees rows where a segment's would be)."""
    width = row * itemsize
    rows = data.nbytes // width
    piece = SAMPLE_ELEMENTS if share == 1 else \
        max(SAMPLE_MIN_ELEMENTS, min(SAMPLE_ELEMENTS, data.nbytes // itemsize // (share * SAMPLE_PIECES)))
    run = max(1, piece // row)
    if rows <= SAMPLE_PIECES * run:
        return data
    step = (rows - run) // (SAMPLE_PIECES - 1)
    return np.concatenate([data[i * step * width:(i * step + run) * width] for i in range(SAMPLE_PIECES)])


def _layout_coders(planes: np.ndarray) -> list[tuple[int, int]]:
    """plane_coder of each of a sample's planes, the top one first: a plane below it tries zstd
    only where the top plane took zstd. zstd wins on repeats far apart, which rows that repeat
    put in every plane but which a plane below the top never showed alone: across the sample
    planes of benchmarks/compression.py's and codecs.py's states as saves split them, zstd won
    0 of 707 trials below the top (and 240 of 1324 on it)."""
    top = plane_coder(planes[-1])
    return [plane_coder(plane, zstd=top[0] == ZSTD) for plane in planes[:-1]] + [top]


def choose(data: np.ndarray, itemsize: int, row: int = 0, share: int = 1) -> tuple[int, list[int], int]:
    """(form, coder per plane, coded bytes of the sample) for `data`: the layout whose coded
    bytes plus the price of each pass it makes over a plane (pass_price) are fewer (so that a
    plane that codes only slightly smaller, such as a bf16 weight's low byte, stays raw and
    costs no encode time). Form: 0, ROTATED, or ROTATED | GRID where
    `row` (elements per row, 0 for none) allows the grid model; the sample is then made of whole
    rows, and the grid is tried only where its residual's order-0 entropy is below GRID_MIN_GAIN of the
    rotated top plane's coded size (weights' exponents have no such structure: their residuals
    code no smaller). A layout whose top plane zstd codes is also tried with that plane's rows
    matched (| MATCH, see _matched_option). `share` bounds the sample to that fraction of the
    data (see _sample): an encode passes SAMPLE_SHARE, so that a 1 MiB float32 chunk's choice
    costs half as much; `estimate` keeps the full sample, whose delta decisions it steadies."""
    grid = itemsize in WORDS and grid_fits(data.nbytes // itemsize, row)
    sample = _sample(data, itemsize, row if grid else MATCH_ROW, share)
    planes = np.empty((itemsize, sample.nbytes // itemsize), np.uint8)
    to_planes(sample, itemsize, False, planes)
    plain = _layout_coders(planes)
    if itemsize not in WORDS:
        return 0, [c for c, _ in plain], sum(n for _, n in plain)
    matched = _matched_option(0, plain, planes[-1])
    to_planes(sample, itemsize, True, planes)
    turned = plain[:-2] + _layout_coders(planes[-2:])
    options = [(0, plain), (ROTATED, turned)] + matched + _matched_option(ROTATED, turned, planes[-1])
    if grid:
        segment = min(data.nbytes // itemsize, _segment_elements(itemsize, row))
        shift_bytes = round(planes.shape[1] * (1 / row + row / segment))
        apply_grid(planes[-1], planes[-1], fit_grid(planes[-1], row), row, add=False)
        if plane_stats(planes[-1])[0] + shift_bytes < GRID_MIN_GAIN * turned[-1][1]:
            coder, coded = plane_coder(planes[-1])
            options.append((ROTATED | GRID, turned[:-1] + [(coder, coded + shift_bytes)]))
    def price(option):
        return sum(n + pass_price(c, planes.shape[1]) for c, n in option[1])
    best = min(options, key=price)
    if best[0] & GRID and data.nbytes >= 2 * STRETCH_ELEMENTS * itemsize:
        zstd_top = [o for o in options if not o[0] & (GRID | MATCH) and o[1][-1][0] == ZSTD]
        matched = [o for o in options if o[0] & MATCH]
        rivals = [min(group, key=price) for group in (zstd_top, matched) if group]
        if rivals:
            candidates = [best, *rivals]
            costs = _stretch_costs(data, itemsize, row, candidates)
            best = candidates[costs.index(min(costs))]
    return best[0], [c for c, _ in best[1]], sum(n for _, n in best[1])


def _matched_option(form: int, option: list, top: np.ndarray) -> list:
    """[(form | MATCH, coders)] where row matching (see match_rows) suits the sample's `top`
    plane, which `option` codes with zstd (repeats far apart: rows that are near multiples of
    earlier rows, which matching codes smaller, and Huffman then several times faster than zstd
    codes `top`); else []. Not tried where zstd codes the plane to under a bit a byte (zero
    runs: a residual cannot code smaller than that). Neither zstd nor runs are tried on the
    residual: on the residuals of the benchmark states (benchmarks/compression.py) neither
    beat Huffman-only or the sparse coder."""
    if option[-1][0] != ZSTD or top.size < 2 * MATCH_ROW or option[-1][1] * 8 < top.size:
        return []
    residual = top.copy()
    side = match_rows(residual)
    coder, coded = plane_coder(residual, zstd=False, runs=False)
    return [(form | MATCH, option[:-1] + [(coder, coded + side.size)])]


def _stretch_costs(data: np.ndarray, itemsize: int, row: int, options: list) -> list[float]:
    """For each of `options` ((form, [(coder, sample bytes)])): coded bytes, plus the price of
    each entropy-coded plane, of the top two planes (those rotation and the grid change) of one
    contiguous stretch of whole rows from the middle of `data` (STRETCH_ELEMENTS' worth).

    Where the sample prefers the grid to a layout whose top plane zstd codes or rows match, the
    sample's short pieces hide the repeats zstd finds at long distances (an embedding's first
    moment codes much smaller as a whole plane than as the sample), which the stretch shows; the
    grid is weighed against the best of each. `choose` looks so only at data of two stretches
    or more: smaller data's planes are mostly in the sample, and more encodes of each would
    multiply the cost of choosing. Options of one rotation share the stretch's planes, and the
    plane below the top is coded once per rotation and coder."""
    rows = data.nbytes // itemsize // row
    take = min(rows, max(1, STRETCH_ELEMENTS // row))
    first = (rows - take) // 2 * row * itemsize
    stretch = data[first:first + take * row * itemsize]
    planes_of: dict = {}
    below_cost: dict = {}

    def plane_cost(plane: np.ndarray, coder: int) -> float:
        coded = encode_plane(plane, coder)
        return plane.nbytes if coded is None else len(coded) + pass_price(coder, plane.nbytes)

    costs = []
    for form, chosen in options:
        rotated, coders = bool(form & ROTATED), [c for c, _ in chosen]
        if rotated not in planes_of:
            planes_of[rotated] = np.empty((itemsize, take * row), np.uint8)
            to_planes(stretch, itemsize, rotated, planes_of[rotated])
        planes = planes_of[rotated]
        if (rotated, coders[-2]) not in below_cost:
            below_cost[rotated, coders[-2]] = plane_cost(planes[-2], coders[-2])
        cost = below_cost[rotated, coders[-2]]
        top = planes[-1]
        if form & GRID:
            top = top.copy()
            apply_grid(top, top, fit_grid(top, row), row, add=False)
            cost += take + row * take * row / min(rows * row, _segment_elements(itemsize, row))
        elif form & MATCH:
            top = top.copy()
            cost += match_rows(top).size
        costs.append(cost + plane_cost(top, coders[-1]))
    return costs


def grid_fits(count: int, row: int) -> bool:
    """True when `count` elements in rows of `row` can be coded with the grid model: whole
    rows, at least GRID_MIN_COLS wide and at most GRID_MAX_COLS, GRID_MIN_ROWS of them."""
    return GRID_MIN_COLS <= row <= GRID_MAX_COLS and count % row == 0 and count // row >= GRID_MIN_ROWS


def _segment_elements(itemsize: int, row: int, aligned: bool = False) -> int:
    """Elements per segment: SEGMENT_BYTES' worth, whole rows where there are rows; where
    `aligned`, a multiple of ALIGN elements too if that keeps at least half of them."""
    per = max(1, SEGMENT_BYTES // itemsize)
    if not row:
        return per
    whole = max(row, per // row * row)
    if aligned:
        step = row * ALIGN // math.gcd(row, ALIGN)
        if per // step * step >= whole // 2:
            return per // step * step
    return whole


def _elements(data, itemsize: int) -> tuple[np.ndarray, int]:
    """`data` as uint8 and the element size the codec splits it by (1 where `itemsize` is not
    a word size or does not divide the data)."""
    data = np.frombuffer(data, np.uint8)
    if itemsize not in WORDS or data.nbytes % itemsize:
        itemsize = 1
    return data, itemsize


def sample(data, itemsize: int = 1) -> np.ndarray:
    """The bytes of `data` that `estimate` codes (uint8, whole elements, at positions that
    depend only on the data's size): estimate(sample(data)) == estimate(data)."""
    data, itemsize = _elements(data, itemsize)
    return _sample(data, itemsize, MATCH_ROW)


def estimate(data, itemsize: int = 1) -> int:
    """Coded bytes of the sample `encode` would choose its layout on: a cheap estimate of how
    well `data` codes (the same sample positions for buffers of the same size)."""
    data, itemsize = _elements(data, itemsize)
    return choose(data, itemsize)[2]


def encode(data, itemsize: int = 1, pmap=None) -> bytes:
    """Encode bytes whose elements are `itemsize` wide (a float type's size); `pmap` as in
    encode_pieces."""
    return b"".join(encode_pieces(data, itemsize, pmap))


@dataclass
class Layouts:
    """The layout (form, coder per plane) each segment of a buffer was coded with, which the
    next encode of the same kind of data (the same chunk a save later) reuses instead of
    choosing again on a sample; `uses` counts the encodes since they were chosen, `coded` is
    the coded bytes of the last encode's planes."""

    itemsize: int = 0
    segments: list = field(default_factory=list)
    uses: int = 0
    coded: int = 0
    row: int = 0

    def fits(self, itemsize: int, count: int, row: int = 0) -> bool:
        """True when these layouts are for `count` segments of `itemsize` elements in rows of
        `row` and young enough to reuse (they are chosen afresh every REUSE_LIMIT + 1 encodes)."""
        return (self.itemsize == itemsize and self.row == row and len(self.segments) == count
                and self.uses < REUSE_LIMIT)

    def update(self, itemsize: int, segments: list, coded: int, reused: bool, row: int = 0) -> None:
        """Record the layouts an encode used and its planes' coded bytes; an encode that reused them
        and coded more than REGROW larger than the one before has them chosen afresh next time."""
        grew = reused and coded > self.coded * REGROW
        self.itemsize, self.segments, self.coded, self.row = itemsize, segments, coded, row
        self.uses = REUSE_LIMIT if grew else self.uses + 1 if reused else 0


REUSE_LIMIT = 7
REGROW = 1.02  # payloads grow a little from step to step; choosing afresh then gains almost nothing


def encode_pieces(data, itemsize: int = 1, pmap=None, out=None,
                  layouts: Layouts | None = None, row: int = 0, at: int | None = None) -> list:
    """The payload of `encode` as a list of buffers, in order: raw planes are views of one work
    array per call (no copy out of it, no join into one large freshly faulted buffer). `out`, a
    uint8 array of at least the data's size, is that work array when the caller has one to
    reuse (the payload refers to it until written). `layouts` (see Layouts) are reused where
    they fit, else chosen on samples, and are updated to what this encode used; a reused coder
    that no longer gains on its plane leaves the plane raw. `row`, the elements of one row of
    the data (whole rows; 0 for none), lets segments use the grid model (see choose). `at`, the
    payload's offset in its file where the caller wants it aligned (payload version 6), starts
    each raw plane at a file offset that is a multiple of ALIGN, zero bytes filling the gap:
    from a page-aligned `out`, a store writing with direct I/O then sends raw planes to disk
    from where they lie instead of copying them (segments are then, where rows allow, a
    multiple of ALIGN elements, so that each of their planes starts page-aligned in `out`).
    `pmap`, a parallel `map`, encodes the segments at once (serially without one)."""
    data, itemsize = _elements(data, itemsize)
    count = data.nbytes // itemsize
    row = row if itemsize in WORDS and grid_fits(count, row) else 0
    per = _segment_elements(itemsize, row, aligned=at is not None)
    starts = list(range(0, count, per)) or [0]
    kept = np.empty(data.nbytes, np.uint8) if out is None else out[:data.nbytes]
    reuse = layouts.segments if layouts is not None and layouts.fits(itemsize, len(starts), row) else None

    def segment(j: int) -> tuple[tuple, list]:
        lo = starts[j]
        part = data[lo * itemsize:min(count, lo + per) * itemsize]
        form, coders = reuse[j] if reuse is not None else choose(part, itemsize, row, SAMPLE_SHARE)[:2]
        planes = kept[lo * itemsize:lo * itemsize + part.nbytes].reshape(itemsize, -1)
        to_planes(part, itemsize, bool(form & ROTATED), planes)
        shifts = None
        if form & GRID:
            shifts = fit_grid(planes[-1], row)
            apply_grid(planes[-1], planes[-1], shifts, row, add=False)
        elif form & MATCH:
            shifts = match_rows(planes[-1])
        coded = [encode_plane(plane, coder) for plane, coder in zip(planes, coders)]
        # raw where seven-bit packing met a set bit 0 the sample missed, or a reused coder no longer gains
        kept_coded = [c is not None and (reuse is None or coder == RAW or len(c) < PLANE_MIN_GAIN * plane.nbytes)
                      for plane, coder, c in zip(planes, coders, coded)]
        coders = [coder if keep else RAW for coder, keep in zip(coders, kept_coded)]
        coded = [[c if keep else memoryview(plane)] for plane, c, keep in zip(planes, coded, kept_coded)]
        if shifts is not None:
            coded[-1].insert(0, shifts)
        return (form, coders), coded

    coded = list((pmap or map)(segment, range(len(starts))))
    lengths = [sum(len(c) for c in plane) for _, planes in coded for plane in planes]
    if layouts is not None:
        layouts.update(itemsize, [(int(form), list(coders)) for (form, coders), _ in coded], sum(lengths),
                       reused=reuse is not None, row=row)
    return _payload_pieces(coded, lengths, itemsize, count, per, row, starts, at)


def _payload_pieces(coded: list, lengths: list, itemsize: int, count: int, per: int, row: int, starts: list,
                    at: int | None) -> list:
    """The payload of `encode_pieces` as buffers in order: head, layout table, plane lengths,
    then each segment's coded planes (`coded`: ((form, coders), planes) per segment), raw
    planes placed at ALIGN-multiple file offsets where `at` asks for it (version 6)."""
    grid = any(form & GRID for (form, _), _ in coded)
    version = (ALIGNED_VERSION if at is not None else
               SPARSE_VERSION if any(SPARSE in coders for (_, coders), _ in coded) else
               MATCH_VERSION if any(form & MATCH for (form, _), _ in coded) else
               GRID_VERSION if grid or any(SEVEN in coders for (_, coders), _ in coded) else PLAIN_VERSION)
    head = _HEAD.pack(version, itemsize, 0 if at is None else at % ALIGN, count, per)
    head += _ROW.pack(row if grid else 0) if version >= GRID_VERSION else b""
    table = bytes(b for (form, coders), _ in coded for b in (form, *(_PAYLOAD_CODER[c] for c in coders)))
    pieces = [head, table, struct.pack(f"<{len(lengths)}I", *lengths)]
    planes = [plane for _, segment_planes in coded for plane in segment_planes]
    if at is None:
        return pieces + [c for plane in planes for c in plane]
    end = sum(len(p) for p in pieces)
    offsets = _plane_offsets(end, lengths, [c for (_, coders), _ in coded for c in coders], version,
                             at % ALIGN, [min(count, lo + per) - lo for lo in starts])
    for start, length, plane in zip(offsets, lengths, planes):
        pieces += [_ZEROS[:start - end]] * (start > end) + plane
        end = start + length
    return pieces


def _plane_offsets(pos: int, lengths, coders: list, version: int, skew: int, sizes: list[int]) -> list[int]:
    """Where each (segment, plane) of a payload starts, its coded planes beginning at `pos`,
    then where the payload ends: in version 6, a raw plane of a segment whose element count
    (`sizes`, per segment) is a multiple of ALIGN starts at the next offset p with (p + skew)
    a multiple of ALIGN."""
    if version != ALIGNED_VERSION:
        return np.concatenate([[pos], pos + np.cumsum(lengths)]).tolist()
    offsets = []
    per_segment = len(coders) // len(sizes)
    for i, (length, coder) in enumerate(zip(lengths, coders)):
        pos += -(pos + skew) % ALIGN if coder == RAW and sizes[i // per_segment] % ALIGN == 0 else 0
        offsets.append(pos)
        pos += length
    return offsets + [pos]


def decode_into(payload, decoded_length: int, out: np.ndarray, pmap=None) -> None:
    """Decode a payload of `encode` into `out` (contiguous uint8 of `decoded_length` bytes)."""
    decode(payload, decoded_length, pmap, out=out)


def _payload_table(view: memoryview, decoded_length: int) -> tuple:
    """(itemsize, count, per, row, segment starts, (form, coders) per segment, coded length and
    offset of each plane) of a payload of `encode`, checked against `decoded_length` and the
    payload's own size (FormatError for a newer version, ValueError for a damaged one)."""
    version, itemsize, rotated, count, per = _HEAD.unpack_from(view)
    skew = rotated if version == ALIGNED_VERSION else 0
    if version > VERSION:
        raise FormatError(f"float codec payload version {version} is newer than this forkpoint reads "
                          f"({VERSION}); upgrade forkpoint to read it")
    if version not in (1, 2, GRID_VERSION, MATCH_VERSION, SPARSE_VERSION, ALIGNED_VERSION) or \
            count * itemsize != decoded_length or per < 1 or itemsize not in (1, *WORDS) or skew >= ALIGN:
        raise ValueError(f"float codec payload v{version} of {count}x{itemsize} bytes, expected {decoded_length}")
    pos = _HEAD.size
    row = 0
    if version >= GRID_VERSION:
        (row,) = _ROW.unpack_from(view, pos)
        pos += _ROW.size
        if row and (per % row or count % row):
            raise ValueError(f"float codec payload: rows of {row} elements do not tile {count} in segments of {per}")
    segments = max(1, -(-count // per))
    if segments * itemsize * 4 > len(view):  # each segment's coded lengths alone take 4 bytes a plane
        raise ValueError(f"float codec payload of {len(view)} bytes cannot hold the table of {segments} segments")
    starts = list(range(0, count, per)) or [0]
    if version == 1:
        layouts = [(int(rotated), list(view[pos:pos + itemsize]))] * len(starts)
        pos += itemsize
    else:
        layouts = [(view[p], list(view[p + 1:p + 1 + itemsize]))
                   for p in range(pos, pos + len(starts) * (itemsize + 1), itemsize + 1)]
        pos += len(starts) * (itemsize + 1)
    forms = (0, ROTATED, GRID, ROTATED | GRID) + ((MATCH, ROTATED | MATCH) if version >= MATCH_VERSION else ())
    if any(form not in forms or (form & GRID and not row) for form, _ in layouts):
        raise ValueError("float codec payload names an unknown segment form")
    known = (RAW, ZSTD, HUFFMAN) + ((SEVEN,) if version >= GRID_VERSION else ()) + ((SPARSE,) if version >= SPARSE_VERSION else ())
    if any(c not in known for _, coders in layouts for c in coders):
        raise ValueError("float codec payload names an unknown plane coder")
    lengths = struct.unpack_from(f"<{len(starts) * itemsize}I", view, pos)
    pos += 4 * len(lengths)
    sizes = [min(count, lo + per) - lo for lo in starts]
    offsets = _plane_offsets(pos, lengths, [c for _, coders in layouts for c in coders], version, skew, sizes)
    if offsets[-1] != len(view):
        raise ValueError(f"float codec payload holds {len(view)} bytes, its table says {offsets[-1]}")
    return itemsize, count, per, row, starts, layouts, lengths, offsets


def decode(payload, decoded_length: int, pmap=None, out=None) -> np.ndarray:
    """Decode a payload of `encode` into `decoded_length` bytes (a uint8 array: large ones
    come from numpy's huge-page-backed allocations, not zero-filled fresh pages; `out` when
    given); `pmap`, a parallel `map`, decodes the segments at once."""
    view = memoryview(payload).cast("B")
    itemsize, count, per, row, starts, layouts, lengths, offsets = _payload_table(view, decoded_length)
    if out is None:
        out = np.empty(decoded_length, np.uint8)
    elif out.dtype != np.uint8 or out.nbytes != decoded_length or not out.flags.c_contiguous:
        raise ValueError(f"decode target of {out.nbytes} bytes ({out.dtype}), expected {decoded_length} contiguous bytes")
    dest = out

    def segment(j: int) -> None:
        lo = starts[j]
        hi = min(count, lo + per)
        form, coders = layouts[j]
        planes = _planes_buffer(itemsize, hi - lo)
        shifts = None
        for k in range(itemsize):
            i = j * itemsize + k
            coded = view[offsets[i]:offsets[i] + lengths[i]]
            if k == itemsize - 1 and form & (GRID | MATCH):
                need = (hi - lo) // row + row if form & GRID else match_side_bytes(hi - lo)
                if len(coded) < need:
                    raise ValueError(f"float codec payload: segment {j}'s {'grid shifts' if form & GRID else 'row matches'} "
                                     f"need {need} bytes, it has {len(coded)}")
                shifts, coded = np.frombuffer(coded[:need], np.uint8), coded[need:]
            decode_plane(coded, coders[k], planes[k])
        if shifts is not None and form & GRID:
            apply_grid(planes[-1], planes[-1], shifts, row, add=True)
        elif shifts is not None:
            unmatch_rows(planes[-1], shifts)
        from_planes(planes, itemsize, bool(form & ROTATED), dest[lo * itemsize:hi * itemsize])

    list((pmap or map)(segment, range(len(starts))))
    return out
