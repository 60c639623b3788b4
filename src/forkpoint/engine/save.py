"""Save pipeline: chunk, hash, dedup, encode and write leaves as content-addressed objects.

Large leaves are split along their first dimension into chunks of at most `chunk_bytes`;
small leaves are packed into shared objects. Work runs on a bounded thread pool.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..format.codecs import codec_by_name
from ..format.manifest import Chunk, Leaf
from ..format.objects import OBJECT_HEADER_SIZE, content_hash, pack_header
from ..state.flatten import FlatLeaf
from ..storage.base import Store


@dataclass
class SaveOptions:
    """How leaves are laid out and encoded."""

    chunk_bytes: int = 32 << 20
    small_leaf_bytes: int = 1 << 20
    pack_bytes: int = 16 << 20
    codec: str = "raw"
    workers: int = 4


@dataclass
class KnownChunk:
    """Where bytes with a given hash already live: object, byte range, codec."""

    object: str
    start: int
    size: int
    codec: str


@dataclass
class StoredLeaves:
    """Outcome of storing leaves: the leaf table, bytes newly written and keys to make durable."""

    leaves: list[Leaf]
    stored_bytes: int = 0
    written_keys: list[str] = field(default_factory=list)


_HEX = frozenset("0123456789abcdef")


def object_key(digest: str) -> str:
    """Return the storage key of the object named `digest` (64 hex digits, else FormatError)."""
    if not isinstance(digest, str) or len(digest) != 64 or not _HEX.issuperset(digest):
        from ..errors import FormatError

        raise FormatError(f"invalid object name {digest!r} in a manifest: expected 64 hex digits")
    return f"objects/{digest[:2]}/{digest}"


class _Writer:
    """Writes objects once per save, thread-safely, and tallies what was new."""

    def __init__(self, store: Store, codec: str):
        self.store = store
        self.codec = codec_by_name(codec)
        self.lock = threading.Lock()
        self.claimed: dict[str, str] = {}
        self.stored_bytes = 0
        self.written: list[str] = []

    def put(self, digest: str, data: np.ndarray) -> str:
        """Ensure object `digest` holding `data` exists; return the codec name it is stored with."""
        key = object_key(digest)
        with self.lock:
            if digest in self.claimed:
                return self.claimed[digest]
            self.claimed[digest] = "raw"
        if self.store.exists(key):
            self.store.touch(key)
            with self.lock:
                self.claimed[digest] = codec = _stored_codec(self.store, key)
            return codec
        view = memoryview(data).cast("B")
        codec, payload = self.codec, view
        if codec.id != 0:
            encoded = codec.encode(view)
            if len(encoded) < 0.95 * view.nbytes:
                payload = encoded
            else:
                codec = codec_by_name("raw")
        self.store.write(key, [pack_header(codec.id, view.nbytes), payload])
        with self.lock:
            self.claimed[digest] = codec.name
            self.stored_bytes += OBJECT_HEADER_SIZE + memoryview(payload).nbytes
            self.written.append(key)
        return codec.name


def _stored_codec(store: Store, key: str) -> str:
    from ..format.codecs import codec_by_id
    from ..format.objects import unpack_header

    header = bytearray(OBJECT_HEADER_SIZE)
    store.read_into(key, 0, memoryview(header))
    return codec_by_id(unpack_header(bytes(header), key)[0], key).name


def _row_split(shape: tuple, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Return [(first row, row count)] splitting dim 0 into pieces of at most chunk_bytes."""
    if not shape or shape[0] == 0:
        return [(0, shape[0] if shape else 1)]
    row = nbytes // shape[0]
    per = max(1, chunk_bytes // max(row, 1))
    return [(r, min(per, shape[0] - r)) for r in range(0, shape[0], per)]


def store_leaves(store: Store, flat: list[FlatLeaf], known: dict[str, KnownChunk],
                 opts: SaveOptions, pool: ThreadPoolExecutor) -> StoredLeaves:
    """Write every leaf's bytes (deduplicated) and return the leaf table for the manifest."""
    writer = _Writer(store, opts.codec)
    leaves: list[Leaf] = []
    large: list[tuple[Leaf, int, Future]] = []
    packer = _Packer(writer, opts.pack_bytes, known, pool)
    for fl in flat:
        if fl.data is None:
            src = leaves[fl.alias_of]
            leaves.append(Leaf(fl.path, src.kind, src.dtype, list(src.shape), src.nbytes, [],
                               src.device, alias_of=fl.alias_of))
            continue
        d = fl.data
        nbytes = int(d.data.nbytes)
        leaf = Leaf(fl.path, d.kind, d.dtype, list(d.shape), nbytes, [], d.device)
        leaves.append(leaf)
        if nbytes < opts.small_leaf_bytes:
            packer.add(leaf, d.data)
            continue
        row = nbytes // d.shape[0]
        for first, count in _row_split(d.shape, nbytes, opts.chunk_bytes):
            piece = d.data[first * row:(first + count) * row]
            offsets = [first] + [0] * (len(d.shape) - 1)
            lengths = [count] + list(d.shape[1:])
            large.append((leaf, len(leaf.chunks), pool.submit(_store_chunk, writer, piece, offsets, lengths)))
            leaf.chunks.append(None)
    packer.flush()
    for leaf, index, fut in large:
        leaf.chunks[index] = fut.result()
    packer.wait()
    return StoredLeaves(leaves, writer.stored_bytes, writer.written)


def _store_chunk(writer: _Writer, piece: np.ndarray, offsets, lengths) -> Chunk:
    digest = content_hash(piece)
    codec = writer.put(digest, piece)
    return Chunk(offsets, lengths, digest, digest, 0, int(piece.nbytes), codec)


class _Packer:
    """Packs small leaves into shared objects, deduplicating against known chunks."""

    def __init__(self, writer: _Writer, pack_bytes: int, known: dict[str, KnownChunk], pool):
        self.writer, self.pack_bytes, self.known, self.pool = writer, pack_bytes, known, pool
        self.parts: list[np.ndarray] = []
        self.pending: list[tuple[Leaf, str, int, int]] = []
        self.in_pack: dict[str, tuple[int, int]] = {}
        self.size = 0
        self.futures: list[tuple[list, Future]] = []

    def add(self, leaf: Leaf, data: np.ndarray) -> None:
        digest = content_hash(data)
        box = ([0] * len(leaf.shape), list(leaf.shape))
        hit = self.known.get(digest)
        if hit is not None:
            leaf.chunks.append(Chunk(*box, digest, hit.object, hit.start, hit.size, hit.codec))
            return
        if digest not in self.in_pack:
            self.in_pack[digest] = (self.size, int(data.nbytes))
            self.parts.append(data)
            self.size += int(data.nbytes)
        start, size = self.in_pack[digest]
        leaf.chunks.append(Chunk(*box, digest, "", start, size, "raw"))
        self.pending.append((leaf, digest, start, size))
        if self.size >= self.pack_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        blob = np.concatenate(self.parts) if self.parts else np.empty(0, np.uint8)
        pending, self.pending, self.parts, self.in_pack, self.size = self.pending, [], [], {}, 0
        self.futures.append((pending, self.pool.submit(self._write_pack, blob)))

    def _write_pack(self, blob: np.ndarray) -> tuple[str, str]:
        digest = content_hash(blob)
        return digest, self.writer.put(digest, blob)

    def wait(self) -> None:
        for pending, fut in self.futures:
            digest, codec = fut.result()
            for leaf, chunk_hash, start, size in pending:
                for c in leaf.chunks:
                    if c.hash == chunk_hash and c.object == "":
                        c.object, c.codec = digest, codec
                self.known[chunk_hash] = KnownChunk(digest, start, size, codec)
