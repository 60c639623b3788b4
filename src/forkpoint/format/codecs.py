"""Codec registry: how an object's payload maps to its decoded bytes.

Each codec has a stable numeric id (written in object headers) and a name (in manifests).
"""

from dataclasses import dataclass
from typing import Callable

import zstandard

from ..errors import FormatError


@dataclass(frozen=True)
class Codec:
    """A lossless transform of an object's bytes, known by id and name."""

    id: int
    name: str
    encode: Callable[[memoryview], bytes | memoryview]
    decode: Callable[[bytes | memoryview, int], bytes | memoryview]


def _zstd_encode(data: memoryview) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


def _zstd_decode(payload, decoded_length: int) -> bytes:
    return zstandard.ZstdDecompressor().decompress(payload, max_output_size=decoded_length)


CODECS = {
    c.id: c
    for c in (
        Codec(0, "raw", lambda b: b, lambda p, n: p),
        Codec(1, "zstd", _zstd_encode, _zstd_decode),
    )
}


def codec_by_id(codec_id: int, where: str = "") -> Codec:
    """Return the codec with this id or raise FormatError naming `where`."""
    try:
        return CODECS[codec_id]
    except KeyError:
        raise FormatError(
            f"object {where} uses codec id {codec_id}, unknown to this forkpoint; upgrade it"
        ) from None


def codec_by_name(name: str) -> Codec:
    """Return the codec with this name or raise FormatError."""
    for codec in CODECS.values():
        if codec.name == name:
            return codec
    raise FormatError(f"unknown codec {name!r}; known: {sorted(c.name for c in CODECS.values())}")
