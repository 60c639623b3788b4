"""Encoding stored objects in place: after a save's commit (encode_later) and after the fact
(compact)."""

import collections
import logging
import threading

from ..engine.reencode import LaterEncode, encode_in_place
from ..engine.encoding import codec_rules, element_of, packed_element, policy_codec, policy_for, row_elements
from ..engine.objectwriter import stored_codec
from ..engine.scheduler import Priority, Scheduler, Task
from ..errors import CorruptObjectError, FormatError
from ..codecs.lossy import Lossy
from ..format.manifest import Manifest
from ..format.objects import object_key
from .records import CompactReport

log = logging.getLogger("forkpoint")

COMPACTED_POLICIES = ("lossless", "zstd", "auto")


def encodable_objects(m, rules, policies, items: dict[str, LaterEncode] | None = None) -> dict[str, LaterEncode]:
    """{object key: how to encode it} for the objects of manifest `m` whose chunks fall under
    one of `policies` (lossy ones count as lossless) by `rules`; packs under the last rule,
    coded by the element size of their floating-point leaves (packs of other leaves as
    bytes); deltas left out. Adds to `items` when given."""
    items = {} if items is None else items
    for leaf in m.leaves:
        itemsize, floating = element_of(leaf.kind, leaf.dtype, leaf.shape, leaf.nbytes)
        for c in leaf.chunks:
            packed = c.object != c.hash
            policy = rules[-1][1] if packed else policy_for(rules, leaf.path)
            if c.delta or not (isinstance(policy, Lossy) or policy in policies):
                continue
            size, fl = packed_element(itemsize, floating) if packed else (itemsize, floating)
            row = 0 if packed else row_elements(leaf.shape, leaf.nbytes, itemsize)
            key = object_key(c.object)
            item = items.setdefault(key, LaterEncode(key, policy_codec(policy, size, fl), size, row=row))
            item.nbytes = max(item.nbytes, c.start + c.size)
    return items


class Compactor:
    """In-place encoding of stored objects: queued after a save's commit (encode_later) and on
    request (compact). It owns the encodes queued and running, which a flush waits for and
    eviction spares; `evict_lock`, the lock eviction holds, guards them."""

    def __init__(self, stores: list, scheduler: Scheduler, evict_lock: threading.Lock):
        self._stores, self._sched, self._evict_lock = stores, scheduler, evict_lock
        self._queued: dict[str, Task] = {}
        self._running: collections.Counter = collections.Counter()

    def compact(self, manifests: list[Manifest], rules: list, progress=None) -> CompactReport:
        """Encode in place, on every tier, the raw objects of `manifests` as a save under codec
        `rules` would have stored them (see Repo.compact); `progress(bytes)` is called per object."""
        items: dict[str, LaterEncode] = {}
        for m in manifests:
            if not m.version.pruned:
                encodable_objects(m, rules, COMPACTED_POLICIES, items)
        report = CompactReport(versions=len(manifests))
        tasks = [(item, self._sched.submit(
                    "compact", lambda store=store, item=item: self._compact_object(store, item),
                    priority=Priority.GC, needs={f"io:tier{k}": 1}, nbytes=item.nbytes,
                    tier=f"tier{k}"))
                 for k, store in enumerate(self._stores) for item in items.values()]
        for item, task in tasks:
            try:
                saved = task.result()
            except CorruptObjectError as e:
                report.problems.append(str(e))
                saved = None
            if saved is not None:
                report.objects += 1
                report.encoded += saved > 0
                report.saved_bytes += saved
            if progress is not None:
                progress(item.nbytes)
        return report

    def stored_codecs(self, m: Manifest) -> dict[str, str]:
        """{object name: the codec its header names now} for the objects of `m`, as the first
        tier holding each has it; an object no tier holds is left out."""
        out: dict[str, str] = {}
        for obj in {c.object for leaf in m.leaves for c in leaf.chunks}:
            for store in self._stores:
                try:
                    out[obj] = stored_codec(store, object_key(obj))
                    break
                except (FileNotFoundError, CorruptObjectError, FormatError):
                    continue
        return out

    def encode_later(self, items: list[LaterEncode], commit: Task | None, tier: str = "tier0") -> None:
        """Queue the in-place encoding of objects a save stored raw on tier 0 for its policy to
        encode (engine.reencode) on the scheduler's background lane, once the save's `commit`
        task has ended. A flush of one waits for it (promoted to the ordinary lane); eviction
        spares it while it runs (one evicted before it starts is skipped)."""
        for item in items:
            def run(item=item):
                try:
                    return self._compact_object(self._stores[0], item) or 0
                except CorruptObjectError as e:
                    log.warning("left %s as stored: %s", item.key, e)
                    return 0
                finally:
                    with self._evict_lock:
                        self._queued.pop(item.key, None)

            with self._evict_lock:
                self._queued[item.key] = self._sched.submit(
                    "encode", run, priority=Priority.FLUSH, after=[commit], nbytes=item.nbytes,
                    tier=tier, background=True)

    def queued(self, keys) -> dict[str, Task]:
        """{key: its encode task} for the objects of `keys` queued by encode_later (call with the
        evict lock held)."""
        return {key: self._queued[key] for key in keys if key in self._queued}

    def running(self, key: str) -> bool:
        """True while object `key` is being encoded in place (call with the evict lock held)."""
        return key in self._running

    def _compact_object(self, store, item: LaterEncode) -> int | None:
        """Encode one object of `store` in place, pinned against eviction meanwhile; None when
        the store does not hold it."""
        with self._evict_lock:
            if not store.exists(item.key):
                return None
            self._running[item.key] += 1
        try:
            return encode_in_place(store, item)
        finally:
            with self._evict_lock:
                self._running[item.key] -= 1
                if not self._running[item.key]:
                    del self._running[item.key]


class CompactCommands:
    """The compaction of a Repo's public API, over `self.compactor` (see repo.core)."""

    compactor: Compactor

    def compact(self, refs: list[str] | None = None, codec=None, progress=None) -> CompactReport:
        """Encode in place, on every tier, the raw objects of versions `refs` (default: all)
        as a save under `codec` (a policy or {path glob: policy}; default: the repository's)
        would have stored them; lossy policies compact as lossless (values are never changed
        after the fact). Each object is replaced atomically by an encoded copy of the same
        verified bytes, so readers and saves may run meanwhile; deltas, objects already
        encoded and those that do not code 5% smaller stay as they are, and a damaged object
        is reported in `problems` and left alone. `progress(bytes)` is called per object."""
        rules = codec_rules(self.options.codec if codec is None else codec)
        vids = [self.resolve(r) for r in refs] if refs else [v.id for v in self.versions()]
        return self.compactor.compact([self.history.manifest_by_id(vid) for vid in vids], rules, progress)

    def stored_codecs(self, ref: str) -> dict[str, str]:
        """{object name: the codec its header names now} for the objects of version `ref`, as
        the first tier holding each has it (a manifest's `codec` is the one at commit; objects
        encoded after it, or compacted, have another); an object no tier holds is left out."""
        return self.compactor.stored_codecs(self.manifest(ref))
