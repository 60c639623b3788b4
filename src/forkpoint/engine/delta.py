"""Delta planning for one save: which chunks are stored against the parent version's chunk,
and the chunk values kept in memory for the next save to diff against.

A chunk is stored as a delta only when the parent has a chunk with the same path, box and
dtype, the chain stays within `Delta.max_chain`, and a sample of the delta encodes smaller
than the same sample of the value. An unchanged chunk reuses the parent's chunk record.
The delta's estimate is made on every save (how far a value moved from its parent's varies
from save to save), from the delta of the value's and the base's samples: the whole delta is
made only for a chunk stored as one. The value's estimate is kept per chunk (ValueEstimate)
for its next REUSE_LIMIT saves (how well a value codes drifts slowly).
"""

import threading
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..codecs.registry import MIN_GAIN
from ..codecs.delta import Delta, make_delta, op_for
from ..format.manifest import Chunk, Leaf, Manifest
from .encoding import policy_codec
from .objectwriter import ObjectWriter, hash_with_table

SAMPLE_PIECES = 4
SAMPLE_PIECE_BYTES = 64 << 10
REUSE_LIMIT = 7

ChunkKey = tuple[str, tuple, tuple]


def parent_chunks(m: Manifest | None) -> dict[ChunkKey, tuple[Leaf, Chunk]]:
    """The whole-object chunks of a version (a delta's possible bases) by (path, offsets, lengths)."""
    if m is None:
        return {}
    return {(leaf.path, tuple(c.offsets), tuple(c.lengths)): (leaf, c)
            for leaf in m.leaves if leaf.kind in ("torch", "numpy") and leaf.alias_of is None
            for c in leaf.chunks if c.start == 0 and (c.delta is not None or c.object == c.hash)}


@dataclass
class ValueEstimate:
    """The coded bytes of a sample of a chunk's value (`coded`, None before the first) as the
    save that estimated it found them, and how many saves have reused the figure since."""

    coded: int | None = None
    uses: int = 0

    def get(self, estimate: Callable[[], int]) -> int:
        """The kept figure while it is at most REUSE_LIMIT saves old, else `estimate()` kept anew."""
        if self.coded is None or self.uses >= REUSE_LIMIT:
            self.coded, self.uses = estimate(), 0
        else:
            self.uses += 1
        return self.coded


class DeltaPlan:
    """Chooses delta or full storage for the chunks of one save and collects the values the
    next save will diff against (`next_values`, bounded by `Delta.cache_bytes`).

    A plan that `recycles` (no other save reads the same `cache`) copies each new value into
    the cached value of its chunk's parent once that base is used, taking it out of `cache`,
    instead of into fresh memory: the cache then never holds two versions. `share()` stops it
    before another plan is given the same cache. `estimates` (an engine.chunkmemory.ChunkMemory
    of ValueEstimate, kept by the caller from save to save) lets a chunk's save reuse an
    earlier save's estimate of how well its value codes."""

    sample_first = True
    """Estimate a chunk's delta from the delta of the value's and base's samples, and make the
    whole delta only where it is chosen (False: make it first; the same choice, for A/B runs)."""

    def __init__(self, options: Delta, parents: dict[ChunkKey, tuple[Leaf, Chunk]],
                 cache: dict[str, np.ndarray], read_base: Callable[[Leaf, Chunk], np.ndarray],
                 recycles: bool = False, estimates=None):
        self.options = options
        self.estimates = estimates
        self.parents = parents
        self.cache = cache
        self.read_base = read_base
        self.next_values: dict[str, np.ndarray] = {}
        self.next_bytes = 0
        self.lock = threading.Lock()
        self.delta_chunks = 0
        uses = Counter(c.hash for _, c in parents.values())
        self.recyclable = {h for h, count in uses.items() if count == 1} if recycles else set()

    def share(self) -> None:
        """From now on, take nothing out of the cache (another plan is about to read it)."""
        with self.lock:
            self.recyclable = set()

    def pinned(self) -> set[str]:
        """Objects of the parent's chunks (a delta or a reused record may refer to them)."""
        return {o for _, c in self.parents.values() for o in c.objects}

    def store(self, writer: ObjectWriter, path: str, dtype: str, box, digest: str, value: np.ndarray,
              itemsize: int, floating: bool, policy, lossy: dict | None, buffers=None) -> Chunk | None:
        """The chunk record for `value` (hash `digest`) when it reuses or deltas against the
        parent's chunk, writing the delta object; None when it should be stored in full.
        `buffers`, when given, are (delta, scratch): uint8 arrays of the value's size that the
        delta and the encoder's work may use instead of fresh memory."""
        found = self.parents.get((path, tuple(box[0]), tuple(box[1])))
        if found is None or found[0].dtype != dtype or found[1].size != value.nbytes:
            self._remember(digest, value)
            return None
        pleaf, pchunk = found
        if pchunk.hash == digest:
            self._carry(digest)
            return replace(pchunk, offsets=list(box[0]), lengths=list(box[1]), lossy=lossy)
        try:
            return self._delta_chunk(writer, pleaf, pchunk, dtype, box, digest, value, itemsize,
                                     floating, policy, lossy, buffers)
        finally:
            self._remember(digest, value, pchunk.hash)

    def _delta_chunk(self, writer, pleaf, pchunk, dtype, box, digest, value, itemsize, floating,
                     policy, lossy, buffers) -> Chunk | None:
        op = op_for(dtype)
        chain = [*pchunk.delta["chain"], pchunk.object] if pchunk.delta else [pchunk.object]
        if len(chain) >= self.options.max_chain or (pchunk.delta and pchunk.delta.get("op") != op):
            return None
        codec = policy_codec(policy, itemsize, floating)
        if codec.id == 0:
            return None
        base = self._base(pleaf, pchunk)
        if base is None or base.nbytes != value.nbytes:
            return None
        delta_out, scratch = buffers or (None, None)
        slot = (pleaf.path, tuple(box[0]), tuple(box[1]), dtype)
        kept = self.estimates.get(slot) if self.estimates is not None else ValueEstimate()
        value_coded = kept.get(lambda: _sample_coded(codec, value, itemsize))
        from_samples = self.sample_first and (codec.estimate is None or codec.sample is not None)
        delta = None if from_samples else make_delta(op, value, base, itemsize, delta_out)
        delta_coded = _delta_sample_coded(codec, op, value, base, itemsize) if from_samples else \
            _sample_coded(codec, delta, itemsize)
        if delta_coded >= MIN_GAIN * value_coded:
            return None
        if delta is None:
            delta = make_delta(op, value, base, itemsize, delta_out)
        delta_digest, table = hash_with_table(delta)
        if delta_digest == digest:
            return None
        stored = writer.put(delta_digest, delta, itemsize, floating, policy, table, scratch=scratch,
                            slot=("delta", pleaf.path, tuple(box[0])))
        if stored == "raw":
            return None
        with self.lock:
            self.delta_chunks += 1
        return Chunk(list(box[0]), list(box[1]), digest, delta_digest, 0, value.nbytes, stored, lossy,
                     {"op": op, "chain": chain})

    def _base(self, leaf: Leaf, chunk: Chunk) -> np.ndarray | None:
        cached = self.cache.get(chunk.hash)
        if cached is not None:
            return cached
        try:
            return self.read_base(leaf, chunk)
        except Exception:  # an unreadable base only means this chunk is stored in full
            return None

    def _remember(self, digest: str, value: np.ndarray, parent: str | None = None) -> None:
        """Keep a copy of `value` for the next save: in the parent chunk's cached value when
        this plan recycles it (its base is used by now), else in new memory."""
        with self.lock:
            if digest in self.next_values or self.next_bytes + value.nbytes > self.options.cache_bytes:
                return
            self.next_bytes += value.nbytes
            spare = None
            if parent in self.recyclable and getattr(self.cache.get(parent), "nbytes", -1) == value.nbytes:
                self.recyclable.discard(parent)
                spare = self.cache.pop(parent)
        if spare is None:
            copy = value.copy()
        else:
            copy = spare.reshape(-1).view(np.uint8)
            np.copyto(copy, value.reshape(-1).view(np.uint8))
        with self.lock:
            self.next_values[digest] = copy

    def _carry(self, digest: str) -> None:
        value = self.cache.get(digest)
        if value is None:
            return
        with self.lock:
            if digest not in self.next_values and self.next_bytes + value.nbytes <= self.options.cache_bytes:
                self.next_bytes += value.nbytes
                self.next_values[digest] = value


def _sample(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Up to SAMPLE_PIECES evenly spaced pieces of `data`, element-aligned."""
    if data.nbytes <= SAMPLE_PIECES * SAMPLE_PIECE_BYTES:
        return data
    step = (data.nbytes - SAMPLE_PIECE_BYTES) // (SAMPLE_PIECES - 1)
    step -= step % max(itemsize, 1)
    return np.concatenate([data[i * step:i * step + SAMPLE_PIECE_BYTES] for i in range(SAMPLE_PIECES)])


def _delta_sample_coded(codec, op: str, value: np.ndarray, base: np.ndarray, itemsize: int) -> int:
    """`_sample_coded(codec, make_delta(op, value, base, itemsize), itemsize)`, from the samples
    of `value` and `base` alone (a delta is element-wise, and where a sample lies depends only
    on the size)."""
    pick = codec.sample if codec.estimate is not None else _sample
    delta = make_delta(op, pick(value, itemsize), pick(base, itemsize), itemsize)
    if codec.estimate is not None:
        return codec.estimate(delta, itemsize)
    return len(codec.encode(memoryview(delta), itemsize))


def _sample_coded(codec, data: np.ndarray, itemsize: int) -> int:
    """The coded bytes of a sample of `data` (the same sample positions for data of the same size)."""
    if codec.estimate is not None:
        return codec.estimate(data, itemsize)
    return len(codec.encode(memoryview(_sample(data, itemsize)), itemsize))
