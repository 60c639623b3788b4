"""Object files: a 16-byte header, then the codec's payload.

Header: magic b"FPO1", codec id (u8), three zero bytes, decoded length (u64 little-endian).
An object is named by the blake3 hex digest of its decoded bytes.
"""

import struct

import blake3

from ..errors import CorruptObjectError

OBJECT_MAGIC = b"FPO1"
OBJECT_HEADER_SIZE = 16
_HEADER = struct.Struct("<4sB3xQ")
HASH_THREADS_MIN_BYTES = 4 << 20


def content_hash(data) -> str:
    """Return the blake3 hex digest of a bytes-like object (multithreaded when large)."""
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if view.nbytes >= HASH_THREADS_MIN_BYTES else 1
    return blake3.blake3(view, max_threads=threads).hexdigest()


def pack_header(codec_id: int, decoded_length: int) -> bytes:
    """Return the header that precedes an object's payload."""
    return _HEADER.pack(OBJECT_MAGIC, codec_id, decoded_length)


def unpack_header(header: bytes, where: str) -> tuple[int, int]:
    """Return (codec id, decoded length) or raise CorruptObjectError naming `where`."""
    if len(header) < OBJECT_HEADER_SIZE:
        raise CorruptObjectError(f"object {where} is truncated: {len(header)} header bytes")
    magic, codec_id, length = _HEADER.unpack_from(header)
    if magic != OBJECT_MAGIC:
        raise CorruptObjectError(f"object {where} has no forkpoint object header (magic {magic!r})")
    return codec_id, length
