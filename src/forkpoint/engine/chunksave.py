"""One chunk's way through a save: capture, hash, encode (as engine.encoding routes it) and
write, as scheduler tasks; and the staging records between them."""

from dataclasses import dataclass

import numpy as np

from ..codecs.lossy import round_significand
from ..errors import StateChangedError
from ..format.manifest import Chunk
from ..format.objects import BLOCK_BYTES, block_root, content_hash
from ..storage.streamcopy import stream_copy
from .encoding import element_kind, policy_codec, route_chunk, row_elements
from .objectwriter import hash_with_table, raw_header_size
from .scheduler import Priority, Task
from .staging import StagingPool


def check_unchanged(plan, indices) -> None:
    """Raise StateChangedError when a live tensor of the leaves `indices` of `plan` was written
    in place since the save described it: its copy may hold a later state, or a torn one."""
    changed = sorted({plan.flat[i].path for i in indices if plan.flat[i].data.changed()})
    if changed:
        raise StateChangedError(
            f"{changed_paths(changed)} changed while an asynchronous save was copying it, so that save was not "
            f"committed. {UNGUARDED_WRITES} Call PendingSave.wait_capture() (or Checkpointer.wait_capture()) "
            "before such writes, or save with sync=True", changed)


UNGUARDED_WRITES = ("The capture hooks make optimizer.step() and the forward of modules with buffers wait for "
                    "the copy; this was another in-place write (a manual update under torch.no_grad(), an EMA, "
                    "a buffer set by hand).")


def changed_paths(paths: list[str]) -> str:
    """`paths` for a message: the first five, quoted, and how many more."""
    return ", ".join(repr(p) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _await_device(d) -> None:
    """Wait until a leaf's device-to-host copy (if any) has filled its bytes."""
    if d.pending is not None:
        d.pending.wait()


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


class ChunkSave:
    """The tasks that save one chunk, `piece` (the `box` of leaf `index` of `plan`): capture it
    into staging memory from `pool` (or the store's object buffer where it goes raw, or, in a
    synchronous save, nowhere: it is hashed and encoded straight from live memory), hash it,
    encode it as engine.encoding routes it (ahead of its write by a paced task, or in its
    write), and write it. `staging` names the budget its buffers count against."""

    def __init__(self, plan, index: int, piece, box, pool: StagingPool, staging: str):
        self.plan, self.index, self.piece, self.box, self.pool, self.staging = plan, index, piece, box, pool, staging
        self.n = int(piece.nbytes)
        self.d = d = plan.flat[index].data
        self.itemsize, self.floating = element_kind(d)
        self.route = r = route_chunk(plan.writer.policy_for(plan.flat[index].path), self.itemsize, self.floating,
                                     d.kind, plan.deltas is not None, plan.writer, plan.pacer, self.n)
        self.deltas = plan.deltas if r.delta else None
        self.row = row_elements(d.local_shape, int(d.data.nbytes), self.itemsize)
        self.head = raw_header_size(self.n) if r.raw_now else None
        self.in_place = staging == "window" and r.lossy is None and r.encodes and d.pending is None
        codec = policy_codec(r.policy, self.itemsize, self.floating)
        self.scratch_bytes = self.n if self.head is None and codec.encode_pieces else 0
        self.slot = (plan.flat[index].path, tuple(box[0]))
        self.staged_by: Task | None = None

    def schedule(self, sched, io: dict, tier: str) -> Task:
        """Submit the chunk's tasks; return its write task (whose result is its Chunk record)."""
        plan, n, ahead = self.plan, self.n, self.route.ahead
        folds = ahead and self.in_place  # encoded by its capture task, from live memory
        worker = {"encode": 1} if folds else {"cpu": 1}
        payload = {"encoded": 1} if ahead else {}
        cap = sched.submit("capture", (lambda: self.ready(self.capture())) if folds else self.capture,
                           priority=Priority.CAPTURE, needs={self.staging: n, **worker, **(payload if folds else {})},
                           frees=worker, nbytes=n)
        plan.captures.setdefault(self.index, []).append(cap)
        self.staged_by = cap
        if ahead and not folds:
            self.staged_by = sched.submit("encode", lambda: self.ready(self.encode(cap.result(), paced=True)),
                                          priority=Priority.WRITE, needs={"encode": 1, **payload},
                                          frees={"encode": 1}, deps=[cap], nbytes=n)
        task = sched.submit("write", self.write_paced if ahead else self.write, priority=Priority.WRITE, needs=io,
                            frees={**io, self.staging: n, **payload}, deps=[self.staged_by], nbytes=n, tier=tier)
        plan.writes.append(task)
        return task

    def encode(self, staged: "Staged", paced: bool) -> "Staged":
        """Hash the staged chunk if its capture did not, and encode it into a scratch buffer
        unless `paced` and the pacer has it written raw; on failure give its buffers back."""
        plan, pool = self.plan, self.pool
        try:
            if staged.digest is None:
                staged.digest, staged.table = hash_with_table(staged.data)
            if paced and not plan.pacer.encodes():
                staged.raw = True
                return staged
            staged.scratch = pool.get(self.scratch_bytes) if self.scratch_bytes else None
            staged.payload = plan.writer.encode_ahead(staged.digest, staged.data, self.itemsize, self.floating,
                                                      self.route.policy, staged.scratch, self.slot, self.row)
            if staged.payload is None and staged.scratch is not None:
                pool.give(staged.scratch)
                staged.scratch = None
            return staged
        except BaseException:
            staged.give_back(pool)
            raise

    def capture(self) -> "Staged":
        """Copy the chunk where its write will take it from (see the class's docstring), then
        check that its live tensor was not written meanwhile."""
        staged = self._copy()
        try:
            check_unchanged(self.plan, [self.index])
        except StateChangedError:
            if not staged.owned:
                staged.give_back(self.pool)
            raise
        return staged

    def _copy(self) -> "Staged":
        n, piece, lossy = self.n, self.piece, self.route.lossy
        if self.in_place and (not self.route.ahead or self.plan.pacer.encodes()):
            staged = Staged(None, piece, False, *hash_with_table(piece))
            return self.encode(staged, paced=False) if self.route.ahead else staged
        _await_device(self.d)
        raw_head = self.head if self.head is not None else (raw_header_size(n) if self.in_place else None)
        owned = self.plan.writer.store.object_buffer(raw_head + n) if raw_head is not None else None
        buf = self.pool.get(n) if owned is None else owned
        data = buf[:n] if owned is None else owned[raw_head:]
        if lossy is not None:
            np.copyto(data, piece)
            keep = lossy.keep_bits(self.itemsize)
            error = round_significand(data, self.itemsize, keep)
            info = {"mode": lossy.describe(), "keep_bits": keep, "max_rel_error": error}
            return Staged(buf, data, owned is not None, *hash_with_table(data), info)
        if self.staging == "staging":
            stream_copy(data, piece)
            return Staged(buf, data, owned is not None)
        return Staged(buf, data, owned is not None, *_copy_and_hash(piece, data), raw=self.in_place)

    def ready(self, staged: "Staged") -> "Staged":
        """A paced chunk is captured (and encoded or not): it now waits for its write."""
        self.plan.pacer.ready()
        return staged

    def write(self) -> Chunk:
        """Write the staged chunk (as a delta where that codes smaller); its Chunk record."""
        plan, pool, n, box, policy = self.plan, self.pool, self.n, self.box, self.route.policy
        staged = self.staged_by.result()
        buf, data, owned, digest, table = staged.buf, staged.data, staged.owned, staged.digest, staged.table
        info, scratch, encoded, raw = staged.info, staged.scratch, staged.payload, staged.raw
        staged.buf = staged.data = staged.scratch = staged.payload = None
        if digest is None:
            digest, table = hash_with_table(data)
        if owned:
            codec = plan.writer.put(digest, data, self.itemsize, self.floating, policy, table, owned=buf,
                                    row=self.row)
            return Chunk(*box, digest, digest, 0, n, codec, info)
        if scratch is None and self.scratch_bytes and not raw:
            scratch = pool.get(self.scratch_bytes)
        delta_out = pool.get(n) if self.deltas is not None else None
        try:
            if self.deltas is not None:
                chunk = self.deltas.store(plan.writer, plan.flat[self.index].path, self.d.dtype, box, digest, data,
                                          self.itemsize, self.floating, policy, info, (delta_out, scratch))
                if chunk is not None:
                    return chunk
            codec = plan.writer.put(digest, data, self.itemsize, self.floating, "raw" if raw else policy, table,
                                    scratch=scratch, slot=self.slot, row=self.row, encoded=encoded)
            return Chunk(*box, digest, digest, 0, n, codec, info)
        finally:
            for held in (buf, scratch, delta_out):
                if held is not None:
                    pool.give(held)

    def write_paced(self) -> Chunk:
        try:
            return self.write()
        finally:
            self.plan.pacer.written()
