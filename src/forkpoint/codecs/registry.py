"""Codec registry: how an object's payload maps to its decoded bytes.

Each codec has a stable numeric id (written in object headers) and a name (in manifests).
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np
import zstandard

from ..errors import FormatError
from . import floatcodec, zstdframe


@dataclass(frozen=True)
class Codec:
    """A lossless transform of an object's bytes, known by id and name: encode(data, itemsize,
    pmap=None) and decode(payload, decoded length, pmap=None); `estimate(data, itemsize)`, where
    a codec has one, is the coded size of a sample of the data (cheaper than encoding one), and
    `sample(data, itemsize)` those sampled bytes; `decode_into(payload, decoded length, out,
    pmap=None)` decodes into a caller's uint8 array. `pmap` is a parallel `map` a codec may
    spread its parts over (the engine's helper threads); without one it works serially."""

    id: int
    name: str
    encode: Callable[..., bytes | memoryview]
    decode: Callable[[bytes | memoryview, int], bytes | memoryview]
    encode_pieces: Callable[..., list] | None = None
    estimate: Callable[..., int] | None = None
    decode_into: Callable[..., None] | None = None
    sample: Callable[..., np.ndarray] | None = None

    def pieces(self, data, itemsize: int = 1, pmap=None, scratch=None, layouts=None,
               row: int = 0, at: int | None = None) -> list:
        """The encoded payload as a list of buffers to write in order (no final join where
        the codec produces it in parts); `scratch` (uint8, the data's size) is memory a
        codec that works in parts may use for them (the payload may refer to it). `layouts`
        (floatcodec.Layouts) carries what the codec chose for this kind of data from one
        encode to the next (codecs that choose nothing ignore it). `row` is the elements of one
        row of the data (a matrix's columns; 0 for none), which a codec may model. `at`, the
        payload's offset in its file, asks a codec that can to place the parts of `scratch` it
        keeps at block-aligned file offsets (see floatcodec.encode_pieces)."""
        if self.encode_pieces is not None:
            return self.encode_pieces(data, itemsize, pmap, scratch, layouts, row, at)
        return [self.encode(data, itemsize, pmap)]


def _zstd_threads(pmap) -> int:
    """zstd's own worker threads: as many as the cores where the caller works in parallel."""
    return 0 if pmap is None else -1


def _zstd_encode(data: memoryview, itemsize: int = 1, pmap=None) -> bytes:
    return zstandard.ZstdCompressor(level=3, threads=_zstd_threads(pmap)).compress(data)


def _zstd_decode(payload, decoded_length: int, pmap=None) -> bytes:
    return zstdframe.decompress(payload, decoded_length)


def _planes_encode(data: memoryview, itemsize: int = 1, pmap=None) -> bytes:
    """Byte planes: all first bytes of the elements, then all second bytes, ..., each plane
    zstd-compressed together. Payload: itemsize (u8), then one zstd frame."""
    if itemsize <= 1 or len(data) % itemsize or itemsize > 255:
        itemsize = 1
        planes = data
    else:
        planes = np.ascontiguousarray(np.frombuffer(data, np.uint8).reshape(-1, itemsize).T)
    return bytes([itemsize]) + zstandard.ZstdCompressor(level=1, threads=_zstd_threads(pmap)).compress(planes)


def _planes_decode(payload, decoded_length: int, pmap=None) -> bytes:
    view = memoryview(payload)
    itemsize = view[0]
    raw = zstdframe.decompress(view[1:], decoded_length)
    if itemsize <= 1:
        return raw
    return np.frombuffer(raw, np.uint8).reshape(itemsize, -1).T.tobytes()


CODECS = {
    c.id: c
    for c in (
        Codec(0, "raw", lambda b, itemsize=1, pmap=None: b, lambda p, n, pmap=None: p),
        Codec(1, "zstd", _zstd_encode, _zstd_decode),
        Codec(2, "planes+zstd", _planes_encode, _planes_decode),
        Codec(3, "float-planes", floatcodec.encode, floatcodec.decode, floatcodec.encode_pieces,
              floatcodec.estimate, floatcodec.decode_into, floatcodec.sample),
    )
}
POLICIES = ("raw", "zstd", "lossless", "auto")
MIN_GAIN = 0.95
"""An encoded object (or a delta) is kept only when it is smaller than this share of what it
replaces; else the raw bytes (or the plain value) are stored, which read faster."""


def codec_for(policy: str, itemsize: int, floating: bool) -> Codec:
    """The codec a policy picks for one chunk: 'lossless' (and the candidate of 'auto') codes
    floats as byte planes (codecs.floatcodec), other data with zstd."""
    if policy in ("lossless", "auto"):
        return CODECS[3] if floating and itemsize > 1 else CODECS[1]
    return codec_by_name(policy)


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
