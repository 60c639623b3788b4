"""Save pipeline: chunk, capture, hash, dedup, encode and write leaves as scheduler tasks.

Large leaves are split along their first dimension into chunks of at most `chunk_bytes`;
small leaves are packed into shared objects. Staging memory is bounded by the scheduler's
budget: a state larger than it streams through.
"""

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..format.delta import Delta
from ..format.lossy import round_significand
from ..format.manifest import Chunk, Leaf
from ..format.objects import (BLOCK_BYTES, MAX_PACK_BYTES, block_root, content_hash)
from ..state.flatten import FlatLeaf
from ..storage.base import Store
from ..storage.streamcopy import stream_copy
from .chunkmemory import ChunkMemory
from .encoding import codec_rules, element_kind, pack_kind, policy_codec, policy_for, route_chunk, row_elements
from .objectwriter import ObjectWriter, hash_with_table, raw_header_size
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
            plan.large[i] = [_schedule_chunk(sched, plan, i, piece, box, pool, io, tier, staging)
                             for piece, box in pieces]
    for i, fl in enumerate(flat):
        if fl.data is not None and fl.data.pending is not None:
            sched.submit("release", fl.data.pending.release, priority=Priority.CAPTURE,
                         after=plan.captures.get(i, ()))
    return plan


def _await_device(d) -> None:
    """Wait until a leaf's device-to-host copy (if any) has filled its bytes."""
    if d.pending is not None:
        d.pending.wait()


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


def _copy_and_hash(src: np.ndarray, dst: np.ndarray) -> tuple[str, bytes]:
    """Copy `src` into `dst` block by block, hashing each block while it is in cache; return
    (content hash, block digest table)."""
    import blake3

    if src.nbytes <= BLOCK_BYTES:
        np.copyto(dst[:src.nbytes], src)
        return content_hash(dst[:src.nbytes]), b""
    digests = []
    for lo in range(0, src.nbytes, BLOCK_BYTES):
        hi = min(src.nbytes, lo + BLOCK_BYTES)
        np.copyto(dst[lo:hi], src[lo:hi])
        digests.append(blake3.blake3(memoryview(dst[lo:hi])).digest())
    table = b"".join(digests)
    return block_root(table, src.nbytes), table


@dataclass
class Staged:
    """A captured chunk on its way to the store: `buf`, the staging (or store object) buffer
    holding it, None where `data` is the live tensor's memory; `owned`, True where `buf` is the
    store's object buffer (header room before `data`); its content hash and block table (None
    until hashed); `info`, a lossy mode's record; the encoder's `scratch` buffer and `payload`
    (None where nothing was encoded); `raw`, True where the pacer had it written raw."""

    buf: object
    data: object
    owned: bool = False
    digest: str | None = None
    table: bytes | None = None
    info: dict | None = None
    scratch: object = None
    payload: list | None = None
    raw: bool = False

    def give_back(self, pool: StagingPool) -> None:
        """Return its staging and scratch buffers to `pool` (a failed step)."""
        for held in (self.buf, self.scratch):
            if held is not None:
                pool.give(held)
        self.buf = self.scratch = None


def _schedule_chunk(sched, plan: ScheduledSave, index, piece, box, pool, io, tier, staging) -> Task:
    n = int(piece.nbytes)
    itemsize, floating = element_kind(plan.flat[index].data)
    d = plan.flat[index].data
    route = route_chunk(plan.writer.policy_for(plan.flat[index].path), itemsize, floating, d.kind,
                        plan.deltas is not None, plan.writer, plan.pacer, n)
    policy, lossy, encodes, raw_now, ahead = route.policy, route.lossy, route.encodes, route.raw_now, route.ahead
    deltas = plan.deltas if route.delta else None
    row = row_elements(d.local_shape, int(d.data.nbytes), itemsize)
    head = raw_header_size(n) if raw_now else None
    in_place = staging == "window" and lossy is None and encodes and d.pending is None
    scratch_bytes = n if head is None and policy_codec(policy, itemsize, floating).encode_pieces else 0
    slot = (plan.flat[index].path, tuple(box[0]))

    def encode(staged: Staged, paced: bool) -> Staged:
        """Hash the staged chunk if its capture did not, and encode it into a scratch buffer
        unless `paced` and the pacer has it written raw; on failure give its buffers back."""
        try:
            if staged.digest is None:
                staged.digest, staged.table = hash_with_table(staged.data)
            if paced and not plan.pacer.encodes():
                staged.raw = True
                return staged
            staged.scratch = pool.get(scratch_bytes) if scratch_bytes else None
            staged.payload = plan.writer.encode_ahead(staged.digest, staged.data, itemsize, floating, policy,
                                                      staged.scratch, slot, row)
            if staged.payload is None and staged.scratch is not None:
                pool.give(staged.scratch)
                staged.scratch = None
            return staged
        except BaseException:
            staged.give_back(pool)
            raise

    def capture_chunk() -> Staged:
        if in_place and (not ahead or plan.pacer.encodes()):
            staged = Staged(None, piece, False, *hash_with_table(piece))
            return encode(staged, paced=False) if ahead else staged
        _await_device(d)
        raw_head = head if head is not None else (raw_header_size(n) if in_place else None)
        owned = plan.writer.store.object_buffer(raw_head + n) if raw_head is not None else None
        buf = pool.get(n) if owned is None else owned
        data = buf[:n] if owned is None else owned[raw_head:]
        if lossy is not None:
            np.copyto(data, piece)
            keep = lossy.keep_bits(itemsize)
            error = round_significand(data, itemsize, keep)
            info = {"mode": lossy.describe(), "keep_bits": keep, "max_rel_error": error}
            return Staged(buf, data, owned is not None, *hash_with_table(data), info)
        if staging == "staging":
            stream_copy(data, piece)
            return Staged(buf, data, owned is not None)
        return Staged(buf, data, owned is not None, *_copy_and_hash(piece, data), raw=in_place)

    def ready(staged: Staged) -> Staged:
        plan.pacer.ready()
        return staged

    folds = ahead and in_place
    worker = {"encode": 1} if folds else {"cpu": 1}
    payload = {"encoded": 1} if ahead else {}
    cap = sched.submit("capture", (lambda: ready(capture_chunk())) if folds else capture_chunk,
                       priority=Priority.CAPTURE, needs={staging: n, **worker, **(payload if folds else {})},
                       frees=worker, nbytes=n)
    plan.captures.setdefault(index, []).append(cap)
    staged_by = cap
    if ahead and not folds:
        staged_by = sched.submit("encode", lambda: ready(encode(cap.result(), paced=True)), priority=Priority.WRITE,
                                 needs={"encode": 1, **payload}, frees={"encode": 1}, deps=[cap], nbytes=n)

    def write_staged() -> Chunk:
        staged = staged_by.result()
        buf, data, owned, digest, table = staged.buf, staged.data, staged.owned, staged.digest, staged.table
        info, scratch, encoded, raw = staged.info, staged.scratch, staged.payload, staged.raw
        staged.buf = staged.data = staged.scratch = staged.payload = None
        if digest is None:
            digest, table = hash_with_table(data)
        if owned:
            codec = plan.writer.put(digest, data, itemsize, floating, policy, table, owned=buf, row=row)
            return Chunk(*box, digest, digest, 0, n, codec, info)
        if scratch is None and scratch_bytes and not raw:
            scratch = pool.get(scratch_bytes)
        delta_out = pool.get(n) if deltas is not None else None
        try:
            if deltas is not None:
                chunk = deltas.store(plan.writer, plan.flat[index].path, d.dtype, box, digest, data,
                                     itemsize, floating, policy, info, (delta_out, scratch))
                if chunk is not None:
                    return chunk
            codec = plan.writer.put(digest, data, itemsize, floating, "raw" if raw else policy, table,
                                    scratch=scratch, slot=slot, row=row, encoded=encoded)
            return Chunk(*box, digest, digest, 0, n, codec, info)
        finally:
            for held in (buf, scratch, delta_out):
                if held is not None:
                    pool.give(held)

    def write_paced() -> Chunk:
        try:
            return write_staged()
        finally:
            plan.pacer.written()

    task = sched.submit("write", write_paced if ahead else write_staged, priority=Priority.WRITE, needs=io,
                        frees={**io, staging: n, **payload}, deps=[staged_by], nbytes=n, tier=tier)
    plan.writes.append(task)
    return task


def _schedule_pack(sched, plan: ScheduledSave, group, total, known, pool, io, tier, staging) -> None:
    def capture():
        buf = pool.get(total)
        offset, seen, members = 0, {}, []
        for index, data, box in group:
            _await_device(plan.flat[index].data)
            digest = content_hash(data, parallel_map)
            where = known.get(digest) or seen.get(digest)
            if where is None:
                n = int(data.nbytes)
                buf[offset:offset + n] = data
                where = seen[digest] = (offset, n)
                offset += n
            members.append((index, digest, box, where))
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
