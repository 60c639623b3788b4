"""Operations on skeletons: select subtrees by path prefix and move them (rename)."""

import copy

from ..errors import RefNotFoundError
from ..format.paths import child_path, has_prefix, split_path


def select(node: dict, prefixes, path: str = "") -> dict | None:
    """Return the part of `node` under any of `prefixes` (None when nothing matches)."""
    if prefixes is None:
        return node
    if any(has_prefix(path, p) for p in prefixes):
        return node
    t = node.get("t")
    if t in ("dict", "odict"):
        keys, vals = [], []
        for k, v in zip(node["k"], node["v"]):
            sub = select(v, prefixes, child_path(path, k))
            if sub is not None:
                keys.append(k)
                vals.append(sub)
        return {"t": t, "k": keys, "v": vals} if keys else None
    if t in ("list", "tuple"):
        items = {i: select(v, prefixes, child_path(path, i)) for i, v in enumerate(node["v"])}
        keys = [i for i, v in items.items() if v is not None]
        return {"t": "dict", "k": keys, "v": [items[i] for i in keys]} if keys else None
    return None


def _pop(node: dict, segments: list[str]):
    """Remove and return the subtree at `segments` (None when absent)."""
    if not segments:
        return None
    t = node.get("t")
    if t not in ("dict", "odict"):
        return None
    for i, k in enumerate(node["k"]):
        if str(k) == segments[0]:
            if len(segments) == 1:
                node["k"].pop(i)
                return node["v"].pop(i)
            return _pop(node["v"][i], segments[1:])
    return None


def _insert(node: dict, segments: list[str], sub: dict) -> None:
    for i, k in enumerate(node["k"]):
        if str(k) == segments[0]:
            if len(segments) == 1:
                node["v"][i] = sub
            else:
                _insert(node["v"][i], segments[1:], sub)
            return
    if len(segments) == 1:
        node["k"].append(segments[0])
        node["v"].append(sub)
    else:
        child = {"t": "dict", "k": [], "v": []}
        node["k"].append(segments[0])
        node["v"].append(child)
        _insert(child, segments[1:], sub)


def rename(node: dict, mapping: dict[str, str] | None) -> dict:
    """Move each subtree at an old prefix to its new prefix; raise if an old prefix is absent."""
    if not mapping:
        return node
    node = copy.deepcopy(node)
    moved = []
    for old, new in mapping.items():
        sub = node if old == "" else _pop(node, split_path(old))
        if sub is None:
            raise RefNotFoundError(f"rename: the version has nothing at {old!r}")
        if old == "":
            node = {"t": "dict", "k": [], "v": []}
        moved.append((new, sub))
    for new, sub in moved:
        if new == "":
            node = sub
        else:
            _insert(node, split_path(new), sub)
    return node
