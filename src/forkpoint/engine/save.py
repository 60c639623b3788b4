"""Save pipeline: chunk, capture, hash, dedup, encode and write leaves as scheduler tasks.

Large leaves are split along their first dimension into chunks of at most `chunk_bytes`;
small leaves are packed into shared objects. Staging memory is bounded by the scheduler's
budget: a state larger than it streams through.
"""

import contextlib
import dataclasses
import fnmatch
import threading
from dataclasses import dataclass, field

import numpy as np

from ..errors import SaveAbortedError
from ..format.codecs import MIN_GAIN, POLICIES, codec_by_id, codec_by_name, codec_for
from ..format.delta import Delta
from ..format.lossy import Lossy, round_significand, supports
from ..format.manifest import Chunk, Leaf
from ..format.objects import (BLOCK_BYTES, MAX_PACK_BYTES, DIGEST_BYTES, OBJECT_HEADER_SIZE, block_digests, block_root, content_hash, object_key,
                              pack_header, table_header_size, unpack_header)
from ..state.flatten import FlatLeaf
from ..storage.base import Store
from ..storage.streamcopy import stream_copy
from .autocodec import BusyMeter, choice_for
from .chunkmemory import ChunkMemory
from .pacing import EncodePacer, PaceMemory
from .parallel import parallel_map
from .reencode import LaterEncode
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
    adaptive: bool = True
    """Under lossless, zstd and lossy policies, encode a chunk only while the store has at
    least its I/O slots' worth of chunks waiting for or in their writes and its cores are not
    kept busy, by this process or others (the store, not the CPU, bounds the save then), else
    write it raw (engine.pacing), so that encoding does not make the save slower than a raw
    one; and, where
    a repository's saves written raw now and then measure more than 15% faster than its paced
    ones, write the next saves raw (retrying paced every 8 to 64 saves). Saves of fewer than
    twice the slots of such chunks encode them all (unless the timing has the save written
    raw); memory and remote stores are not paced.
    False encodes every chunk (the smallest checkpoint, whatever it costs)."""
    max_pending: int = 2
    """Asynchronous saves in flight (scheduled, not committed) at most: a further
    save(sync=False) first waits for the oldest to commit (back-pressure, so that saves asked
    for faster than the store takes them cannot pile up)."""

    def __post_init__(self):
        if self.delta is not None and not isinstance(self.delta, (bool, Delta)):
            raise TypeError(f"delta must be True, False, None or fp.Delta(...), got {self.delta!r}")
        self.delta = Delta() if self.delta is True else self.delta or None
        for name in ("encode_later", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
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


def codec_rules(codec) -> list[tuple[str, str]]:
    """Normalise `codec` (a policy, or {path glob: policy} with an optional "*" default) into
    ordered (pattern, policy) rules ending with a catch-all."""
    items = list(codec.items()) if isinstance(codec, dict) else [("*", codec)]
    rules = []
    for pattern, policy in items:
        policy = "raw" if policy == "none" else policy
        if not isinstance(policy, Lossy) and policy not in POLICIES:
            raise ValueError(f"codec must be one of {POLICIES + ('none',)} or fp.Lossy(...), "
                             f"got {policy!r} for {pattern!r}")
        rules.append((pattern, policy))
    rules.sort(key=lambda r: r[0] == "*")
    if rules[-1][0] != "*":
        rules.append(("*", "raw"))
    return rules


def policy_for(rules: list[tuple[str, str]], path: str) -> str:
    """The policy of the first of `rules` (from codec_rules) whose pattern matches `path`."""
    return next(policy for pattern, policy in rules if fnmatch.fnmatchcase(path, pattern))


DIRECT_MIN_BYTES = 1 << 20
ENCODING_POLICIES = ("lossless", "zstd")


def policy_codec(policy, itemsize: int, floating: bool):
    """The codec a chunk under `policy` is encoded with (a lossy policy's rounded values go
    through the lossless codec)."""
    return codec_for("lossless" if isinstance(policy, Lossy) else policy, itemsize, floating)


class ObjectWriter:
    """Writes objects once per save, thread-safely, and tallies what was new. `encoding()` is
    held while a chunk is encoded (the scheduler's encoder budget: one encoder per core lets
    the other write tasks keep the store busy). With `defers`, chunks of an encoding policy
    are written raw when raw saves measure faster on the store, and listed in `later` for
    encoding after the commit (engine.reencode). `layouts` keeps what the codec chose per
    chunk slot for the next save to reuse."""

    def __init__(self, store: Store, codec, guard=None, encoding=None, defers: bool = False,
                 layouts: ChunkMemory | None = None):
        self.store = store
        self.layouts = layouts
        self.encoding = encoding or contextlib.nullcontext
        self.rules = codec_rules(codec)
        self.policy = self.rules[-1][1]
        self.lock = threading.Lock()
        self.guard = guard or threading.Lock()
        self.claimed: dict[str, threading.Event] = {}
        self.codecs: dict[str, str] = {}
        self.stored_bytes = 0
        self.auto_encodes: bool | None = None
        self.auto_meter = BusyMeter()
        self.keeps_advice = True
        self.written: list[str] = []
        self.pinned: set[str] = set()
        self.defers = defers
        self.later: list[LaterEncode] = []
        self.aborted = False

    def holds(self, digest: str) -> bool:
        """True when this save wrote, is writing or refers to object `digest`."""
        return digest in self.claimed or digest in self.pinned

    def policy_for(self, path: str) -> str:
        """The codec policy of the first rule whose pattern matches `path`."""
        return policy_for(self.rules, path)

    def put(self, digest: str, data: np.ndarray, itemsize: int = 1, floating: bool = False,
            policy: str | None = None, table: bytes | None = None, owned=None, scratch=None,
            slot=None, row: int = 0, encoded=None) -> str:
        """Ensure object `digest` holding `data` exists; return the codec name it is stored with.
        `table` is the data's block digest table when the caller has it already. `owned` is a
        buffer from the store's `object_buffer` whose tail is `data` (raw policy): the store
        adopts it as the object instead of copying, or gets it back when nothing is written.
        `scratch` (uint8, the data's size) is memory the encoder may use (see Codec.pieces).
        `slot` names the chunk (the same from one save to the next) for the codec's layouts;
        `row` is the elements of one of its rows (see Codec.pieces). `encoded` is the payload
        of `encode_ahead` when the caller encoded `data` already."""
        if self.aborted:
            raise SaveAbortedError("the save was aborted: object not written")
        key = object_key(digest)
        with self.lock:
            event = self.claimed.get(digest)
            mine = event is None
            if mine:
                event = self.claimed[digest] = threading.Event()
        if not mine:
            event.wait()
            if owned is not None:
                self.store.release_buffer(owned)
            return self.codecs[digest]
        try:
            with self.guard:
                present = encoded is None and self.store.exists(key)  # encode_ahead looked already
                if present:
                    try:  # refreshed, so that a gc in another process spares it (docs/FORMAT.md)
                        self.store.touch(key)
                    except FileNotFoundError:  # deleted by a gc since: written anew below
                        present = False
            policy = policy or self.policy
            if present:
                if owned is not None:
                    self.store.release_buffer(owned)
                codec_name = stored_codec(self.store, key)
            elif owned is not None:
                with self._measured(data.nbytes, self.learns(policy)):
                    codec_name = self._adopt(key, data, owned, table)
                self._defer(key, policy, itemsize, floating, data.nbytes, row)
            else:
                codec = policy_codec(policy, itemsize, floating)
                later = self.encodes_later(policy)
                if later or (policy == "auto" and not self._encodes(data)):
                    codec = codec_by_name("raw")
                with self._measured(data.nbytes, self.learns(policy)):
                    codec_name = self._write(key, data, codec, itemsize, table, scratch, slot, row, encoded)
                if later:
                    self._defer(key, policy, itemsize, floating, data.nbytes, row)
            self.codecs[digest] = codec_name
            return codec_name
        finally:
            self.codecs.setdefault(digest, "raw")
            event.set()

    def encodes_auto(self) -> bool:
        """Whether this save encodes its auto chunks (the store's AutoChoice, asked once)."""
        with self.lock:
            if self.auto_encodes is None:
                self.auto_encodes = choice_for(self.store).pick(encoded_first=self.store.bandwidth_hint is not None)
            return self.auto_encodes

    def learns(self, policy) -> bool:
        """Whether chunks under `policy` are timed for the store's AutoChoice: auto's, and
        those of an encoding policy that may be encoded later."""
        return policy == "auto" or (self.defers and policy in ENCODING_POLICIES)

    def encodes_later(self, policy) -> bool:
        """True when chunks under `policy` (an encoding one) are written raw by this save and
        encoded after its commit: the writer `defers`, and raw saves measure faster here."""
        return self.defers and policy in ENCODING_POLICIES and not self.encodes_auto()

    def _defer(self, key: str, policy, itemsize: int, floating: bool, nbytes: int, row: int = 0) -> None:
        if self.encodes_later(policy):
            with self.lock:
                self.later.append(LaterEncode(key, policy_codec(policy, itemsize, floating), itemsize, nbytes, row))

    def finish(self) -> None:
        """Report this save's writing of auto chunks to the store's AutoChoice (once every
        write is done), which writes what it learnt to the store when `keeps_advice`."""
        if self.auto_encodes is not None:
            choice_for(self.store).record(self.auto_encodes, self.auto_meter.nbytes, self.auto_meter.busy,
                                          keep=self.keeps_advice)

    def _encodes(self, data: np.ndarray) -> bool:
        """(codec="auto") True where this save encodes and `data` is not tiny (what does not code
        5% smaller is then stored raw, as under every policy)."""
        return self.encodes_auto() and data.nbytes >= 4096

    @contextlib.contextmanager
    def _measured(self, nbytes: int, measure: bool):
        """Count the write in the block towards this save's measured writing of auto chunks
        (when `measure`): `nbytes` decoded bytes if it does not raise."""
        if not measure:
            yield
            return
        self.auto_meter.start()
        written = 0
        try:
            yield
            written = nbytes
        finally:
            self.auto_meter.finish(written)

    def _write(self, key: str, data: np.ndarray, codec, itemsize: int, table: bytes | None,
               scratch=None, slot=None, row: int = 0, encoded=None) -> str:
        view = memoryview(data).cast("B")
        payload = [view]
        if codec.id != 0:
            if encoded is None:
                with self.encoding():
                    encoded = self._encode(view, codec, itemsize, scratch, slot, row)
            if sum(memoryview(p).nbytes for p in encoded) < MIN_GAIN * view.nbytes:
                payload = encoded
            else:
                codec = codec_by_name("raw")
        header_size, table = raw_header(view, table) if codec.id == 0 else (OBJECT_HEADER_SIZE, b"")
        stored = header_size + sum(memoryview(p).nbytes for p in payload)
        self.store.write(key, [pack_header(codec.id, view.nbytes, header_size, table), *payload])
        with self.lock:
            self.stored_bytes += stored
            self.written.append(key)
        return codec.name

    def encode_ahead(self, digest: str, data: np.ndarray, itemsize: int, floating: bool, policy,
                     scratch=None, slot=None, row: int = 0) -> list | None:
        """The payload `put` would encode `data` to, for a task that encodes before the write
        (so that encoders never wait for a slot held by a write to the store); None where this
        save claimed `digest` already or the store holds it (nothing to encode)."""
        with self.lock:
            if digest in self.claimed or digest in self.pinned:
                return None
        with self.guard:
            if self.store.exists(object_key(digest)):
                return None
        codec = policy_codec(policy, itemsize, floating)
        return self._encode(memoryview(data).cast("B"), codec, itemsize, scratch, slot, row)

    def _encode(self, view: memoryview, codec, itemsize: int, scratch, slot, row: int) -> list:
        """`codec`'s payload of `view`; where the store writes aligned parts without copying
        them (direct I/O) and the object is large enough for it, the parts of `scratch` the
        payload keeps are placed at block-aligned offsets of the object file."""
        layouts = self.layouts.get(slot) if self.layouts is not None and slot is not None else None
        aligned = scratch is not None and self.store.aligned_writes and view.nbytes >= DIRECT_MIN_BYTES
        return codec.pieces(view, itemsize, parallel_map, scratch=scratch, layouts=layouts, row=row,
                            at=OBJECT_HEADER_SIZE if aligned else None)

    def _adopt(self, key: str, data: np.ndarray, owned: np.ndarray, table: bytes | None) -> str:
        """Store raw `data`, the tail of `owned`, by writing its header in front of it and
        handing the whole buffer to the store."""
        view = memoryview(data).cast("B")
        header_size, table = raw_header(view, table)
        owned[:header_size] = np.frombuffer(pack_header(0, view.nbytes, header_size, table), np.uint8)
        self.store.adopt(key, owned)
        with self.lock:
            self.stored_bytes += owned.nbytes
            self.written.append(key)
        return "raw"


def raw_header_size(nbytes: int) -> int:
    """Header bytes of a raw object of `nbytes`: large ones get an aligned header that holds
    the block table (direct I/O, partial reads), small ones the plain header."""
    return table_header_size(nbytes) if nbytes >= DIRECT_MIN_BYTES else OBJECT_HEADER_SIZE


def raw_header(view: memoryview, table: bytes | None) -> tuple[int, bytes]:
    """(header size, block table) of a raw object holding `view` (`table` when the caller has it)."""
    header_size = raw_header_size(view.nbytes)
    blocks = -(-view.nbytes // BLOCK_BYTES)
    if header_size > OBJECT_HEADER_SIZE and blocks > 1 and OBJECT_HEADER_SIZE + blocks * DIGEST_BYTES <= header_size:
        return header_size, table or block_digests(view, pmap=parallel_map)
    return header_size, b""


def stored_codec(store: Store, key: str) -> str:
    """Return the codec name recorded in an existing object's header."""
    header = bytearray(OBJECT_HEADER_SIZE)
    store.read_into(key, 0, memoryview(header))
    return codec_by_id(unpack_header(bytes(header), key)[0], key).name


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
    pacer = EncodePacer(sched.limit(f"io:{tier}"), enabled=opts.adaptive and store.paces_encoding, memory=pacing)
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


def pack_kind(d) -> tuple[int, bool]:
    """(element size, floating) a pack of leaves like `d` is coded by (see packed_element)."""
    return packed_element(*element_kind(d))


def packed_element(itemsize: int, floating: bool) -> tuple[int, bool]:
    """(element size, floating) a pack holding leaves of these elements is coded by:
    floating-point leaves pack by element size, so that the float codec splits each pack into
    the right planes; everything else packs together and is coded as bytes."""
    return (itemsize, True) if floating else (1, False)


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


def hash_with_table(data: np.ndarray) -> tuple[str, bytes]:
    """(content hash, block digest table) of bytes already in memory."""
    if data.nbytes <= BLOCK_BYTES:
        return content_hash(data), b""
    table = block_digests(memoryview(data), pmap=parallel_map)
    return block_root(table, data.nbytes), table


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


def element_kind(d) -> tuple[int, bool]:
    """(bytes per element, whether it is floating point) of a leaf's data."""
    return element_of(d.kind, d.dtype, d.local_shape, int(d.data.nbytes))


def element_of(kind: str, dtype: str, shape, nbytes: int) -> tuple[int, bool]:
    """(bytes per element, whether it is floating point) of `nbytes` of `shape` elements of
    a `kind` leaf of `dtype` (what chooses a chunk's codec). A complex element counts as its
    two floats, so codecs and lossy rounding see the real and imaginary parts apart."""
    count = int(np.prod(shape)) if shape else 1
    itemsize = nbytes // count if count else 1
    floating = kind in ("torch", "numpy") and dtype.startswith(("float", "bfloat", "complex"))
    if floating and dtype.startswith("complex") and itemsize > 1:
        itemsize //= 2
    return itemsize, floating


def row_elements(shape, nbytes: int, itemsize: int) -> int:
    """Elements (of `itemsize`) in one index of dim 0 of a leaf of `shape` and `nbytes`: the
    rows a chunk holds whole (chunks split dim 0); 0 for fewer than two dimensions."""
    if len(shape) < 2 or not shape[0] or itemsize < 1:
        return 0
    return nbytes // shape[0] // itemsize


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
    policy = plan.writer.policy_for(plan.flat[index].path)

    lossy = policy if isinstance(policy, Lossy) and supports(itemsize, floating) else None
    d = plan.flat[index].data
    row = row_elements(d.local_shape, int(d.data.nbytes), itemsize)
    deltas = plan.deltas if plan.deltas is not None and policy != "raw" and d.kind in ("torch", "numpy") else None
    later = lossy is None and deltas is None and plan.writer.encodes_later(policy)
    encodes = not later and (policy in ENCODING_POLICIES or (policy == "auto" and plan.writer.encodes_auto()))
    raw_now = policy == "raw" or later or (policy == "auto" and not encodes and deltas is None)
    ahead = (not raw_now and deltas is None and policy != "auto" and not plan.writer.defers
             and policy_codec(policy, itemsize, floating).id != 0)
    if ahead:
        plan.pacer.add(n)
        if lossy is None and not plan.pacer.paced:
            policy, encodes, raw_now, ahead = "raw", False, True, False
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
