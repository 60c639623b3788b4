"""Restore pipeline: read chunks into target buffers, verifying every byte against its hash.

Raw standalone chunks are read straight into the target's memory with one positioned read;
packed or encoded objects are read whole once, decoded and sliced.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import CorruptObjectError, MissingObjectError
from ..format.codecs import codec_by_id
from ..format.manifest import Chunk, Leaf
from ..format.objects import OBJECT_HEADER_SIZE, content_hash, unpack_header
from ..storage.base import Store
from .save import object_key


@dataclass
class ReadRequest:
    """Fill `target` (a uint8 array of leaf.nbytes) with the bytes of `leaf`."""

    leaf: Leaf
    target: np.ndarray


def _box_view(target: np.ndarray, leaf: Leaf, chunk: Chunk):
    """Return (contiguous byte slice or None, strided uint8 view of the chunk's box)."""
    shape = leaf.shape
    if not shape:
        return target, target
    count = int(np.prod(shape))
    item = leaf.nbytes // count if count else 0
    if list(chunk.lengths[1:]) == list(shape[1:]):
        row = leaf.nbytes // shape[0] if shape[0] else 0
        lo = chunk.offsets[0] * row
        return target[lo:lo + chunk.lengths[0] * row], None
    full = target.reshape(*shape, item)
    index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.lengths))
    return None, full[index]


class _Reader:
    def __init__(self, store: Store, version_id: str):
        self.store, self.version_id = store, version_id

    def where(self, leaf: Leaf, key: str) -> str:
        return f"version {self.version_id}, leaf {leaf.path!r}, object {self.store.url}/{key}"

    def read_object(self, digest: str, leaf: Leaf) -> bytes:
        """Read, decode and verify a whole object."""
        key = object_key(digest)
        try:
            blob = self.store.read(key)
        except FileNotFoundError:
            raise MissingObjectError(f"{self.where(leaf, key)} is missing") from None
        codec_id, length, header_size = unpack_header(blob[:OBJECT_HEADER_SIZE], self.where(leaf, key))
        data = codec_by_id(codec_id, self.where(leaf, key)).decode(
            memoryview(blob)[header_size:], length)
        if len(data) != length or content_hash(data) != digest:
            raise CorruptObjectError(f"{self.where(leaf, key)} does not match its hash: corrupted")
        return data

    def read_direct(self, leaf: Leaf, chunk: Chunk, dest: np.ndarray) -> None:
        """Read a raw standalone chunk straight into `dest` and verify it."""
        key = object_key(chunk.object)
        header = bytearray(OBJECT_HEADER_SIZE)
        try:
            got = self.store.read_into(key, 0, memoryview(header))
            codec_id, length, header_size = unpack_header(bytes(header[:got]), self.where(leaf, key))
            if codec_id != 0:
                return self.copy_from_object(leaf, chunk, dest)
            got = self.store.read_into(key, header_size, memoryview(dest))
        except FileNotFoundError:
            raise MissingObjectError(f"{self.where(leaf, key)} is missing") from None
        if length != chunk.size or got != chunk.size:
            raise CorruptObjectError(f"{self.where(leaf, key)} is truncated or of the wrong size")
        if content_hash(dest) != chunk.hash:
            raise CorruptObjectError(f"{self.where(leaf, key)} does not match its hash: corrupted")

    def copy_from_object(self, leaf: Leaf, chunk: Chunk, dest, data=None) -> None:
        """Copy a chunk out of a whole (possibly packed or encoded) object into `dest`."""
        data = self.read_object(chunk.object, leaf) if data is None else data
        piece = np.frombuffer(data, dtype=np.uint8, count=chunk.size, offset=chunk.start)
        if content_hash(piece) != chunk.hash:
            raise CorruptObjectError(
                f"{self.where(leaf, object_key(chunk.object))}: chunk {chunk.hash} does not match its hash")
        dest[...] = piece.reshape(dest.shape)


def read_leaves(store: Store, requests: list[ReadRequest], version_id: str,
                submit: Callable[[Callable, int], object]) -> None:
    """Fill every request's target; raise MissingObjectError/CorruptObjectError naming the leaf.

    `submit(fn, nbytes)` runs fn as a task and returns something with `.result()`.
    """
    reader = _Reader(store, version_id)
    direct, shared = [], {}
    for req in requests:
        for chunk in req.leaf.chunks:
            flat, box = _box_view(req.target, req.leaf, chunk)
            standalone = chunk.object == chunk.hash and chunk.start == 0 and chunk.codec == "raw"
            if standalone and flat is not None:
                direct.append(submit(_bind(reader.read_direct, req.leaf, chunk, flat), chunk.size))
            else:
                dest = flat if flat is not None else box
                shared.setdefault(chunk.object, []).append((req.leaf, chunk, dest))

    def fill_from(obj: str, items):
        data = reader.read_object(obj, items[0][0])
        for leaf, chunk, dest in items:
            reader.copy_from_object(leaf, chunk, dest, data)

    futures = direct + [submit(_bind(fill_from, obj, items), sum(c.size for _, c, _ in items))
                        for obj, items in shared.items()]
    errors = []
    for fut in futures:
        try:
            fut.result()
        except Exception as e:  # gather all, raise the first after every task finished
            errors.append(e)
    if errors:
        raise errors[0]


def _bind(fn, *args):
    return lambda: fn(*args)
