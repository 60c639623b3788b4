"""Load and in-place restore (its strict checks in restore_checks.py), with tier fallback."""

from collections.abc import Callable

from ..engine.gcpause import gc_paused
from ..engine.restore import ReadRequest, mapped_leaf, read_leaves
from ..errors import (CorruptObjectError, ForkpointError, MissingObjectError, PrunedVersionError,
                      RefNotFoundError, StateMismatchError, UnsupportedTypeError)
from ..format.manifest import Manifest, Version
from ..format.paths import child_path, has_prefix
from ..state import capture, merge, restore_objects, unflatten, walk_skeleton
from ..state.leaves import (check_map_location, empty_leaf, finish_leaf, is_torch_tensor, leaf_over,
                            live_buffer)
from ..state.block import box_fits
from ..state.flatten import CONTAINER_NODES
from ..state.skeleton import rename as rename_skeleton
from ..state.skeleton import select as select_skeleton
from ..state.skeleton import strip_wrappers
from .restore_checks import check_restore, keys_path, listing


class Reader:
    """Loads, in-place restores and raw reads of a repository's versions, from the fastest of
    `stores` holding each one, falling back tier by tier on a missing or corrupt object.

    `history` resolves refs and reads manifests; `submit_read(fn, nbytes)` schedules one read
    and `batch()` groups several (the Repo's scheduler); `rank_world()` is this process's
    (rank, world size) for rank-local state; `on_read(vid)` is told of each version read (the
    tiers' prefetch order drops it)."""

    def __init__(self, stores: list, url: str, history, submit_read: Callable, batch: Callable,
                 rank_world: Callable[[], tuple[int, int]], on_read: Callable[[str], None]):
        self._stores, self._url, self._history = stores, url, history
        self._submit_read, self._batch = submit_read, batch
        self._rank_world, self._on_read = rank_world, on_read

    def readable(self, ref: str) -> Manifest:
        """The manifest of version `ref` for reading its data (PrunedVersionError when it was
        pruned): its leaves, chunks and tree, for readers that place data themselves."""
        m = self._history.manifest_by_id(self._history.resolve(ref))
        self._on_read(m.version.id)
        if m.version.pruned:
            raise PrunedVersionError(
                f"version {m.version.id} (step {m.version.step}) of {self._url} was pruned (by "
                "retention, or evicted from a faster tier without being flushed, see fp.tier's flush_every); "
                "its record remains in the log but its data is gone")
        return m

    def read_into(self, requests: list, vid: str) -> None:
        """Fill `requests` (engine.restore.ReadRequest: a leaf, or a box of it, into a caller's
        buffer) with version `vid`'s verified bytes, from the fastest tier holding them."""
        self.from_holders(vid, lambda store: read_leaves(store, requests, vid, self._submit_read,
                                                         batch=self._batch))

    def load_block(self, ref: str, path: str, offset, shape):
        """The box of array leaf `path` of version `ref` at `offset` with `shape`, as a new numpy
        array; only the chunks (and the 1 MiB blocks of them) that meet the box are read."""
        import numpy as np

        m = self.readable(ref)
        leaf = next((lf for lf in m.leaves if lf.path == path), None)
        if leaf is None:
            raise RefNotFoundError(f"version {m.version.id} has no leaf {path!r}: leaves are "
                                   f"{listing([lf.path for lf in m.leaves])}")
        if leaf.alias_of is not None:
            leaf = m.leaves[leaf.alias_of]
        if leaf.kind not in ("numpy", "torch"):
            raise UnsupportedTypeError(f"leaf {path!r} of version {m.version.id} is {leaf.kind!r} data, not an "
                                       "array: read it with repo.load(paths=[...])")
        offset, shape = [int(x) for x in offset], [int(x) for x in shape]
        if not box_fits(offset, shape, leaf.shape):
            raise ValueError(f"leaf {path!r} of version {m.version.id} has shape {leaf.shape}: a box at "
                             f"offset {offset} of shape {shape} does not fit in it")
        try:
            dtype = np.dtype(leaf.dtype)
        except TypeError:
            raise UnsupportedTypeError(f"leaf {path!r} has dtype {leaf.dtype}, which numpy lacks: load it "
                                       "with repo.load(paths=[...]) instead") from None
        out = np.empty(shape, dtype=dtype)
        self.read_into([ReadRequest(leaf, out.reshape(-1).view(np.uint8), (offset, shape))],
                                 m.version.id)
        return out

    def read_values(self, m: Manifest, indices: list[int], targets: dict, map_location,
                     allow_pickle: bool, devices: dict | None = None, mmap: bool = False) -> dict[int, object]:
        """Read leaves `indices` of `m`; `targets[i]` is a live uint8 buffer to fill in place.
        With mmap, leaves that allow it are mapped from storage instead of read."""
        if any(m.leaves[i].kind == "pickle" for i in indices) and not allow_pickle:
            leaf = next(m.leaves[i] for i in indices if m.leaves[i].kind == "pickle")
            raise _pickle_refused(leaf.path, m.version.id)
        values, requests, fresh = {}, [], {}
        for i in indices:
            leaf = m.leaves[i]
            if leaf.alias_of is not None:
                continue
            if i in targets:
                requests.append(ReadRequest(leaf, targets[i][1], targets[i][2]))
                values[i] = targets[i][0]
            elif mmap and (mapped := self._mapped(leaf, m.version.id)) is not None:
                fresh[i] = mapped
            else:
                obj, buf = empty_leaf(leaf.kind, leaf.dtype, leaf.shape, leaf.device, leaf.path)
                requests.append(ReadRequest(leaf, buf))
                fresh[i] = obj
        try:
            self.read_into(requests, m.version.id)
        except ForkpointError as e:
            if not targets:
                raise
            raise _partly_filled(e, m, targets) from None
        for i, obj in fresh.items():
            loc = (devices or {}).get(i, map_location)
            values[i] = finish_leaf(m.leaves[i].kind, obj, m.leaves[i].device, loc, allow_pickle,
                                    m.leaves[i].path)
        for i in indices:
            base = m.leaves[i].alias_of
            if base is not None:
                if base not in values:
                    values.update(self.read_values(m, [base], targets, map_location, allow_pickle, devices))
                values[i] = values[base]
        return values

    def _holders(self, vid: str) -> list:
        """The stores holding version `vid`, fastest first (tier 0 when none says so)."""
        return [st for st in self._stores if st.exists(f"versions/{vid}.json")] or [self._stores[0]]

    def from_holders(self, vid: str, read):
        """`read(store)` on the fastest tier holding the version; on a missing or corrupt
        object, on the next one."""
        holders = self._holders(vid)
        for i, store in enumerate(holders):
            try:
                return read(store)
            except (MissingObjectError, CorruptObjectError):
                if i == len(holders) - 1:
                    raise

    def _mapped(self, leaf, vid: str):
        """A leaf memory-mapped from the fastest tier holding the version, or None."""
        data = mapped_leaf(self._holders(vid)[0], leaf, vid)
        return None if data is None else leaf_over(leaf.kind, leaf.dtype, leaf.shape, data, leaf.path)

    def _selected(self, ref: str, paths, map_location) -> tuple[Manifest, list[str] | None, dict]:
        """(manifest of `ref`, `paths` as a list or None, the skeleton under them) for a load or
        restore; the map_location checked before anything is read."""
        check_map_location(map_location)
        m = self.readable(ref)
        paths = [paths] if isinstance(paths, str) else paths
        skeleton = select_skeleton(m.tree, paths)
        if skeleton is None:
            raise RefNotFoundError(f"version {m.version.id} has nothing under {paths}")
        return m, paths, skeleton

    @gc_paused()
    def load(self, ref: str = "main", paths: list[str] | None = None, map_location=None,
             allow_pickle: bool = False, mmap: bool = False, all_ranks: bool = False):
        """Return the state tree of `ref` (tensors on `map_location`, default CPU: a device, a
        dict from saved device to target, or `f(tensor, saved device)`, as in torch.load). With
        mmap=True, large leaves on a local or /dev/shm tier are memory-mapped (copy-on-write,
        still verified) instead of copied into fresh memory. Rank-local state saved by several
        ranks comes back as this rank's part, or as the list of every rank's with all_ranks."""
        m, paths, skeleton = self._selected(ref, paths, map_location)
        if not all_ranks:
            skeleton = self._resolve_ranks(skeleton, m, [], [])
        indices = [n["i"] for _, _, n in walk_skeleton(skeleton) if n.get("t") == "leaf"]
        values = self.read_values(m, indices, {}, map_location, allow_pickle, mmap=mmap)
        return unflatten(skeleton, values, f"version {m.version.id}")

    @gc_paused()
    def restore(self, state, ref: str = "main", strict: bool = True, paths: list[str] | None = None,
                rename: dict[str, str] | None = None, map_location=None,
                allow_pickle: bool = False) -> Version:
        """Restore `ref` into live objects in place; strict checks list every mismatch at once."""
        m, paths, skeleton = self._selected(ref, paths, map_location)
        captured, objects = capture(state)
        skeleton = strip_wrappers(rename_skeleton(skeleton, rename, captured), captured)
        resized: list = []
        skeleton = self._resolve_ranks(skeleton, m, objects, resized)
        skipped = [keys_path(k) for k, o in objects if o in resized and getattr(o, "on_resize", "") == "skip"]
        objects = [(k, o) for k, o in objects if keys_path(k) not in skipped]
        nodes = list(walk_skeleton(skeleton, containers=True))
        stored = {p: n for p, _, n in nodes if n.get("t") not in CONTAINER_NODES}
        containers = {p for p, _, n in nodes if n.get("t") in CONTAINER_NODES}
        live = {p: v for p, v in _live_leaves(captured).items() if not any(has_prefix(p, s) for s in skipped)}
        scope = None if paths is None else [_renamed(p, rename) for p in paths]
        classes = {_renamed(p, rename): c for p, c in m.classes.items()}
        check_restore(m, stored, containers, live, objects, scope, strict, classes)
        targets, devices = {}, {}
        for path, node in stored.items():
            if node.get("t") != "leaf" or path not in live:
                continue
            leaf = m.leaves[node["i"]]
            value = live[path]
            buf = live_buffer(value)
            if leaf.alias_of is None and buf is not None and buf[1] == leaf.dtype and list(buf[2]) == leaf.shape:
                targets[node["i"]] = (value, buf[3], buf[4])
            elif is_torch_tensor(value):
                devices[node["i"]] = value.device
        indices = [n["i"] for n in stored.values() if n.get("t") == "leaf"]
        values = self.read_values(m, indices, targets, map_location, allow_pickle, devices)
        loaded = unflatten(skeleton, values, f"version {m.version.id}")
        captured = merge(captured, loaded)
        restore_objects(captured, objects, state, module_strict=False,
                        where=f"version {m.version.id} (step {m.version.step})")
        rank, world = self._rank_world()
        for obj in resized:
            if callable(getattr(obj, "on_world_change", None)):
                obj.on_world_change(rank, world)
        return m.version

    def _resolve_ranks(self, node: dict, m: Manifest, objects, resized: list, path: str = ""):
        """Replace each "ranks" node by this rank's subtree. When the version was saved by a
        different number of ranks, the live object decides (see fp.RankLocal); with no live
        object (a load) the node stays a list of every saved rank's subtree."""
        t = node.get("t")
        if t in ("dict", "odict"):
            pairs = [(k, self._resolve_ranks(v, m, objects, resized, child_path(path, k)))
                     for k, v in zip(node["k"], node["v"])]
            pairs = [(k, v) for k, v in pairs if v is not None]
            return {"t": t, "k": [k for k, _ in pairs], "v": [v for _, v in pairs]}
        if t in ("list", "tuple"):
            return {"t": t, "v": [self._resolve_ranks(v, m, objects, resized, child_path(path, i))
                                  for i, v in enumerate(node["v"])]}
        if t != "ranks":
            return node
        rank, world = self._rank_world()
        if len(node["v"]) == world:
            return node["v"][rank]
        obj = next((o for k, o in objects if keys_path(k) == path), None)
        if obj is None:
            return node
        rule = "first" if callable(getattr(obj, "on_world_change", None)) else getattr(obj, "on_resize", "error")
        if rule == "error":
            raise StateMismatchError(
                f"version {m.version.id} was saved by {len(node['v'])} ranks and is restored on {world}: "
                f"rank-local state {path!r} has no rule for that; wrap it as fp.RankLocal(obj, "
                "on_resize='first'|'skip') or give it on_world_change(rank, world)")
        resized.append(obj)
        return node["v"][0] if rule == "first" else {"t": "dict", "k": [], "v": []}

class ReadCommands:
    """The reads of a Repo's public API, over `self.reader` (see repo.core)."""

    reader: Reader

    def readable(self, ref: str) -> Manifest:
        """The manifest of version `ref` for reading its data (see Reader.readable)."""
        return self.reader.readable(ref)

    def read_into(self, requests: list, vid: str) -> None:
        """Fill `requests` with version `vid`'s verified bytes (see Reader.read_into)."""
        self.reader.read_into(requests, vid)

    def load_block(self, ref: str, path: str, offset, shape):
        """The box of array leaf `path` of version `ref` at `offset` with `shape`, as a new numpy
        array; only the chunks (and the 1 MiB blocks of them) that meet the box are read."""
        return self.reader.load_block(ref, path, offset, shape)

    def load(self, ref: str = "main", paths: list[str] | None = None, map_location=None,
             allow_pickle: bool = False, mmap: bool = False, all_ranks: bool = False):
        """Return the state tree of `ref` (see Reader.load: map_location, mmap, all_ranks)."""
        return self.reader.load(ref, paths, map_location, allow_pickle, mmap, all_ranks)

    def restore(self, state, ref: str = "main", strict: bool = True, paths: list[str] | None = None,
                rename: dict[str, str] | None = None, map_location=None,
                allow_pickle: bool = False) -> Version:
        """Restore `ref` into live objects in place; strict checks list every mismatch at once."""
        return self.reader.restore(state, ref, strict, paths, rename, map_location, allow_pickle)


def _partly_filled(error: Exception, m: Manifest, targets: dict) -> Exception:
    """`error` (of its type) saying that a restore stopped by it had begun filling the live
    tensors `targets` in place, and what to do about it."""
    filled = sorted(m.leaves[i].path for i in targets)
    return type(error)(
        f"{error}\n  restore reads into the live tensors in place, so {len(filled)} of them "
        f"({listing(filled, shown=3)}) may now hold part of version {m.version.id} (no load_state_dict "
        "was called): restore an intact version into them (`forkpoint verify` lists the damaged ones; "
        "Checkpointer.resume falls back by itself) or rebuild them")


def _pickle_refused(path: str, vid: str) -> Exception:
    return UnsupportedTypeError(
        f"version {vid}: leaf {path!r} was stored with pickle; loading it could run code. "
        "Pass allow_pickle=True only if you trust this repository")


def _renamed(path: str, rename: dict | None) -> str:
    for old, new in (rename or {}).items():
        if has_prefix(path, old):
            return new + path[len(old.rstrip("/")):]
    return path


def _live_leaves(tree) -> dict:
    """Return {path: value} for every non-container value of a captured live tree."""
    out = {}

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, child_path(path, k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, child_path(path, i))
        else:
            out[path] = obj

    walk(tree, "")
    return out
