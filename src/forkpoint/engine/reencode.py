"""Encoding after the commit: a save under an encoding policy (lossless, zstd) on a store where
raw saves measure faster stores those chunks raw, and these tasks then rewrite each object in
place with the policy's codec, so the save costs no more than a raw one.

An object's name is the hash of its decoded bytes and its header names its codec, so the raw
file and the encoded one are the same object to every reader; the encoded bytes are durable
before they atomically replace the raw ones, and a crash at any instant leaves one or the other.
"""

import contextlib
from dataclasses import dataclass

from ..errors import CorruptObjectError
from ..codecs.registry import Codec
from ..format.objects import OBJECT_HEADER_SIZE, content_hash, pack_header, unpack_header
from ..codecs.registry import MIN_GAIN
from ..storage.base import Store



@dataclass
class LaterEncode:
    """An object a save stored raw for its policy to encode afterwards: its storage key, the
    policy's codec for it, the element size the codec splits by, its decoded bytes and the
    elements of one of its rows (see Codec.pieces; 0 for none)."""

    key: str
    codec: Codec
    itemsize: int = 1
    nbytes: int = 0
    row: int = 0


def encode_in_place(store: Store, item: LaterEncode) -> int:
    """Rewrite the raw object `item.key` of `store` encoded with `item.codec` when that codes
    it at least 5% smaller; return the bytes saved (0 when it is gone, no longer raw, or did not
    code smaller). The raw bytes are verified against the object's name first: a damaged object
    raises CorruptObjectError and stays as it is. All of it runs in the calling thread."""
    try:
        raw = _raw_object(store, item.key)
    except FileNotFoundError:
        return 0
    if raw is None:
        return 0
    view, data = raw
    parts = _encoded_parts(item, view, data)
    if parts is None:
        return 0
    store.write(item.key, parts)
    return view.nbytes - sum(memoryview(p).nbytes for p in parts)


def copy_encoded(sources: list[Store], dst: Store, item: LaterEncode, encoding=None) -> tuple[int, bool] | None:
    """Copy object `item.key` to `dst` from the first source holding it, encoded with
    `item.codec` when it codes at least 5% smaller; return (bytes written, 0 when `dst` has it
    already; whether they were encoded), or None when the first source holding it has it
    encoded already (the caller copies it as it is). The raw bytes are checked against the
    object's name before they are encoded, so a damaged copy is never given a valid header;
    `encoding()` is held around the encoding (the scheduler's encoder budget)."""
    if dst.exists(item.key):
        dst.touch(item.key)
        return 0, False
    damaged = None
    for src in sources:
        try:
            raw = _raw_object(src, item.key)
        except FileNotFoundError:
            continue
        except CorruptObjectError as e:
            damaged = e
            continue
        if raw is None:
            return None
        view, data = raw
        parts = _encoded_parts(item, view, data, encoding)
        dst.write(item.key, parts or [view])
        return sum(memoryview(p).nbytes for p in parts or [view]), parts is not None
    if damaged is not None:
        raise damaged
    raise FileNotFoundError(f"{item.key} is in no tier")


def _raw_object(store: Store, key: str) -> tuple[memoryview, memoryview] | None:
    """(the whole object, its decoded bytes) of raw object `key` of `store`, checked against
    its name; None when it is stored encoded. FileNotFoundError when absent, CorruptObjectError
    when damaged."""
    where = f"{store.url}/{key}"
    blob = store.map(key, 0, None)
    if blob is None:
        blob = store.read(key)
    view = memoryview(blob).cast("B")
    codec_id, length, header_size = unpack_header(bytes(view[:OBJECT_HEADER_SIZE]), where)
    if codec_id != 0:
        return None
    data = view[header_size:header_size + length]
    if data.nbytes != length or content_hash(data) != key.rsplit("/", 1)[-1]:
        raise CorruptObjectError(f"{where} does not match its hash: corrupted")
    return view, data


def _encoded_parts(item: LaterEncode, view: memoryview, data: memoryview, encoding=None) -> list | None:
    """The header and payload of `data` encoded with `item.codec` (holding `encoding()` while
    it encodes), or None where they are not 5% smaller than the raw object `view`."""
    with encoding() if encoding is not None else contextlib.nullcontext():
        payload = item.codec.pieces(data, item.itemsize, row=item.row)
    if OBJECT_HEADER_SIZE + sum(memoryview(p).nbytes for p in payload) >= MIN_GAIN * view.nbytes:
        return None
    return [pack_header(item.codec.id, data.nbytes), *payload]
