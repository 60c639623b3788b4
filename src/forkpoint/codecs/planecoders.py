"""The coders of one byte plane, and the choice among them on a sample of the plane.

A plane is stored raw, zstd (fast strategy; good where values repeat at long distances: Adam
moments), deflate Huffman-only (near the order-0 entropy: weights' exponents), deflate with each
run of a repeated byte as one match at distance 1 (the zero runs of deltas, at about Huffman's
speed), sparse (where 30% of the bytes or more are zero, scattered: a deflated bitmap of the
nonzero bytes, then those bytes Huffman-coded; smaller than either deflate coder on the deltas of
a step that rounds most updates away, and faster, since only the nonzero bytes are entropy-coded)
or, where bit 0 of every byte is zero (a positive tensor's rotated sign), seven bits a byte.
A sparse plane is u32 coded bitmap bytes | u32 nonzero bytes | the bitmap (bit i of byte i / 8,
least significant first; deflate) | the nonzero bytes in order (deflate, literals only).
"""

import struct
import threading
import zlib

import numpy as np
import zstandard

from . import kernels, zstdframe

RAW, ZSTD, HUFFMAN = 0, 1, 2
RUNS = 3  # a deflate stream like HUFFMAN's, with runs as matches: payloads name it HUFFMAN (2)
SEVEN = 4  # bytes whose bit 0 is always zero, packed seven bits each (payload version 3)
SPARSE = 5  # a bitmap of the nonzero bytes (deflate), then those bytes (Huffman; version 5)
HUFFMAN_BLOCK, HUFFMAN_BLOCK_WIDE, WIDE_ENTROPY_BITS = 16 << 10, 64 << 10, 5.0
PLANE_MIN_GAIN = 0.98
ZSTD_MIN_GAIN = 0.95
RUNS_MIN_GAIN = 0.95
RUNS_MIN_SHARE = 0.10  # runs are tried where this share of bytes equals the two before (below it they gain little)
SEVEN_MIN_GAIN = 0.95
SEVEN_PRICE = 0.005
SPARSE_MIN_ZEROS = 0.3
ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=18, hash_log=13, chain_log=13, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST)
_SPARSE_HEAD = struct.Struct("<II")
SCRATCH_BYTES = 4 << 20  # a thread's work arrays are kept at least this large (a segment of floatcodec's)
_scratch = threading.local()


def encode_plane(plane: np.ndarray, coder: int, block: int = 0) -> bytes | np.ndarray:
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
        if kernels.planes is not None:
            return kernels.planes.huffman_deflate(plane, block or _huffman_block(plane), coder == RUNS)
        packer = kernels.deflate.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_RLE if coder == RUNS else zlib.Z_HUFFMAN_ONLY)
        return packer.compress(plane) + packer.flush()
    return memoryview(plane)


def _huffman_block(plane: np.ndarray) -> int:
    """Bytes per piece of the native Huffman coder (pieces of one distribution join one block):
    small pieces adapt to skewed planes, large ones spare planes that use most byte values the
    cost of judging each piece (decided on the first 64 KiB)."""
    head = plane[:HUFFMAN_BLOCK_WIDE]
    return _block_for(plane_stats(head)[0], head.nbytes)


def _block_for(entropy: float, nbytes: int) -> int:
    """_huffman_block of a plane whose first 64 KiB (`nbytes`) have this order-0 entropy."""
    return HUFFMAN_BLOCK_WIDE if nbytes and entropy >= WIDE_ENTROPY_BITS / 8 * nbytes else HUFFMAN_BLOCK


def _seven_bytes(n: int) -> int:
    return (7 * n + 7) // 8


def _pack_seven(plane: np.ndarray) -> bytes | None:
    """`plane` seven bits a byte (8 bytes into 7, little-endian, byte k's bits 7..1 at bits
    7k..7k+6 of each group), or None when some byte has bit 0 set."""
    if kernels.planes is not None:
        return kernels.planes.pack_seven(plane)
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
    if kernels.planes is not None:
        kernels.planes.unpack_seven(coded, out)
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
    if kernels.planes is None:
        return np.packbits(plane != 0, bitorder="little"), plane[plane != 0]
    bitmap, nonzero = _sparse_scratch(plane.size)
    count = kernels.planes.split_sparse(plane, bitmap, nonzero)
    return bitmap, nonzero[:count]


def _sparse_scratch(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The calling thread's bitmap (n / 8 bytes) and nonzero-byte (n + 8) work arrays."""
    held = getattr(_scratch, "sparse", None)
    if held is None or held[1].size < n + 8:
        size = max(n, SCRATCH_BYTES)
        held = _scratch.sparse = (np.empty(size // 8 + 1, np.uint8), np.empty(size + 8, np.uint8))
    return held[0][:(n + 7) // 8], held[1][:n + 8]


def _bitmap_coder(bitmap: np.ndarray) -> tuple[int, int]:
    """(coder, block) for a sparse plane's bitmap: deflate with runs where 10% or more of the
    bytes of its first 64 KiB equal the two before them (zero stretches: rows that matched
    whole, runs of zeros), else Huffman-only: below that share, Huffman-only codes the
    bitmaps of the benchmark states (benchmarks/compression.py) hardly larger, in less time."""
    head = bitmap[:HUFFMAN_BLOCK_WIDE]
    entropy, _, _, share = plane_stats(head, runs=True)
    return RUNS if share >= RUNS_MIN_SHARE else HUFFMAN, _block_for(entropy, head.nbytes)


def _pack_sparse(plane: np.ndarray) -> bytes:
    """`plane` as u32 coded bitmap bytes, u32 nonzero bytes, the bitmap deflated (see
    _bitmap_coder), the nonzero bytes deflated Huffman-only."""
    bitmap, nonzero = _split_sparse(plane)
    coded_bitmap = encode_plane(bitmap, *_bitmap_coder(bitmap))
    return b"".join((_SPARSE_HEAD.pack(len(coded_bitmap), nonzero.size), coded_bitmap, encode_plane(nonzero, HUFFMAN)))


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
    decode_plane(view[_SPARSE_HEAD.size:_SPARSE_HEAD.size + bitmap_bytes], HUFFMAN, bitmap)
    decode_plane(view[_SPARSE_HEAD.size + bitmap_bytes:], HUFFMAN, nonzero)
    if kernels.planes is not None:
        kernels.planes.join_sparse(bitmap, nonzero, out)
        return
    marked = np.unpackbits(bitmap, bitorder="little").view(bool)
    if marked[out.size:].any() or np.count_nonzero(marked) != count:
        raise ValueError(f"a sparse plane's bitmap marks {np.count_nonzero(marked)} bytes of {out.size}, "
                         f"it holds {count} nonzero bytes: damaged")
    out[...] = 0
    out[marked[:out.size]] = nonzero


def decode_plane(coded, coder: int, out: np.ndarray) -> None:
    if coder == SEVEN:
        _unpack_seven(coded, out)
    elif coder == SPARSE:
        _unpack_sparse(coded, out)
    elif coder == ZSTD:
        out[...] = np.frombuffer(zstdframe.decompress(coded, out.nbytes), np.uint8)
    elif coder == HUFFMAN and kernels.planes is not None:
        kernels.planes.inflate_into(coded, out)
    elif coder == HUFFMAN:
        inflater = kernels.deflate.decompressobj(-15)
        plain = inflater.decompress(coded, out.nbytes)
        if len(plain) != out.nbytes or not inflater.eof:
            raise ValueError(f"a deflate plane of {out.nbytes} bytes inflates to "
                             f"{'more' if len(plain) == out.nbytes else len(plain)}: damaged")
        out[...] = np.frombuffer(plain, np.uint8)
    else:
        out[...] = np.frombuffer(coded, np.uint8)


def plane_stats(plane: np.ndarray, runs: bool = False) -> tuple[float, int, bool, float]:
    """(order-0 entropy of `plane`'s bytes in bytes, a lower bound of Huffman's size; how many
    bytes are zero; whether any has bit 0 set; where `runs`, the share of bytes equal to the two
    before them, else 0), natively in one pass without the GIL (choosing is done by the codec's
    threads side by side)."""
    if kernels.planes is not None:
        return kernels.planes.plane_stats(plane, runs)
    counts = np.bincount(plane, minlength=256)
    seen = counts[counts > 0].astype(np.float64)
    entropy = float(-(seen * np.log2(seen / seen.sum())).sum() / 8)
    share = 0.0
    if runs:
        same = plane[1:] == plane[:-1]
        share = np.count_nonzero(same[1:] & same[:-1]) / max(1, plane.size)
    return entropy, int(counts[0]), bool(counts[1::2].any()), share


def plane_coder(plane: np.ndarray, zstd: bool = True, runs: bool = True) -> tuple[int, int]:
    """(coder, coded bytes) for a sample plane: deflate with runs where it beats Huffman-only
    deflate by 5% (it is slower on planes with few runs), zstd where it beats that deflate by
    5% (deflate is about 3x faster, and a sample misjudges zstd's matches by up to that much),
    else raw; planes whose order-0 entropy leaves no gain worth having (random-looking mantissa
    bytes) are left raw without trying. A plane whose bit 0 is always zero (a positive tensor's
    rotated sign under 7 random mantissa bits) is packed seven bits a byte unless an entropy
    coder does 5% better (packing runs several times faster than Huffman and saves as much on
    such planes). zstd is tried only with `zstd`, runs only with `runs` (see floatcodec's
    _layout_coders and _matched_option)."""
    entropy, zeros, odd, run_share = plane_stats(plane, runs=runs)
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


def _trial_bytes(plane: np.ndarray, coder: int, block: int) -> int:
    """Coded bytes of `plane` under `coder` (with pieces of `block` bytes); the native Huffman
    coder's are counted without coding (its blocks, headers and codes: the same bytes)."""
    if coder == HUFFMAN and kernels.planes is not None:
        return kernels.planes.huffman_bytes(plane, block)
    return len(encode_plane(plane, coder, block))


def pass_price(coder: int, nbytes: int) -> float:
    """What a pass of `coder` over a plane of `nbytes` costs, in coded bytes it must save: (1 -
    PLANE_MIN_GAIN) of the plane for an entropy coder, SEVEN_PRICE for seven-bit packing (several
    times faster), nothing for raw."""
    return 0.0 if coder == RAW else (SEVEN_PRICE if coder == SEVEN else 1 - PLANE_MIN_GAIN) * nbytes


