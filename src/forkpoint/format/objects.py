"""Object files: a header, then the codec's payload.

Header (little-endian): magic b"FPO1", codec id (u8), one zero byte, header size (u16: the
payload's offset, 16 or a multiple of 4096 so that large payloads can use direct I/O; the
bytes between 16 and it are zero), decoded length (u64). An object is named by the blake3
hex digest of its decoded bytes.
"""

import struct

import blake3

from ..errors import CorruptObjectError, FormatError

OBJECT_MAGIC = b"FPO1"
OBJECT_HEADER_SIZE = 16
ALIGNED_HEADER_SIZE = 4096
_HEADER = struct.Struct("<4sBxHQ")
HASH_THREADS_MIN_BYTES = 4 << 20
_HEX = frozenset("0123456789abcdef")


def object_key(digest: str) -> str:
    """Return the storage key of the object named `digest` (64 hex digits, else FormatError)."""
    if not isinstance(digest, str) or len(digest) != 64 or not _HEX.issuperset(digest):
        raise FormatError(f"invalid object name {digest!r} in a manifest: expected 64 hex digits")
    return f"objects/{digest[:2]}/{digest}"


def content_hash(data) -> str:
    """Return the blake3 hex digest of a bytes-like object (multithreaded when large)."""
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if view.nbytes >= HASH_THREADS_MIN_BYTES else 1
    return blake3.blake3(view, max_threads=threads).hexdigest()


def pack_header(codec_id: int, decoded_length: int, header_size: int = OBJECT_HEADER_SIZE) -> bytes:
    """Return the `header_size` bytes that precede an object's payload."""
    head = _HEADER.pack(OBJECT_MAGIC, codec_id, header_size, decoded_length)
    return head + bytes(header_size - OBJECT_HEADER_SIZE)


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
