"""How the ranks' parts of a collective save become one manifest: which rank writes which
piece of a replicated leaf, the pack key that keeps replicated packs identical on every node,
the layout every rank must share, and the assembly of rank 0's leaf table with every rank's
chunks and rank-local subtrees (DistSaveError naming what the ranks disagree on).
"""

import dataclasses
import json

import blake3

from ..engine.save import row_split
from ..format.manifest import Chunk, Leaf, Manifest, Version
from ..state import RankSlot
from ..state.stateful import get_at
from .coordinator import DistSaveError


def split_rank_local(tree, objects) -> tuple[object, list]:
    """Replace each outermost rank-local object's subtree of a captured tree by a RankSlot;
    return (tree, [the subtrees in slot order])."""
    marked = sorted((keys for keys, obj in objects if getattr(obj, "rank_local", False)), key=len)
    taken, subtrees = [], []
    for keys in marked:
        if any(keys[:len(t)] == t for t in taken):
            continue
        if not keys:
            raise ValueError("the whole state is rank-local: save it with fp.Repo on each rank instead")
        parent = get_at(tree, keys[:-1])
        subtrees.append(parent[keys[-1]])
        parent[keys[-1]] = RankSlot(len(taken))
        taken.append(keys)
    return tree, subtrees


def writer_class(shared: list):
    """The pack key of a distributed save's leaves: replicated, sharded or rank-local (leaf
    indices past `shared`), so that a pack of replicated leaves is the same bytes on every
    node that writes one."""
    def key(i: int) -> str:
        if i >= len(shared):
            return "rank-local"
        return "replicated" if shared[i].data.box is None else "sharded"
    return key


def assign_replicated(flat, opts, world: int, whole_small: bool = False) -> dict[tuple[int, int], int]:
    """Give each piece of a replicated leaf ({(leaf index, first row): rank}) to one rank,
    largest first to the least-loaded rank; every rank computes the same answer. With
    `whole_small`, every small leaf goes to rank 0, so that its packs are the same bytes
    whatever the number of writers (one copy per node)."""
    units, owner = [], {}
    for i, fl in enumerate(flat):
        d = fl.data
        if d is None or d.box is not None:
            continue
        n = int(d.data.nbytes)
        if n < opts.small_leaf_bytes or not d.shape:
            if whole_small:
                owner[(i, 0)] = 0
            else:
                units.append((n, i, 0))
            continue
        row = n // d.shape[0] if d.shape[0] else 0
        units.extend((count * row, i, first) for first, count in row_split(d.shape, n, opts.chunk_bytes))
    load = [0] * world
    for n, i, first in sorted(units, key=lambda u: (-u[0], u[1], u[2])):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[(i, first)] = rank
        load[rank] += n
    return owner


def layout_fingerprint(flat) -> str:
    """A digest of the shared leaves' paths, kinds, dtypes and global shapes (equal on every rank)."""
    desc = [(fl.path, fl.alias_of) if fl.data is None else
            (fl.path, fl.data.kind, fl.data.dtype, list(fl.data.shape)) for fl in flat]
    return blake3.blake3(json.dumps(desc).encode()).hexdigest()[:32]


def assemble_manifest(record: Version, skeleton, leaves: list[Leaf], parts: list[dict],
                      allow_pickle: bool) -> Manifest:
    """One manifest from rank 0's shared leaf table and every rank's part."""
    if len({p["layout"] for p in parts}) != 1:
        counts = ", ".join(f"rank {r}: {p.get('leaves', '?')}" for r, p in enumerate(parts))
        raise DistSaveError("ranks saved differently structured states (paths, dtypes or shapes differ; "
                            f"shared leaves per rank: {counts}); every rank must pass the same state tree")
    calls = [p.get("call", {"branch": record.branch, "step": record.step}) for p in parts]
    steps = {c["step"] for c in calls if c["step"] is not None}
    if len(steps) > 1 or any(c["branch"] != record.branch for c in calls):
        said = ", ".join(f"rank {r}: branch {c['branch']!r} step {c['step']!r}" for r, c in enumerate(calls))
        raise DistSaveError(f"ranks asked for different saves ({said}); every rank must pass the same branch "
                            "and step (or step=None: the others' step)")
    if steps and record.step is None:
        record = dataclasses.replace(record, step=steps.pop())
    leaves = [Leaf.from_json(leaf.to_json()) for leaf in leaves]
    for leaf in leaves:
        leaf.chunks = []
    for part in parts:
        for i, chunks in part["chunks"].items():
            leaves[int(i)].chunks.extend(Chunk(**c) for c in chunks)
    for leaf in leaves:
        leaf.chunks = _one_copy_each(leaf)
    for leaf in leaves:
        leaf.chunks.sort(key=lambda c: c.offsets)
        if leaf.alias_of is None:
            covered = sum(_count(c.lengths) for c in leaf.chunks)
            if covered != _count(leaf.shape):
                raise DistSaveError(f"leaf {leaf.path!r}: the ranks' shards cover {covered} of "
                                    f"{_count(leaf.shape)} elements; shards overlap or are missing")
    slots = []
    for part in parts:
        base = len(leaves)
        for d in part["local_leaves"]:
            leaf = Leaf.from_json(d)
            if leaf.alias_of is not None:
                leaf.alias_of += base
            leaves.append(leaf)
        slots.append([_renumber(node, base) for node in part["local_tree"]["v"]])
    tree = _fill_slots(skeleton, slots)
    record.logical_bytes = sum(leaf.nbytes for leaf in leaves if leaf.alias_of is None)
    record.stored_bytes = sum(p["stored_bytes"] for p in parts)
    has_pickle = any(leaf.kind == "pickle" for leaf in leaves)
    return Manifest(record, tree, leaves, pickle=allow_pickle and has_pickle)


def _one_copy_each(leaf: Leaf) -> list[Chunk]:
    """A leaf's chunks with copies of the same box (each node writes the replicated state)
    listed once; DistSaveError when two ranks hold different values for one box."""
    by_box: dict = {}
    for c in leaf.chunks:
        box = (tuple(c.offsets), tuple(c.lengths))
        first = by_box.setdefault(box, c)
        if first.hash != c.hash:
            raise DistSaveError(f"leaf {leaf.path!r}: ranks hold different values for the box at "
                                f"{list(box[0])} (replicated state differs between ranks)")
    return list(by_box.values())


def _count(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def _renumber(node, base: int):
    if isinstance(node, dict):
        out = {k: _renumber(v, base) for k, v in node.items()}
        if node.get("t") == "leaf":
            out["i"] = node["i"] + base
        return out
    if isinstance(node, list):
        return [_renumber(v, base) for v in node]
    return node


def _fill_slots(node, slots: list[list]):
    if isinstance(node, dict):
        if node.get("t") == "ranks" and "slot" in node:
            return {"t": "ranks", "v": [rank_slots[node["slot"]] for rank_slots in slots]}
        return {k: _fill_slots(v, slots) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill_slots(v, slots) for v in node]
    return node
