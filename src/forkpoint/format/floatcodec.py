"""The float-aware lossless codec: byte planes, each entropy-coded by the coder that suits it.

The plane split, the deflate coders and the inflater run in native code (format/_planes.c)
where the extension was built, else in numpy and zlib-ng; both write payloads that either reads.

Elements are split into byte planes, the top two optionally rotated left by one bit as one
16-bit word (the sign moves below the exponent, so the top plane of a float32 or bfloat16
holds exactly its exponent), and each plane is stored raw, zstd (fast strategy; good where
values repeat at long distances: Adam moments), deflate Huffman-only (near the order-0 entropy:
weights' exponents), deflate with each run of a repeated byte as one match at distance 1 (the
zero runs of deltas, at about Huffman's speed), sparse (where 30% of the bytes or more are zero,
scattered: a deflated bitmap of the nonzero bytes, then those bytes Huffman-coded; smaller than
either deflate coder on the deltas of a step that rounds most updates away, and faster, since
only the nonzero bytes are entropy-coded) or, where bit 0 of every byte is zero (a positive
tensor's rotated sign), seven bits a byte. The layout and each plane's coder are chosen on
a sample. Where the caller names the length of a row (a weight matrix's columns), the top plane
may instead be coded as its residual under a grid model: byte = row shift + column shift +
residual (mod 256), the shifts being medians (an Adam moment's exponents are close to log|u_r| +
log|v_c|, as a sum of outer products makes them; the residual has 25-35% less entropy than the
exponents). With or without rows, a top plane that zstd would code may instead be coded by
row matching: rows of MATCH_ROW bytes, each an earlier row (up to MATCH_REACH back) plus a
constant plus a residual that Huffman codes (an Adam moment's rows are often an earlier row
times a power of two). Segments of elements are coded independently (the caller may run them in parallel), each segment
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
constant, then the coded residual. A sparse plane is u32 coded bitmap bytes | u32 nonzero
bytes | the bitmap (bit i of byte i / 8, least significant first; deflate) | the
nonzero bytes in order (deflate, literals only). Version 1 payloads (one layout and coder list
for all segments, right after the counts) still decode.
"""

import math
import struct
import threading
import zlib
from dataclasses import dataclass, field

import numpy as np
import zstandard

from ..errors import FormatError
from . import zstdframe

try:
    from zlib_ng import zlib_ng as _deflate
except ImportError:  # the standard zlib writes and reads the same streams, slower
    _deflate = zlib
try:
    from . import _planes as _native
except ImportError:  # no C compiler at install time: numpy and zlib-ng do the same work
    _native = None

RAW, ZSTD, HUFFMAN = 0, 1, 2
RUNS = 3  # a deflate stream like HUFFMAN's, with runs as matches: payloads name it HUFFMAN (2)
SEVEN = 4  # bytes whose bit 0 is always zero, packed seven bits each (payload version 3)
SPARSE = 5  # a bitmap of the nonzero bytes (deflate), then those bytes (Huffman; version 5)
_PAYLOAD_CODER = {RAW: RAW, ZSTD: ZSTD, HUFFMAN: HUFFMAN, RUNS: HUFFMAN, SEVEN: SEVEN, SPARSE: SPARSE}
_SPARSE_HEAD = struct.Struct("<II")
_HEAD = struct.Struct("<BBHQI")
_ROW = struct.Struct("<I")
PLAIN_VERSION, GRID_VERSION, MATCH_VERSION, SPARSE_VERSION, ALIGNED_VERSION = 2, 3, 4, 5, 6
VERSION = ALIGNED_VERSION  # the newest this reader knows
ALIGN = 4096
_ZEROS = memoryview(bytes(ALIGN))
ROTATED, GRID, MATCH = 1, 2, 4
_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
SEGMENT_BYTES = 4 << 20
HUFFMAN_BLOCK, HUFFMAN_BLOCK_WIDE, WIDE_ENTROPY_BITS = 16 << 10, 64 << 10, 5.0
SAMPLE_PIECES, SAMPLE_ELEMENTS = 8, 4 << 10
SAMPLE_SHARE, SAMPLE_MIN_ELEMENTS = 16, 1 << 10  # an encode samples at most 1/16 of a small chunk
PLANE_MIN_GAIN = 0.98
ZSTD_MIN_GAIN = 0.95
RUNS_MIN_GAIN = 0.95
RUNS_MIN_SHARE = 0.10  # runs are tried where this share of bytes equals the two before (below it they gain little)
SEVEN_MIN_GAIN = 0.95
SEVEN_PRICE = 0.005
SPARSE_MIN_ZEROS = 0.3
GRID_DOWN, GRID_ACROSS = 128, 64
GRID_MIN_GAIN = 0.97
MATCH_ROW, MATCH_REACH, MATCH_LEAST, MATCH_SAMPLES = 256, 16, 8, 32
STRETCH_ELEMENTS = 1 << 18
GRID_MIN_ROWS, GRID_MIN_COLS, GRID_MAX_COLS = 16, 8, 16384
ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=18, hash_log=13, chain_log=13, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST)
_scratch = threading.local()


def _planes_buffer(itemsize: int, count: int) -> np.ndarray:
    """An (itemsize x count) uint8 work array, reused by the calling thread (no page faults
    on every segment)."""
    need = itemsize * count
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < need:
        buffer = _scratch.buffer = np.empty(max(need, SEGMENT_BYTES), np.uint8)
    return buffer[:need].reshape(itemsize, count)


def _encode_plane(plane: np.ndarray, coder: int, block: int = 0) -> bytes | np.ndarray:
    """`plane` coded by `coder` (None where SEVEN meets a set bit 0); `block`, the native
    deflate coders' piece size, is _huffman_block(plane) unless given."""
    if coder == ZSTD:
        packer = getattr(_scratch, "zstd", None)
        if packer is None:
            packer = _scratch.zstd = zstandard.ZstdCompressor(compression_params=ZSTD_PARAMS)
        return packer.compress(plane)
    if coder == SEVEN:
        return _pack_seven(plane)
    if coder == SPARSE:
        return _pack_sparse(plane)
    if coder in (HUFFMAN, RUNS):
        if _native is not None:
            return _native.huffman_deflate(plane, block or _huffman_block(plane), coder == RUNS)
        packer = _deflate.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_RLE if coder == RUNS else zlib.Z_HUFFMAN_ONLY)
        return packer.compress(plane) + packer.flush()
    return memoryview(plane)


def _huffman_block(plane: np.ndarray) -> int:
    """Bytes per piece of the native Huffman coder (pieces of one distribution join one block):
    small pieces adapt to skewed planes, large ones spare planes that use most byte values the
    cost of judging each piece (decided on the first 64 KiB)."""
    head = plane[:HUFFMAN_BLOCK_WIDE]
    return _block_for(_plane_stats(head)[0], head.nbytes)


def _block_for(entropy: float, nbytes: int) -> int:
    """_huffman_block of a plane whose first 64 KiB (`nbytes`) have this order-0 entropy."""
    return HUFFMAN_BLOCK_WIDE if nbytes and entropy >= WIDE_ENTROPY_BITS / 8 * nbytes else HUFFMAN_BLOCK


def _seven_bytes(n: int) -> int:
    return (7 * n + 7) // 8


def _pack_seven(plane: np.ndarray) -> bytes | None:
    """`plane` seven bits a byte (8 bytes into 7, little-endian, byte k's bits 7..1 at bits
    7k..7k+6 of each group), or None when some byte has bit 0 set."""
    if _native is not None:
        return _native.pack_seven(plane)
    if np.any(plane & 1):
        return None
    whole = plane.size // 8 * 8
    groups = (plane[:whole].reshape(-1, 8) >> 1).astype(np.uint64) << (7 * np.arange(8, dtype=np.uint64))
    packed = np.bitwise_or.reduce(groups, axis=1).view(np.uint8).reshape(-1, 8)[:, :7].tobytes()
    tail = sum(int(b >> 1) << (7 * k) for k, b in enumerate(plane[whole:]))
    return packed + tail.to_bytes(8, "little")[:_seven_bytes(plane.size - whole)]


def _unpack_seven(coded, out: np.ndarray) -> None:
    if len(coded) != _seven_bytes(out.size):
        raise ValueError(f"{len(coded)} packed bytes cannot hold {out.size} seven-bit bytes")
    if _native is not None:
        _native.unpack_seven(coded, out)
        return
    whole = out.size // 8 * 8
    packed = np.frombuffer(coded, np.uint8)
    groups = np.zeros((whole // 8, 8), np.uint8)
    groups[:, :7] = packed[:whole // 8 * 7].reshape(-1, 7)
    words = groups.view(np.uint64).reshape(-1, 1)
    out[:whole] = (((words >> (7 * np.arange(8, dtype=np.uint64))) & np.uint64(0x7F)) << np.uint64(1)).astype(np.uint8).reshape(-1)
    tail = int.from_bytes(bytes(packed[whole // 8 * 7:]), "little")
    for k in range(out.size - whole):
        out[whole + k] = ((tail >> (7 * k)) & 0x7F) << 1


def _split_sparse(plane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bitmap of `plane`'s nonzero bytes, bit i of byte i // 8 least significant first; those
    bytes in order), views of the calling thread's scratch where the native kernels are built."""
    if _native is None:
        return np.packbits(plane != 0, bitorder="little"), plane[plane != 0]
    bitmap, nonzero = _sparse_scratch(plane.size)
    count = _native.split_sparse(plane, bitmap, nonzero)
    return bitmap, nonzero[:count]


def _sparse_scratch(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The calling thread's bitmap (n / 8 bytes) and nonzero-byte (n + 8) work arrays."""
    held = getattr(_scratch, "sparse", None)
    if held is None or held[1].size < n + 8:
        size = max(n, SEGMENT_BYTES)
        held = _scratch.sparse = (np.empty(size // 8 + 1, np.uint8), np.empty(size + 8, np.uint8))
    return held[0][:(n + 7) // 8], held[1][:n + 8]


def _bitmap_coder(bitmap: np.ndarray) -> tuple[int, int]:
    """(coder, block) for a sparse plane's bitmap: deflate with runs where 10% or more of the
    bytes of its first 64 KiB equal the two before them (zero stretches: rows that matched
    whole, runs of zeros), else Huffman-only: below that share, Huffman-only codes the
    bitmaps of the benchmark states (benchmarks/compression.py) hardly larger, in less time."""
    head = bitmap[:HUFFMAN_BLOCK_WIDE]
    entropy, _, _, share = _plane_stats(head, runs=True)
    return RUNS if share >= RUNS_MIN_SHARE else HUFFMAN, _block_for(entropy, head.nbytes)


def _pack_sparse(plane: np.ndarray) -> bytes:
    """`plane` as u32 coded bitmap bytes, u32 nonzero bytes, the bitmap deflated (see
    _bitmap_coder), the nonzero bytes deflated Huffman-only."""
    bitmap, nonzero = _split_sparse(plane)
    coded_bitmap = _encode_plane(bitmap, *_bitmap_coder(bitmap))
    return b"".join((_SPARSE_HEAD.pack(len(coded_bitmap), nonzero.size), coded_bitmap, _encode_plane(nonzero, HUFFMAN)))


def _sparse_bytes(plane: np.ndarray) -> int:
    """Coded bytes of `plane` as _pack_sparse codes it (Huffman-coded parts counted, see _trial_bytes)."""
    bitmap, nonzero = _split_sparse(plane)
    coded = _SPARSE_HEAD.size + _trial_bytes(bitmap, *_bitmap_coder(bitmap))
    return coded + _trial_bytes(nonzero, HUFFMAN, _huffman_block(nonzero))


def _unpack_sparse(coded, out: np.ndarray) -> None:
    """Decode a plane of _pack_sparse into `out`; ValueError where its counts, bitmap or bytes
    do not agree (damaged)."""
    view = memoryview(coded).cast("B")
    if len(view) < _SPARSE_HEAD.size:
        raise ValueError(f"a sparse plane of {out.size} bytes: {len(view)} coded bytes cannot hold its head")
    bitmap_bytes, count = _SPARSE_HEAD.unpack_from(view)
    if count > out.size or _SPARSE_HEAD.size + bitmap_bytes > len(view):
        raise ValueError(f"a sparse plane of {out.size} bytes names {count} nonzero bytes in a bitmap of "
                         f"{bitmap_bytes} coded bytes; it holds {len(view)}: damaged")
    bitmap, nonzero = (np.empty((out.size + 7) // 8, np.uint8), np.empty(count, np.uint8))
    _decode_plane(view[_SPARSE_HEAD.size:_SPARSE_HEAD.size + bitmap_bytes], HUFFMAN, bitmap)
    _decode_plane(view[_SPARSE_HEAD.size + bitmap_bytes:], HUFFMAN, nonzero)
    if _native is not None:
        _native.join_sparse(bitmap, nonzero, out)
        return
    marked = np.unpackbits(bitmap, bitorder="little").view(bool)
    if marked[out.size:].any() or np.count_nonzero(marked) != count:
        raise ValueError(f"a sparse plane's bitmap marks {np.count_nonzero(marked)} bytes of {out.size}, "
                         f"it holds {count} nonzero bytes: damaged")
    out[...] = 0
    out[marked[:out.size]] = nonzero


def _decode_plane(coded, coder: int, out: np.ndarray) -> None:
    if coder == SEVEN:
        _unpack_seven(coded, out)
    elif coder == SPARSE:
        _unpack_sparse(coded, out)
    elif coder == ZSTD:
        out[...] = np.frombuffer(zstdframe.decompress(coded, out.nbytes), np.uint8)
    elif coder == HUFFMAN and _native is not None:
        _native.inflate_into(coded, out)
    elif coder == HUFFMAN:
        inflater = _deflate.decompressobj(-15)
        plain = inflater.decompress(coded, out.nbytes)
        if len(plain) != out.nbytes or not inflater.eof:
            raise ValueError(f"a deflate plane of {out.nbytes} bytes inflates to "
                             f"{'more' if len(plain) == out.nbytes else len(plain)}: damaged")
        out[...] = np.frombuffer(plain, np.uint8)
    else:
        out[...] = np.frombuffer(coded, np.uint8)


_LOW = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)


def _rotate(top: np.ndarray, below: np.ndarray, left: bool) -> None:
    """Rotate the 16-bit words (top, below) by one bit, in place, left or right (8 bytes at a
    time, masking the bits that would cross into the next byte)."""
    whole = top.size - top.size % 8
    if whole:
        _rotate_words(top[:whole].view(np.uint64), below[:whole].view(np.uint64), left)
    if whole < top.size:
        _rotate_bytes(top[whole:], below[whole:], left)


def _rotate_words(top: np.ndarray, below: np.ndarray, left: bool) -> None:
    one = np.uint64(1)
    seven = np.uint64(7)
    if left:
        carry = (top >> seven) & _LOW
        top <<= one
        top &= ~_LOW
        top |= (below >> seven) & _LOW
        below <<= one
        below &= ~_LOW
        below |= carry
    else:
        carry = (below & _LOW) << seven
        below >>= one
        below &= ~_HIGH
        below |= (top & _LOW) << seven
        top >>= one
        top &= ~_HIGH
        top |= carry


def _rotate_bytes(top: np.ndarray, below: np.ndarray, left: bool) -> None:
    if left:
        carry = top >> 7
        top <<= 1
        top |= below >> 7
        below <<= 1
        below |= carry
    else:
        carry = below & 1
        below >>= 1
        below |= top << 7
        top >>= 1
        top |= carry << 7


def _to_planes(elements: np.ndarray, itemsize: int, rotated: bool, planes: np.ndarray) -> None:
    """Write `elements` (uint8, whole elements) into `planes` (itemsize x count), rotated if asked."""
    if _native is not None and itemsize in _WORDS:
        _native.to_planes(elements, planes, itemsize, rotated)
        return
    planes[...] = elements.reshape(-1, itemsize).T
    if rotated:
        _rotate(planes[-1], planes[-2], True)


def _from_planes(planes: np.ndarray, itemsize: int, rotated: bool, out: np.ndarray) -> None:
    if _native is not None and itemsize in _WORDS:
        _native.from_planes(planes, out, itemsize, rotated)
        return
    if rotated:
        _rotate(planes[-1], planes[-2], False)
    out.reshape(-1, itemsize)[...] = planes.T


def _lower_median(values: np.ndarray, axis: int) -> np.ndarray:
    middle = (values.shape[axis] - 1) // 2
    return np.take(np.partition(values, middle, axis=axis), middle, axis=axis)


def _fit_grid(plane: np.ndarray, cols: int) -> np.ndarray:
    """The grid model of a plane of rows of `cols` bytes: its row shifts (one byte per row)
    then its column shifts (`cols` bytes): each column's lower median over up to GRID_DOWN evenly
    spaced rows, then each row's lower median of (byte - column shift) over up to GRID_ACROSS
    evenly spaced columns (native and numpy pick the same)."""
    rows = plane.size // cols
    shifts = np.empty(rows + cols, np.uint8)
    if _native is not None:
        _native.fit_grid(plane, cols, GRID_DOWN, GRID_ACROSS, shifts[:rows], shifts[rows:])
        return shifts
    grid = plane.reshape(rows, cols)
    picked = min(rows, GRID_DOWN)
    column = _lower_median(grid[np.arange(picked) * rows // picked], axis=0)
    picked = min(cols, GRID_ACROSS)
    at = np.arange(picked) * cols // picked
    row = _lower_median(grid[:, at].astype(np.int16) - column[at].astype(np.int16), axis=1)
    shifts[:rows], shifts[rows:] = row & 255, column
    return shifts


def _apply_grid(src: np.ndarray, dst: np.ndarray, shifts: np.ndarray, cols: int, add: bool) -> None:
    """dst = src - row shift - column shift (+ where `add`), per byte, modulo 256, for a plane
    of rows of `cols` bytes and its `shifts` (see _fit_grid)."""
    rows = src.size // cols
    row, column = shifts[:rows], shifts[rows:]
    if _native is not None:
        _native.apply_grid(src, dst, row, column, add)
        return
    grid, out = src.reshape(rows, -1), dst.reshape(rows, -1)
    combine = np.add if add else np.subtract
    combine(grid, column, out=out)
    combine(out, row[:, None], out=out)


def _match_rows(plane: np.ndarray) -> np.ndarray:
    """Code `plane` (in place) as rows of MATCH_ROW bytes, each an earlier row (up to MATCH_REACH
    back) plus a constant plus the residual left in the plane; return the side bytes (each row's
    distance back, 0 for none, then each row's constant). See match_rows in _planes.c: the numpy
    path picks the same rows and constants."""
    side = np.zeros(_match_side_bytes(plane.size), np.uint8)
    rows = side.size // 2
    if _native is not None:
        _native.match_rows(plane, plane, side, MATCH_ROW, MATCH_REACH, MATCH_LEAST)
        return side
    whole = plane.size // MATCH_ROW
    if whole < 2:
        return side
    grid = plane[:whole * MATCH_ROW].reshape(whole, MATCH_ROW)
    samples = grid[:, ::MATCH_ROW // MATCH_SAMPLES].astype(np.int16)
    best = np.full(whole, MATCH_LEAST - 1)
    back = np.zeros(whole, np.int64)
    shift = np.zeros(whole, np.uint8)
    for o in range(1, min(MATCH_REACH, whole - 1) + 1):
        d = (samples[o:] - samples[:-o]) & 255
        for c in range(4):
            t = d[:, c * (MATCH_SAMPLES // 4)]
            score = (d == t[:, None]).sum(axis=1)
            better = score > best[o:]
            best[o:][better] = score[better]
            back[o:][better] = o
            shift[o:][better] = t[better]
    rows_at = np.arange(whole)
    matched = back > 0
    reference = grid[rows_at[matched] - back[matched]]
    grid[matched] = grid[matched] - reference - shift[matched][:, None]
    side[:whole], side[rows:rows + whole] = back, shift
    return side


def _unmatch_rows(plane: np.ndarray, side) -> None:
    """Inverse of _match_rows, in place: `plane` holds the residual and becomes the rows."""
    side = np.frombuffer(side, np.uint8)
    if _native is not None:
        _native.unmatch_rows(plane, side, MATCH_ROW)
        return
    rows = side.size // 2
    for r in np.flatnonzero(side[:rows]).tolist():
        back = int(side[r])
        if back > r:
            raise ValueError(f"row matching: row {r} refers to a row before the first")
        here = plane[r * MATCH_ROW:(r + 1) * MATCH_ROW]
        here += plane[(r - back) * MATCH_ROW:(r - back) * MATCH_ROW + here.size] + side[rows + r]


def _match_side_bytes(nbytes: int) -> int:
    return 2 * -(-nbytes // MATCH_ROW)


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


def _plane_stats(plane: np.ndarray, runs: bool = False) -> tuple[float, int, bool, float]:
    """(order-0 entropy of `plane`'s bytes in bytes, a lower bound of Huffman's size; how many
    bytes are zero; whether any has bit 0 set; where `runs`, the share of bytes equal to the two
    before them, else 0), natively in one pass without the GIL (choosing is done by the codec's
    threads side by side)."""
    if _native is not None:
        return _native.plane_stats(plane, runs)
    counts = np.bincount(plane, minlength=256)
    seen = counts[counts > 0].astype(np.float64)
    entropy = float(-(seen * np.log2(seen / seen.sum())).sum() / 8)
    share = 0.0
    if runs:
        same = plane[1:] == plane[:-1]
        share = np.count_nonzero(same[1:] & same[:-1]) / max(1, plane.size)
    return entropy, int(counts[0]), bool(counts[1::2].any()), share


def _plane_coder(plane: np.ndarray, zstd: bool = True, runs: bool = True) -> tuple[int, int]:
    """(coder, coded bytes) for a sample plane: deflate with runs where it beats Huffman-only
    deflate by 5% (it is slower on planes with few runs), zstd where it beats that deflate by
    5% (deflate is about 3x faster, and a sample misjudges zstd's matches by up to that much),
    else raw; planes whose order-0 entropy leaves no gain worth having (random-looking mantissa
    bytes) are left raw without trying. A plane whose bit 0 is always zero (a positive tensor's
    rotated sign under 7 random mantissa bits) is packed seven bits a byte unless an entropy
    coder does 5% better (packing runs several times faster than Huffman and saves as much on
    such planes). zstd is tried only with `zstd`, runs only with `runs` (see _layout_coders and
    _matched_option)."""
    entropy, zeros, odd, run_share = _plane_stats(plane, runs=runs)
    if entropy >= PLANE_MIN_GAIN * plane.nbytes:
        return RAW, plane.nbytes
    seven = _seven_bytes(plane.nbytes) if plane.nbytes and not odd else None
    if seven is not None and entropy >= SEVEN_MIN_GAIN * seven:
        return SEVEN, seven
    tried = ((HUFFMAN, RUNS) if run_share >= RUNS_MIN_SHARE else (HUFFMAN,)) + ((ZSTD,) if zstd else ())
    block = _block_for(entropy, plane.nbytes) if plane.nbytes <= HUFFMAN_BLOCK_WIDE else _huffman_block(plane)
    sizes = {coder: _trial_bytes(plane, coder, block) for coder in tried}
    deflate = RUNS if sizes.get(RUNS, float("inf")) < RUNS_MIN_GAIN * sizes[HUFFMAN] else HUFFMAN
    if zeros >= SPARSE_MIN_ZEROS * plane.size and (sparse := _sparse_bytes(plane)) <= sizes[deflate]:
        deflate, sizes[SPARSE] = SPARSE, sparse
    coder = ZSTD if sizes.get(ZSTD, float("inf")) < ZSTD_MIN_GAIN * sizes[deflate] else deflate
    if seven is not None and sizes[coder] >= SEVEN_MIN_GAIN * seven:
        return SEVEN, seven
    return (coder, sizes[coder]) if sizes[coder] < PLANE_MIN_GAIN * plane.nbytes else (RAW, plane.nbytes)


def _layout_coders(planes: np.ndarray) -> list[tuple[int, int]]:
    """_plane_coder of each of a sample's planes, the top one first: a plane below it tries zstd
    only where the top plane took zstd. zstd wins on repeats far apart, which rows that repeat
    put in every plane but which a plane below the top never showed alone: across the sample
    planes of benchmarks/compression.py's and codecs.py's states as saves split them, zstd won
    0 of 707 trials below the top (and 240 of 1324 on it)."""
    top = _plane_coder(planes[-1])
    return [_plane_coder(plane, zstd=top[0] == ZSTD) for plane in planes[:-1]] + [top]


def _trial_bytes(plane: np.ndarray, coder: int, block: int) -> int:
    """Coded bytes of `plane` under `coder` (with pieces of `block` bytes); the native Huffman
    coder's are counted without coding (its blocks, headers and codes: the same bytes)."""
    if coder == HUFFMAN and _native is not None:
        return _native.huffman_bytes(plane, block)
    return len(_encode_plane(plane, coder, block))


def choose(data: np.ndarray, itemsize: int, row: int = 0, share: int = 1) -> tuple[int, list[int], int]:
    """(form, coder per plane, coded bytes of the sample) for `data`: the layout whose coded
    bytes plus the price of each pass it makes over a plane (_pass_price) are fewer (so that a
    plane that codes only slightly smaller, such as a bf16 weight's low byte, stays raw and
    costs no encode time). Form: 0, ROTATED, or ROTATED | GRID where
    `row` (elements per row, 0 for none) allows the grid model; the sample is then made of whole
    rows, and the grid is tried only where its residual's order-0 entropy is below GRID_MIN_GAIN of the
    rotated top plane's coded size (weights' exponents have no such structure: their residuals
    code no smaller). A layout whose top plane zstd codes is also tried with that plane's rows
    matched (| MATCH, see _matched_option). `share` bounds the sample to that fraction of the
    data (see _sample): an encode passes SAMPLE_SHARE, so that a 1 MiB float32 chunk's choice
    costs half as much; `estimate` keeps the full sample, whose delta decisions it steadies."""
    grid = itemsize in _WORDS and grid_fits(data.nbytes // itemsize, row)
    sample = _sample(data, itemsize, row if grid else MATCH_ROW, share)
    planes = np.empty((itemsize, sample.nbytes // itemsize), np.uint8)
    _to_planes(sample, itemsize, False, planes)
    plain = _layout_coders(planes)
    if itemsize not in _WORDS:
        return 0, [c for c, _ in plain], sum(n for _, n in plain)
    matched = _matched_option(0, plain, planes[-1])
    _to_planes(sample, itemsize, True, planes)
    turned = plain[:-2] + _layout_coders(planes[-2:])
    options = [(0, plain), (ROTATED, turned)] + matched + _matched_option(ROTATED, turned, planes[-1])
    if grid:
        segment = min(data.nbytes // itemsize, _segment_elements(itemsize, row))
        shift_bytes = round(planes.shape[1] * (1 / row + row / segment))
        _apply_grid(planes[-1], planes[-1], _fit_grid(planes[-1], row), row, add=False)
        if _plane_stats(planes[-1])[0] + shift_bytes < GRID_MIN_GAIN * turned[-1][1]:
            coder, coded = _plane_coder(planes[-1])
            options.append((ROTATED | GRID, turned[:-1] + [(coder, coded + shift_bytes)]))
    def price(option):
        return sum(n + _pass_price(c, planes.shape[1]) for c, n in option[1])
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
    """[(form | MATCH, coders)] where row matching (see _match_rows) suits the sample's `top`
    plane, which `option` codes with zstd (repeats far apart: rows that are near multiples of
    earlier rows, which matching codes smaller, and Huffman then several times faster than zstd
    codes `top`); else []. Not tried where zstd codes the plane to under a bit a byte (zero
    runs: a residual cannot code smaller than that). Neither zstd nor runs are tried on the
    residual: on the residuals of the benchmark states (benchmarks/compression.py) neither
    beat Huffman-only or the sparse coder."""
    if option[-1][0] != ZSTD or top.size < 2 * MATCH_ROW or option[-1][1] * 8 < top.size:
        return []
    residual = top.copy()
    side = _match_rows(residual)
    coder, coded = _plane_coder(residual, zstd=False, runs=False)
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
        coded = _encode_plane(plane, coder)
        return plane.nbytes if coded is None else len(coded) + _pass_price(coder, plane.nbytes)

    costs = []
    for form, chosen in options:
        rotated, coders = bool(form & ROTATED), [c for c, _ in chosen]
        if rotated not in planes_of:
            planes_of[rotated] = np.empty((itemsize, take * row), np.uint8)
            _to_planes(stretch, itemsize, rotated, planes_of[rotated])
        planes = planes_of[rotated]
        if (rotated, coders[-2]) not in below_cost:
            below_cost[rotated, coders[-2]] = plane_cost(planes[-2], coders[-2])
        cost = below_cost[rotated, coders[-2]]
        top = planes[-1]
        if form & GRID:
            top = top.copy()
            _apply_grid(top, top, _fit_grid(top, row), row, add=False)
            cost += take + row * take * row / min(rows * row, _segment_elements(itemsize, row))
        elif form & MATCH:
            top = top.copy()
            cost += _match_rows(top).size
        costs.append(cost + plane_cost(top, coders[-1]))
    return costs


def _pass_price(coder: int, nbytes: int) -> float:
    """What a pass of `coder` over a plane of `nbytes` costs, in coded bytes it must save: (1 -
    PLANE_MIN_GAIN) of the plane for an entropy coder, SEVEN_PRICE for seven-bit packing (several
    times faster), nothing for raw."""
    return 0.0 if coder == RAW else (SEVEN_PRICE if coder == SEVEN else 1 - PLANE_MIN_GAIN) * nbytes


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
    if itemsize not in _WORDS or data.nbytes % itemsize:
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
    row = row if itemsize in _WORDS and grid_fits(count, row) else 0
    per = _segment_elements(itemsize, row, aligned=at is not None)
    starts = list(range(0, count, per)) or [0]
    kept = np.empty(data.nbytes, np.uint8) if out is None else out[:data.nbytes]
    reuse = layouts.segments if layouts is not None and layouts.fits(itemsize, len(starts), row) else None

    def segment(j: int) -> tuple[tuple, list]:
        lo = starts[j]
        part = data[lo * itemsize:min(count, lo + per) * itemsize]
        form, coders = reuse[j] if reuse is not None else choose(part, itemsize, row, SAMPLE_SHARE)[:2]
        planes = kept[lo * itemsize:lo * itemsize + part.nbytes].reshape(itemsize, -1)
        _to_planes(part, itemsize, bool(form & ROTATED), planes)
        shifts = None
        if form & GRID:
            shifts = _fit_grid(planes[-1], row)
            _apply_grid(planes[-1], planes[-1], shifts, row, add=False)
        elif form & MATCH:
            shifts = _match_rows(planes[-1])
        coded = [_encode_plane(plane, coder) for plane, coder in zip(planes, coders)]
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
            count * itemsize != decoded_length or per < 1 or itemsize not in (1, *_WORDS) or skew >= ALIGN:
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
                need = (hi - lo) // row + row if form & GRID else _match_side_bytes(hi - lo)
                if len(coded) < need:
                    raise ValueError(f"float codec payload: segment {j}'s {'grid shifts' if form & GRID else 'row matches'} "
                                     f"need {need} bytes, it has {len(coded)}")
                shifts, coded = np.frombuffer(coded[:need], np.uint8), coded[need:]
            _decode_plane(coded, coders[k], planes[k])
        if shifts is not None and form & GRID:
            _apply_grid(planes[-1], planes[-1], shifts, row, add=True)
        elif shifts is not None:
            _unmatch_rows(planes[-1], shifts)
        _from_planes(planes, itemsize, bool(form & ROTATED), dest[lo * itemsize:hi * itemsize])

    list((pmap or map)(segment, range(len(starts))))
    return out
