"""Object files: a header, then the codec's payload.

Header (little-endian): magic b"FPO1", codec id (u8), one zero byte, header size (u16: the
payload's offset, 16 or a multiple of 4096 so that large payloads can use direct I/O),
decoded length (u64). Bytes 16..H hold the block digest table of a raw payload longer than
one block (else zeros). An object is named by the content hash of its decoded bytes.
"""

import struct

import blake3

from ..errors import CorruptObjectError, FormatError
from ..codecs import codec_by_id

OBJECT_MAGIC = b"FPO1"
OBJECT_HEADER_SIZE = 16
ALIGNED_HEADER_SIZE = 4096
_HEADER = struct.Struct("<4sBxHQ")
HASH_THREADS_MIN_BYTES = 4 << 20
BLOCK_BYTES = 1 << 20
MAX_HEADER_SIZE = 15 * ALIGNED_HEADER_SIZE
DIGEST_BYTES = 32
MAX_PACK_BYTES = 256 << 20
"""The most decoded bytes a pack (an object holding several leaves' chunks) may declare
beyond what a manifest reads of it: a reader refuses longer ones before decoding them."""
_ROOT_PREFIX = b"FPB1"
_HEX = frozenset("0123456789abcdef")


def object_key(digest: str) -> str:
    """Return the storage key of the object named `digest` (64 hex digits, else FormatError)."""
    if not isinstance(digest, str) or len(digest) != 64 or not _HEX.issuperset(digest):
        raise FormatError(f"invalid object name {digest!r} in a manifest: expected 64 hex digits")
    return f"objects/{digest[:2]}/{digest}"


def is_object_key(key: str) -> bool:
    """True for a storage key that names an object: objects/<h[0:2]>/<h>, h 64 hex digits."""
    parts = key.split("/")
    return (len(parts) == 3 and parts[0] == "objects" and len(parts[2]) == 64
            and _HEX.issuperset(parts[2]) and parts[1] == parts[2][:2])


def content_hash(data, pmap=None) -> str:
    """Return the content hash of a bytes-like object: blake3 of the bytes up to one block,
    else `block_root` of the blake3 digests of its 1 MiB blocks (so any block range verifies).
    `pmap` as in block_digests."""
    view = memoryview(data).cast("B")
    if view.nbytes <= BLOCK_BYTES:
        return blake3.blake3(view).hexdigest()
    return block_root(block_digests(view, pmap=pmap), view.nbytes)


def block_digests(view: memoryview, first_block: int = 0, pmap=None) -> bytes:
    """Concatenated 32-byte blake3 digests of the 1 MiB blocks of `view`: with `pmap` (a
    parallel `map`, such as the engine's), large views hash in two halves at once."""
    view = memoryview(view).cast("B")
    starts = range(0, view.nbytes, BLOCK_BYTES)

    def run(part: range) -> bytes:
        return b"".join(blake3.blake3(view[lo:lo + BLOCK_BYTES]).digest() for lo in part)

    if view.nbytes < HASH_THREADS_MIN_BYTES or pmap is None:
        return run(starts)
    half = (len(starts) + 1) // 2
    return b"".join(pmap(run, [starts[:half], starts[half:]]))


def block_root(digests: bytes, length: int) -> str:
    """The content hash of `length` bytes (more than one block) whose block digests are `digests`."""
    return blake3.blake3(_ROOT_PREFIX + struct.pack("<Q", length) + digests).hexdigest()


def block_table(header: bytes, length: int, digest: str) -> bytes | None:
    """The block digest table held in an object's header if it checks against `digest`, else None."""
    count = -(-length // BLOCK_BYTES)
    table = header[OBJECT_HEADER_SIZE:OBJECT_HEADER_SIZE + count * DIGEST_BYTES]
    if count < 2 or len(table) != count * DIGEST_BYTES or block_root(table, length) != digest:
        return None
    return table


def table_header_size(length: int) -> int:
    """The aligned header size that holds the block table of a raw `length`-byte payload."""
    count = -(-length // BLOCK_BYTES) if length > BLOCK_BYTES else 0
    size = -(-(OBJECT_HEADER_SIZE + count * DIGEST_BYTES) // ALIGNED_HEADER_SIZE) * ALIGNED_HEADER_SIZE
    return size if size <= MAX_HEADER_SIZE else ALIGNED_HEADER_SIZE


def decode_object(blob, digest: str, where: str, verify: bool = True, limit: int | None = None, pmap=None):
    """The decoded bytes of a whole object file `blob` named `digest`; CorruptObjectError
    (naming `where`) when it cannot be decoded, when its header declares more than `limit`
    decoded bytes (checked before anything is allocated) or, with `verify`, when it does not
    match its name; FormatError when its payload is of a newer version than this reader knows.
    `pmap`: a parallel `map` for decoding and hashing (serial without one)."""
    codec_id, length, header_size = unpack_header(bytes(memoryview(blob)[:OBJECT_HEADER_SIZE]), where)
    if limit is not None and length > limit:
        raise CorruptObjectError(f"{where} declares {length} decoded bytes, more than the {limit} its manifest "
                                 "allows: corrupted or crafted")
    if header_size > len(blob):
        raise CorruptObjectError(f"{where} is truncated: its header of {header_size} bytes is longer than the file")
    codec = codec_by_id(codec_id, where)
    try:
        data = codec.decode(memoryview(blob)[header_size:], length, pmap=pmap)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    except Exception as e:  # any decoder failure means the stored bytes are damaged
        raise CorruptObjectError(f"{where} cannot be decoded as {codec.name} ({e}): corrupted") from None
    if len(data) != length or (verify and content_hash(data, pmap) != digest):
        raise CorruptObjectError(f"{where} does not match its hash: corrupted")
    return data


def decode_limit(chunk) -> int:
    """The most decoded bytes the object of `chunk` (a manifest's Chunk) may declare: its size
    for a standalone or delta chunk, else (a pack) MAX_PACK_BYTES or the end of the chunk."""
    if chunk.object == chunk.hash or chunk.delta is not None:
        return chunk.size
    return max(MAX_PACK_BYTES, chunk.start + chunk.size)


def pack_header(codec_id: int, decoded_length: int, header_size: int = OBJECT_HEADER_SIZE,
                table: bytes = b"") -> bytes:
    """Return the `header_size` bytes that precede an object's payload (with its block table)."""
    if OBJECT_HEADER_SIZE + len(table) > header_size or header_size > 0xFFFF:
        raise ValueError(f"a {len(table)}-byte block table does not fit a {header_size}-byte header")
    head = _HEADER.pack(OBJECT_MAGIC, codec_id, header_size, decoded_length) + table
    return head + bytes(header_size - len(head))


def unpack_header(header: bytes, where: str) -> tuple[int, int, int]:
    """Return (codec id, decoded length, header size) or raise CorruptObjectError naming `where`."""
    if len(header) < OBJECT_HEADER_SIZE:
        raise CorruptObjectError(f"object {where} is truncated: {len(header)} header bytes")
    magic, codec_id, header_size, length = _HEADER.unpack_from(header)
    if magic != OBJECT_MAGIC:
        raise CorruptObjectError(f"object {where} has no forkpoint object header (magic {magic!r})")
    if header_size < OBJECT_HEADER_SIZE:
        raise CorruptObjectError(f"object {where} has an invalid header size {header_size}")
    return codec_id, length, header_size


def runs_of_bytes(items: list, max_bytes: int) -> list[list]:
    """`items` (each with `nbytes`) in consecutive runs of at most `max_bytes`; an item larger
    than that makes a run of its own."""
    runs: list[list] = [[]]
    size = 0
    for item in items:
        if runs[-1] and size + item.nbytes > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += item.nbytes
    return [run for run in runs if run]
