"""ObjectWriter: writes a save's objects once each (exists-or-write, thread-safe), encoded as
engine.encoding decides, and tallies what was new; and the raw object headers it writes."""

import contextlib
import threading

import numpy as np

from ..errors import SaveAbortedError
from ..codecs.registry import MIN_GAIN, codec_by_id, codec_by_name
from ..format.objects import (BLOCK_BYTES, DIGEST_BYTES, OBJECT_HEADER_SIZE, block_digests, block_root,
                              content_hash, object_key, pack_header, table_header_size, unpack_header)
from ..storage.base import Store
from .autocodec import BusyMeter, choice_for
from .chunkmemory import ChunkMemory
from .encoding import ENCODING_POLICIES, codec_rules, policy_codec, policy_for
from .parallel import parallel_map
from .reencode import LaterEncode


DIRECT_MIN_BYTES = 1 << 20


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
    return stored_header(store, key)[0]


def stored_header(store: Store, key: str) -> tuple[str, int]:
    """(codec name, decoded length) as an existing object's header records them."""
    header = bytearray(OBJECT_HEADER_SIZE)
    store.read_into(key, 0, memoryview(header))
    codec_id, length, _ = unpack_header(bytes(header), key)
    return codec_by_id(codec_id, key).name, length


def hash_with_table(data: np.ndarray) -> tuple[str, bytes]:
    """(content hash, block digest table) of bytes already in memory."""
    if data.nbytes <= BLOCK_BYTES:
        return content_hash(data), b""
    table = block_digests(memoryview(data), pmap=parallel_map)
    return block_root(table, data.nbytes), table
