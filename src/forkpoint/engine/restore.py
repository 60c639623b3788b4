"""Restore pipeline: read chunks into target buffers, verifying every byte against its hash.

A target is a whole leaf or a box of it (a shard). A raw standalone chunk that lands whole
and contiguously in the target is read straight into the target's memory; a chunk that
overlaps the target only in part is read as the 1 MiB blocks covering the rows it needs,
each checked against the object's block table; packed or encoded objects are read whole
once, decoded, verified and sliced. Objects of a trusted store (this process's memory tier,
which only admits verified bytes) are copied without re-hashing unless the caller asks.
"""

import collections
import contextlib
import os
from dataclasses import dataclass
from typing import Callable

import blake3
import numpy as np

from ..errors import CorruptObjectError, FormatError, MissingObjectError
from ..codecs.registry import codec_by_id
from ..codecs.delta import OPS, apply_delta
from ..format.manifest import Chunk, Leaf
from ..format.objects import (ALIGNED_HEADER_SIZE, BLOCK_BYTES, DIGEST_BYTES, OBJECT_HEADER_SIZE,
                              block_table, content_hash, decode_limit, decode_object, unpack_header)
from ..storage.base import Store
from .parallel import parallel_map
from ..format.objects import object_key
from .objectwriter import stored_codec


MEMORY_COPY_TASKS = max(2, min(8, os.cpu_count() or 2))


@dataclass
class ReadRequest:
    """Fill `target` (a uint8 array) with the bytes of `leaf` inside `box` ((offsets, lengths)
    in the leaf's global shape; None for the whole leaf)."""

    leaf: Leaf
    target: np.ndarray
    box: tuple | None = None


@dataclass
class Region:
    """Where a chunk meets a target: the rows of the chunk it needs and the two strided views."""

    rows: tuple[int, int]
    source_index: tuple
    target_view: np.ndarray
    whole_flat: np.ndarray | None


def _itemsize(leaf: Leaf) -> int:
    count = int(np.prod(leaf.shape)) if leaf.shape else 1
    return leaf.nbytes // count if count else 0


def _region(req: ReadRequest, chunk: Chunk) -> Region | None:
    """The part of `chunk` inside the request's box, or None when they do not meet."""
    leaf = req.leaf
    if not leaf.shape:
        return Region((0, 1), (), req.target, req.target)
    offsets, lengths = req.box if req.box is not None else ([0] * len(leaf.shape), leaf.shape)
    lo = [max(c, t) for c, t in zip(chunk.offsets, offsets)]
    hi = [min(c + n, t + m) for c, n, t, m in zip(chunk.offsets, chunk.lengths, offsets, lengths)]
    if any(a >= b for a, b in zip(lo, hi)):
        return None
    item = _itemsize(leaf)
    full = req.target.reshape(*lengths, item)
    target_view = full[tuple(slice(a - t, b - t) for a, b, t in zip(lo, hi, offsets))]
    source_index = tuple(slice(a - c, b - c) for a, b, c in zip(lo[1:], hi[1:], chunk.offsets[1:]))
    whole = lo == list(chunk.offsets) and hi == [c + n for c, n in zip(chunk.offsets, chunk.lengths)]
    contiguous = whole and list(chunk.lengths[1:]) == list(lengths[1:])
    flat = None
    if contiguous:
        row = int(np.prod(lengths[1:], dtype=np.int64)) * item
        start = (lo[0] - offsets[0]) * row
        flat = req.target[start:start + chunk.lengths[0] * row]
    return Region((lo[0] - chunk.offsets[0], hi[0] - chunk.offsets[0]), source_index, target_view, flat)


class _Reader:
    def __init__(self, store: Store, version_id: str, trust: bool = True):
        self.store, self.version_id = store, version_id
        self.rehash = not (trust and store.trusted)

    def where(self, leaf: Leaf, key: str) -> str:
        return f"version {self.version_id}, leaf {leaf.path!r}, object {self.store.url}/{key}"

    def read_stored(self, key: str, leaf: Leaf) -> bytes:
        """The stored bytes of object `key` (header included); MissingObjectError naming it."""
        try:
            return self.store.read(key)
        except FileNotFoundError:
            raise MissingObjectError(f"{self.where(leaf, key)} is missing") from None

    def read_object(self, digest: str, leaf: Leaf, limit: int) -> bytes:
        """Read, decode and verify a whole object of at most `limit` decoded bytes."""
        key = object_key(digest)
        return decode_object(self.read_stored(key, leaf), digest, self.where(leaf, key), verify=self.rehash,
                             limit=limit, pmap=parallel_map)

    def read_direct(self, leaf: Leaf, chunk: Chunk, dest: np.ndarray) -> None:
        """Read a raw standalone chunk straight into `dest` and verify it (unless it comes from
        a trusted store)."""
        key = object_key(chunk.object)
        header = bytearray(OBJECT_HEADER_SIZE)
        try:
            got = self.store.read_into(key, 0, memoryview(header))
            codec_id, length, header_size = unpack_header(bytes(header[:got]), self.where(leaf, key))
            if codec_id != 0:
                return self.decode_into(leaf, chunk, dest)
            got = self.store.read_into(key, header_size, memoryview(dest))
        except FileNotFoundError:
            raise MissingObjectError(f"{self.where(leaf, key)} is missing") from None
        if length != chunk.size or got != chunk.size:
            if length == chunk.size and self.reencoded(key, leaf):
                return self.decode_into(leaf, chunk, dest)
            raise CorruptObjectError(f"{self.where(leaf, key)} is truncated or of the wrong size")
        if self.rehash and content_hash(dest, parallel_map) != chunk.hash:
            raise CorruptObjectError(f"{self.where(leaf, key)} does not match its hash: corrupted")

    def reencoded(self, key: str, leaf: Leaf) -> bool:
        """True when raw object `key` is now stored encoded: rewritten in place (engine.reencode)
        between the read of its header and the read of its bytes, which then came out wrong."""
        try:
            return stored_codec(self.store, key) != "raw"
        except FileNotFoundError:
            raise MissingObjectError(f"{self.where(leaf, key)} is missing") from None

    def decode_into(self, leaf: Leaf, chunk: Chunk, dest: np.ndarray) -> None:
        """Decode a standalone chunk straight into `dest` (its codec permitting, else through
        a decoded copy) and verify it (unless it comes from a trusted store)."""
        key = object_key(chunk.object)
        blob = memoryview(self.read_stored(key, leaf))
        codec_id, length, header_size = unpack_header(bytes(blob[:OBJECT_HEADER_SIZE]), self.where(leaf, key))
        codec = codec_by_id(codec_id, self.where(leaf, key))
        if length != chunk.size or dest.nbytes != length:
            raise CorruptObjectError(f"{self.where(leaf, key)} holds {length} bytes, the chunk needs {chunk.size}")
        if codec.decode_into is None:
            dest[...] = self.chunk_bytes(leaf, chunk, decode_object(blob, chunk.object, self.where(leaf, key),
                                                                    verify=self.rehash, pmap=parallel_map))
            return
        try:
            codec.decode_into(blob[header_size:], length, dest, pmap=parallel_map)
        except FormatError as e:
            raise FormatError(f"{self.where(leaf, key)}: {e}") from None
        except Exception as e:  # any decoder failure means the stored bytes are damaged
            raise CorruptObjectError(f"{self.where(leaf, key)} cannot be decoded as {codec.name} ({e}): corrupted") from None
        if self.rehash and content_hash(dest, parallel_map) != chunk.hash:
            raise CorruptObjectError(f"{self.where(leaf, key)} does not match its hash: corrupted")

    def chunk_bytes(self, leaf: Leaf, chunk: Chunk, data=None) -> np.ndarray:
        """The verified decoded bytes of a chunk, out of its (possibly packed, encoded or delta)
        object; `data` is that object's decoded bytes when the caller has read them (a whole
        verified object is not hashed again)."""
        data = self.read_object(chunk.object, leaf, decode_limit(chunk)) if data is None else data
        piece = np.frombuffer(data, dtype=np.uint8, count=chunk.size, offset=chunk.start)
        if chunk.delta is not None:
            piece = self.undelta(leaf, chunk, piece)
        elif chunk.standalone and len(data) == chunk.size:
            return piece
        if self.rehash and content_hash(piece, parallel_map) != chunk.hash:
            raise CorruptObjectError(
                f"{self.where(leaf, object_key(chunk.object))}: chunk {chunk.hash} does not match its hash")
        return piece

    def undelta(self, leaf: Leaf, chunk: Chunk, last: np.ndarray) -> np.ndarray:
        """The value of a delta chunk: its chain's base combined with each delta, then `last`."""
        op, chain = chunk.delta.get("op"), chunk.delta.get("chain") or []
        if op not in OPS or not chain:
            raise CorruptObjectError(f"{self.where(leaf, object_key(chunk.object))}: invalid delta record {chunk.delta}")
        item = _itemsize(leaf)
        acc = None
        for digest in chain:
            part = np.frombuffer(self.read_object(digest, leaf, chunk.size), dtype=np.uint8)
            if part.nbytes != chunk.size:
                raise CorruptObjectError(
                    f"{self.where(leaf, object_key(digest))} holds {part.nbytes} bytes, its delta chain needs {chunk.size}")
            if acc is None:
                acc = part.copy()
            else:
                apply_delta(op, acc, part, item)
        apply_delta(op, acc, last, item)
        return acc

    def read_rows(self, leaf: Leaf, chunk: Chunk, lo: int, hi: int) -> np.ndarray:
        """Bytes [lo, hi) of a chunk, reading only the blocks that cover them when the object
        is raw and carries a block table; every block read is verified."""
        key = object_key(chunk.object)
        if not chunk.standalone or chunk.codec != "raw":
            return self.chunk_bytes(leaf, chunk)[lo:hi]
        header = np.empty(ALIGNED_HEADER_SIZE, dtype=np.uint8)
        try:
            got = self.store.read_into(key, 0, memoryview(header))
            codec_id, length, header_size = unpack_header(header[:got].tobytes(), self.where(leaf, key))
            if header_size > got:
                header = np.empty(header_size, dtype=np.uint8)
                got = self.store.read_into(key, 0, memoryview(header))
            table = block_table(header[:got].tobytes(), length, chunk.hash) if codec_id == 0 else None
            if table is None or length != chunk.size:
                return self.chunk_bytes(leaf, chunk)[lo:hi]
            first, last = lo // BLOCK_BYTES, -(-hi // BLOCK_BYTES)
            start, end = first * BLOCK_BYTES, min(last * BLOCK_BYTES, length)
            buf = np.empty(end - start, dtype=np.uint8)
            got = self.store.read_into(key, header_size + start, memoryview(buf))
        except FileNotFoundError:
            raise MissingObjectError(f"{self.where(leaf, key)} is missing") from None
        if got != buf.nbytes:
            if self.reencoded(key, leaf):
                return self.chunk_bytes(leaf, chunk)[lo:hi]
            raise CorruptObjectError(f"{self.where(leaf, key)} is truncated")
        for b in range(first, last):
            block = buf[(b - first) * BLOCK_BYTES:(b - first + 1) * BLOCK_BYTES]
            if blake3.blake3(memoryview(block)).digest() != table[b * DIGEST_BYTES:(b + 1) * DIGEST_BYTES]:
                if self.reencoded(key, leaf):
                    return self.chunk_bytes(leaf, chunk)[lo:hi]
                raise CorruptObjectError(
                    f"{self.where(leaf, key)}: block {b} does not match its hash: corrupted")
        return buf[lo - start:hi - start]

    def fill_region(self, leaf: Leaf, chunk: Chunk, region: Region, data=None) -> None:
        """Copy the part of `chunk` that `region` needs into the target."""
        item = _itemsize(leaf)
        if not leaf.shape:
            region.target_view[...] = self.chunk_bytes(leaf, chunk, data).reshape(region.target_view.shape)
            return
        row = int(np.prod(chunk.lengths[1:], dtype=np.int64)) * item
        r0, r1 = region.rows
        if data is None:
            rows = self.read_rows(leaf, chunk, r0 * row, r1 * row)
        else:
            rows = self.chunk_bytes(leaf, chunk, data)[r0 * row:r1 * row]
        source = rows.reshape(r1 - r0, *chunk.lengths[1:], item)[(slice(None),) + region.source_index]
        region.target_view[...] = source


def read_leaves(store: Store, requests: list[ReadRequest], version_id: str,
                submit: Callable[[Callable, int], object], trust: bool = True, batch=None) -> None:
    """Fill every request's target; raise MissingObjectError/CorruptObjectError naming the leaf.

    `submit(fn, nbytes)` runs fn as a task and returns something with `.result()`. Bytes from
    a trusted store (this process's memory tier) are not re-hashed unless `trust` is False.
    `batch()`, when given, is a context in which the submissions are made at once.
    """
    reader = _Reader(store, version_id, trust)
    jobs, shared = [], {}
    for req in requests:
        for chunk in req.leaf.chunks:
            region = _region(req, chunk)
            if region is None:
                continue
            standalone = chunk.standalone and chunk.codec == "raw"
            if standalone and region.whole_flat is not None:
                jobs.append((chunk.size, _bind(reader.read_direct, req.leaf, chunk, region.whole_flat)))
            elif chunk.standalone and region.whole_flat is not None:
                jobs.append((chunk.size, _bind(reader.decode_into, req.leaf, chunk, region.whole_flat)))
            elif standalone:
                jobs.append((chunk.size, _bind(reader.fill_region, req.leaf, chunk, region)))
            else:
                shared.setdefault(chunk.object, []).append((req.leaf, chunk, region))

    def fill_from(obj: str, items):
        data = reader.read_object(obj, items[0][0], max(decode_limit(c) for _, c, _ in items))
        for leaf, chunk, region in items:
            reader.fill_region(leaf, chunk, region, data)

    jobs += [(sum(c.size for _, c, _ in items), _bind(fill_from, obj, items)) for obj, items in shared.items()]
    jobs.sort(key=lambda job: -job[0])
    if not reader.rehash and len(jobs) > MEMORY_COPY_TASKS:
        jobs = _pooled(jobs, MEMORY_COPY_TASKS)
    with (batch or contextlib.nullcontext)():
        futures = [submit(fn, size) for size, fn in jobs]
    errors = []
    for fut in futures:
        try:
            fut.result()
        except Exception as e:  # gather all, raise the first after every task finished
            errors.append(e)
    if errors:
        raise errors[0]


def chunk_value(store: Store, leaf: Leaf, chunk: Chunk, version_id: str) -> np.ndarray:
    """The verified bytes of one chunk of `leaf` read from `store`, in this thread."""
    return _Reader(store, version_id).chunk_bytes(leaf, chunk)


def _pooled(jobs: list[tuple[int, Callable]], count: int) -> list[tuple[int, Callable]]:
    """At most `count` jobs that each run the next of `jobs` (in order) until none is left:
    plain memory copies are cheaper to run as a few long tasks than as many short ones, and a
    task whose core runs slower (another process on it, a busier memory channel) runs fewer."""
    queue = collections.deque(fn for _, fn in jobs)

    def run_next() -> None:
        while True:
            try:
                fn = queue.popleft()
            except IndexError:
                return
            fn()

    share = -(-sum(size for size, _ in jobs) // count)
    return [(share, run_next) for _ in range(min(count, len(jobs)))]


def _bind(fn, *args):
    return lambda: fn(*args)


def mapped_leaf(store: Store, leaf: Leaf, version_id: str) -> np.ndarray | None:
    """The bytes of a leaf stored as one raw standalone chunk, memory-mapped from `store`
    (copy-on-write) and verified; None when the leaf or the store does not allow it."""
    if len(leaf.chunks) != 1 or leaf.alias_of is not None:
        return None
    chunk = leaf.chunks[0]
    if not chunk.standalone or chunk.codec != "raw" or chunk.size != leaf.nbytes:
        return None
    reader = _Reader(store, version_id)
    key = object_key(chunk.object)
    header = bytearray(OBJECT_HEADER_SIZE)
    try:
        got = store.read_into(key, 0, memoryview(header))
    except FileNotFoundError:
        raise MissingObjectError(f"{reader.where(leaf, key)} is missing") from None
    codec_id, length, header_size = unpack_header(bytes(header[:got]), reader.where(leaf, key))
    if codec_id != 0 or length != chunk.size:
        return None
    view = store.map(key, header_size, chunk.size)
    if view is None:
        return None
    data = np.frombuffer(view, dtype=np.uint8)
    if content_hash(data, parallel_map) != chunk.hash:
        raise CorruptObjectError(f"{reader.where(leaf, key)} does not match its hash: corrupted")
    return data
