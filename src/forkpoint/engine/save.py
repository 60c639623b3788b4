"""Save pipeline: chunk, capture, hash, dedup, encode and write leaves as scheduler tasks.

Large leaves are split along their first dimension into chunks of at most `chunk_bytes`;
small leaves are packed into shared objects. Staging memory is bounded by the scheduler's
budget: a state larger than it streams through.
"""

import dataclasses
from dataclasses import dataclass, field


from ..codecs.delta import Delta
from ..errors import StateChangedError
from ..format.manifest import Chunk, Leaf
from ..format.objects import (MAX_PACK_BYTES, content_hash)
from ..state.flatten import FlatLeaf
from ..storage.base import Store
from .chunkmemory import ChunkMemory
from .chunksave import ChunkSave, _await_device, check_unchanged
from .encoding import codec_rules, pack_kind, policy_for
from .objectwriter import ObjectWriter, raw_header_size
from .pacing import EncodePacer, PaceMemory
from .parallel import parallel_map
from .scheduler import Priority, Scheduler, Task
from .staging import StagingPool


MIN_CHUNK_BYTES = 4096
"""The smallest chunk_bytes accepted: a page (smaller chunks only multiply objects and records)."""


@dataclass
class SaveOptions:
    """How leaves are laid out, encoded and staged."""

    chunk_bytes: int = 32 << 20
    small_leaf_bytes: int = 1 << 20
    pack_bytes: int = 16 << 20
    codec: object = "raw"
    workers: int = 4
    staging_bytes: int = 4 << 30
    window_bytes: int = 256 << 20
    delta: Delta | None = None
    encode_later: bool = False
    """Under lossless/zstd, where raw saves measure faster on the store (learnt as for
    codec="auto"), store chunks raw and encode them in place after the commit, in the
    background (for hosts whose cores are idle while training runs on accelerators)."""
    max_pending: int = 2
    """Asynchronous saves in flight (scheduled, not committed) at most: a further
    save(sync=False) first waits for the oldest to commit (back-pressure, so that saves asked
    for faster than the store takes them cannot pile up)."""

    def __post_init__(self):
        if self.delta is not None and not isinstance(self.delta, (bool, Delta)):
            raise TypeError(f"delta must be True, False, None or fp.Delta(...), got {self.delta!r}")
        self.delta = Delta() if self.delta is True else self.delta or None
        if not isinstance(self.encode_later, bool):
            raise TypeError(f"encode_later must be True or False, got {self.encode_later!r}")
        for name, least in (("chunk_bytes", MIN_CHUNK_BYTES), ("small_leaf_bytes", 0), ("pack_bytes", 1), ("workers", 1),
                            ("staging_bytes", 1), ("window_bytes", 1), ("max_pending", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SaveOptions.{name} must be an int >= {least}, got {value!r}")
        if self.pack_bytes + self.small_leaf_bytes > MAX_PACK_BYTES:
            raise ValueError(f"SaveOptions.pack_bytes + small_leaf_bytes must be at most {MAX_PACK_BYTES} (readers "
                             f"refuse longer packs), got {self.pack_bytes} + {self.small_leaf_bytes}")


def with_fields(options: SaveOptions | None, fields: dict) -> SaveOptions:
    """`options` (default: SaveOptions()) with the given fields replaced (a None value keeps
    the field as it is); TypeError naming any keyword that is not a field."""
    names = {f.name for f in dataclasses.fields(SaveOptions)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}: a repository takes SaveOptions' fields, "
                        f"{', '.join(sorted(names))}")
    return dataclasses.replace(options or SaveOptions(), **{k: v for k, v in fields.items() if v is not None})


@dataclass
class StoredLeaves:
    """Outcome of storing leaves: the leaf table, bytes newly written and keys to make durable."""

    leaves: list[Leaf]
    stored_bytes: int = 0
    written_keys: list[str] = field(default_factory=list)


def row_split(shape: tuple, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Return [(first row, row count)] splitting dim 0 into pieces of at most chunk_bytes."""
    if not shape or shape[0] == 0:
        return [(0, shape[0] if shape else 1)]
    row = nbytes // shape[0]
    per = max(1, chunk_bytes // max(row, 1))
    return [(r, min(per, shape[0] - r)) for r in range(0, shape[0], per)]


class ScheduledSave:
    """The tasks of one save: captures per leaf, writes, and the assembly of the leaf table."""

    def __init__(self, flat: list[FlatLeaf], writer: ObjectWriter, pacer: EncodePacer, deltas=None):
        self.flat = flat
        self.writer = writer
        self.deltas = deltas
        self.pacer = pacer
        self.captures: dict[int, list[Task]] = {}
        self.writes: list[Task] = []
        self.large: dict[int, list[Task]] = {}
        self.packs: list[Task] = []
        self.commit: Task | None = None

    def capture_tasks(self) -> list[Task]:
        """Every capture task (empty for a save that writes from live memory)."""
        return [t for tasks in self.captures.values() for t in tasks]

    def assemble(self) -> StoredLeaves:
        """Build the leaf table from finished writes (call once every write is done)."""
        self.writer.finish()
        self.pacer.finish()
        leaves: list[Leaf] = []
        small: dict[int, Chunk] = {}
        for task in self.packs:
            digest, codec, members = task.result()
            for index, chunk_hash, box, where in members:
                if isinstance(where, Chunk):
                    small[index] = Chunk(*box, chunk_hash, where.object, where.start, where.size, where.codec)
                else:
                    small[index] = Chunk(*box, chunk_hash, digest, where[0], where[1], codec)
        for i, fl in enumerate(self.flat):
            if fl.data is None:
                src = leaves[fl.alias_of]
                leaves.append(Leaf(fl.path, src.kind, src.dtype, list(src.shape), src.nbytes, [],
                                   src.device, alias_of=fl.alias_of))
                continue
            d = fl.data
            chunks = [t.result() for t in self.large[i]] if i in self.large else (
                [small[i]] if i in small else [])
            leaves.append(Leaf(fl.path, d.kind, d.dtype, list(d.shape), d.nbytes, chunks, d.device))
        return StoredLeaves(leaves, self.writer.stored_bytes, list(self.writer.written))


def schedule_save(sched: Scheduler, store: Store, tier: str, flat: list[FlatLeaf],
                  known: dict[str, Chunk], opts: SaveOptions, pool: StagingPool,
                  staging: str = "staging", guard=None, select=None, deltas=None,
                  pack_key=None, encode_later: bool = False, layouts: ChunkMemory | None = None,
                  pacing: PaceMemory | None = None) -> ScheduledSave:
    """Queue the capture and write tasks of one save.

    Each chunk is copied (captured) into a page-aligned staging buffer, then hashed and
    written from there with direct I/O where the store supports it; the live tensors may
    change once their captures are done. An asynchronous save's capture only copies, so the
    training loop waits for nothing more; a synchronous one hashes each block while in cache,
    and encodes chunks of an encoding policy (lossless, zstd) straight from live memory (the
    encoder's output is the copy). `staging` names the budget resource the buffers count
    against ("staging" for asynchronous saves, "window" for synchronous ones).
    `deltas` (an engine.delta.DeltaPlan) stores chunks against the parent's where smaller.
    `pack_key(leaf index)` keeps leaves with different keys out of one pack. With
    `encode_later` (and no deltas), chunks may be written raw for encoding after the commit
    (the writer's `later`, which the caller must queue). `layouts` (kept by the caller from
    save to save) lets each chunk's encode reuse what the codec chose for it last time, and
    `pacing` (kept likewise) what the last save's pacer found.
    """
    writer = ObjectWriter(store, opts.codec, guard, lambda: sched.hold("encode"),
                          defers=encode_later and deltas is None, layouts=layouts)
    pacer = EncodePacer(sched.limit(f"io:{tier}"), enabled=store.paces_encoding, memory=pacing)
    plan = ScheduledSave(flat, writer, pacer, deltas)
    plan.writer.pinned.update(k.object for k in known.values())
    if deltas is not None:
        plan.writer.pinned.update(deltas.pinned())
    io = {f"io:{tier}": 1}
    for kind, item in layout(flat, opts, select, pack_key):
        if kind == "pack":
            group, total = item
            _schedule_pack(sched, plan, group, total, known, pool, io, tier, staging)
        else:
            i, pieces = item
            plan.large[i] = [ChunkSave(plan, i, piece, box, pool, staging).schedule(sched, io, tier)
                             for piece, box in pieces]
    for i, fl in enumerate(flat):
        if fl.data is not None and fl.data.pending is not None:
            sched.submit("release", fl.data.pending.release, priority=Priority.CAPTURE,
                         after=plan.captures.get(i, ()))
    return plan


def layout(flat: list[FlatLeaf], opts: SaveOptions, select=None, pack_key=None):
    """Yield ("pack", (members, total bytes)) and ("chunks", (leaf index, [(piece, box)])) in
    the order a save stores them; members are (leaf index, bytes, box). Boxes are in the
    leaf's global shape; `select(index, box)` keeps only the pieces this process stores;
    only leaves with equal `pack_key(index)` share a pack, and host leaves never share one
    with accelerator leaves (a pack's capture waits for the device copies of its members,
    and the capture hooks wait on the host for the captures of host leaves); floating-point
    leaves share packs only with leaves of the same element size (see pack_kind)."""
    groups: dict = {}
    keep = select or (lambda i, box: True)
    for i, fl in enumerate(flat):
        if fl.data is None:
            continue
        d = fl.data
        nbytes = int(d.data.nbytes)
        if nbytes == 0:  # an empty leaf (or shard) has no bytes, so no chunk
            continue
        shape, offsets = d.local_shape, d.offsets
        if nbytes < opts.small_leaf_bytes:
            box = [offsets, list(shape)]
            if keep(i, box):
                key = (pack_key(i) if pack_key else None, on_accelerator(d), pack_kind(d))
                group = groups.setdefault(key, [[], 0])
                group[0].append((i, d.data, box))
                group[1] += nbytes
                if group[1] >= opts.pack_bytes:
                    yield "pack", tuple(group)
                    group[:] = [[], 0]
            continue
        row = nbytes // shape[0]
        pieces = []
        for first, count in row_split(shape, nbytes, opts.chunk_bytes):
            box = ([offsets[0] + first] + offsets[1:], [count] + list(shape[1:]))
            if keep(i, box):
                pieces.append((d.data[first * row:(first + count) * row], box))
        if pieces:
            yield "chunks", (i, pieces)
    for members, total in groups.values():
        if members:
            yield "pack", (members, total)


def launch_device_copies(flat: list[FlatLeaf], opts: SaveOptions, select=None, pack_key=None) -> None:
    """Launch the deferred device-to-host copies of `flat`'s leaves (state.device.DeferredCapture),
    each for just the bytes this process stores (see `layout`)."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for kind, item in layout(flat, opts, select, pack_key):
        if kind == "pack":
            for i, data, _ in item[0]:
                ranges.setdefault(i, []).append((0, int(data.nbytes)))
            continue
        i, pieces = item
        base = flat[i].data.data.__array_interface__["data"][0]
        for piece, _ in pieces:
            lo = piece.__array_interface__["data"][0] - base
            ranges.setdefault(i, []).append((lo, lo + int(piece.nbytes)))
    for i, fl in enumerate(flat):
        pending = fl.data.pending if fl.data is not None else None
        if pending is not None and not pending.launched:
            pending.launch(ranges.get(i, []))


def on_accelerator(d) -> bool:
    """True for a leaf whose live tensor is on an accelerator (its bytes come from a device copy)."""
    return d.pending is not None or (d.device or "cpu").split(":")[0] not in ("cpu", "meta")


def staging_sizes(flat: list[FlatLeaf], opts: SaveOptions, select=None, adopts: bool = False,
                  pack_key=None) -> tuple[list[int], list[int]]:
    """(staging buffer sizes, store object buffer sizes) a save of `flat` takes, to warm them
    ahead of time; with `adopts` (the store adopts captured buffers), raw chunks are captured
    into object buffers (header + data) instead of staging."""
    rules = codec_rules(opts.codec)
    staging, objects = [], []
    for kind, item in layout(flat, opts, select, pack_key):
        if kind == "pack":
            staging.append(item[1])
            continue
        adopted = adopts and policy_for(rules, flat[item[0]].path) == "raw"
        for piece, _ in item[1]:
            n = int(piece.nbytes)
            if adopted:
                objects.append(raw_header_size(n) + n)
            else:
                staging.append(n)
    return staging, objects


def _schedule_pack(sched, plan: ScheduledSave, group, total, known, pool, io, tier, staging) -> None:
    def capture():
        buf = pool.get(total)
        offset, seen, members = 0, {}, []
        for index, data, box in group:
            _await_device(plan.flat[index].data)
            n = int(data.nbytes)
            copied = plan.flat[index].data.unwatched  # no counter sees a write between hash and copy: hash the copy
            if copied:
                buf[offset:offset + n] = data
            digest = content_hash(buf[offset:offset + n] if copied else data, parallel_map)
            where = known.get(digest) or seen.get(digest)
            if where is None:
                if not copied:
                    buf[offset:offset + n] = data
                where = seen[digest] = (offset, n)
                offset += n
            members.append((index, digest, box, where))
        try:
            check_unchanged(plan, [index for index, _, _ in group])
        except StateChangedError:
            pool.give(buf)
            raise
        return buf, offset, members

    cap = sched.submit("capture", capture, priority=Priority.CAPTURE,
                       needs={staging: total, "cpu": 1}, frees={"cpu": 1}, nbytes=total)
    for index, _, _ in group:
        plan.captures.setdefault(index, []).append(cap)

    def write_pack():
        buf, used, members = cap.result()
        try:
            if not used:
                return "", "raw", members
            blob = buf[:used]
            digest = content_hash(blob, parallel_map)
            itemsize, floating = pack_kind(plan.flat[group[0][0]].data)
            slot = ("pack", plan.flat[group[0][0]].path, len(group))
            return digest, plan.writer.put(digest, blob, itemsize, floating, slot=slot), members
        finally:
            pool.give(buf)

    task = sched.submit("write", write_pack, priority=Priority.WRITE, needs=io,
                        frees={**io, staging: total}, deps=[cap], nbytes=total, tier=tier)
    plan.writes.append(task)
    plan.packs.append(task)
