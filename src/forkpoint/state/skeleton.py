"""Operations on skeletons: select subtrees by path prefix and move them (rename).

Prefixes may end at a '/' boundary or inside a module-style dotted key: `model/encoder`
covers `model/encoder/w` and the flat state_dict key `model/encoder.weight` alike.
"""

import copy

from ..errors import RefNotFoundError
from ..format.paths import child_path, has_prefix, split_path


def select(node: dict, prefixes, path: str = "") -> dict | None:
    """Return the part of `node` under any of `prefixes` (None when nothing matches)."""
    if prefixes is None:
        return node
    if path and any(has_prefix(path, p) for p in prefixes):
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
    if t in ("list", "tuple", "ranks"):
        items = {i: select(v, prefixes, child_path(path, i)) for i, v in enumerate(node["v"])}
        keys = [i for i, v in items.items() if v is not None]
        return {"t": "dict", "k": keys, "v": [items[i] for i in keys]} if keys else None
    return None


def _pop(node: dict, segments: list[str]):
    """Remove and return the subtree at `segments` (dotted keys gathered into a dict), or None."""
    if node.get("t") not in ("dict", "odict") or not segments:
        return None
    head = segments[0]
    for i, k in enumerate(node["k"]):
        if str(k) == head:
            if len(segments) == 1:
                node["k"].pop(i)
                return node["v"].pop(i)
            return _pop(node["v"][i], segments[1:])
    if len(segments) == 1:
        dotted = [i for i, k in enumerate(node["k"]) if str(k).startswith(head + ".")]
        if dotted:
            sub = {"t": "dict", "k": [str(node["k"][i])[len(head) + 1:] for i in dotted],
                   "v": [node["v"][i] for i in dotted]}
            for i in reversed(dotted):
                node["k"].pop(i)
                node["v"].pop(i)
            return sub
    return None


def _dotted_items(sub: dict, prefix: str):
    """Flatten a dict subtree into (prefix.key.key, leaf node) pairs."""
    if sub.get("t") not in ("dict", "odict"):
        yield prefix, sub
        return
    for k, v in zip(sub["k"], sub["v"]):
        yield from _dotted_items(v, f"{prefix}.{k}")


def _insert(node: dict, segments: list[str], sub: dict, live) -> None:
    head = segments[0]
    live_keys = [str(k) for k in live] if isinstance(live, dict) else []
    if len(segments) == 1 and head not in live_keys and any(k.startswith(head + ".") for k in live_keys):
        for key, leaf in _dotted_items(sub, head):
            node["k"].append(key)
            node["v"].append(leaf)
        return
    live_child = next((live[k] for k in live if str(k) == head), None) if isinstance(live, dict) else None
    for i, k in enumerate(node["k"]):
        if str(k) == head:
            if len(segments) == 1:
                node["v"][i] = sub
            else:
                _insert(node["v"][i], segments[1:], sub, live_child)
            return
    key = next((k for k in live if str(k) == head), head) if isinstance(live, dict) else head
    if len(segments) == 1:
        node["k"].append(key)
        node["v"].append(sub)
    else:
        child = {"t": "dict", "k": [], "v": []}
        node["k"].append(key)
        node["v"].append(child)
        _insert(child, segments[1:], sub, live_child)


def rename(node: dict, mapping: dict[str, str] | None, live=None) -> dict:
    """Move each subtree at an old prefix to its new prefix, matching `live`'s key layout."""
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
            _insert(node, split_path(new), sub, live)
    return node


COMPILED_PREFIX = "_orig_mod."
"""What torch.compile's wrapper module puts before each key of the state_dict it gives."""
PARALLEL_PREFIX = "module."
"""What DDP and DataParallel put before each key of the state_dict they give."""


def strip_wrappers(node: dict, live) -> dict:
    """`node` with the keys of each dict freed of the prefixes that wrapper modules add, where
    the live counterpart has none: "_orig_mod." (torch.compile) anywhere in a key, and a
    leading "module." (DDP) when every key has it and the keys without it are live keys.
    State saved from a wrapped model's state_dict (or a torch.save file of it) then restores
    into the plain module."""
    if node.get("t") not in ("dict", "odict") or not isinstance(live, dict):
        return node
    by_name = {str(k): v for k, v in live.items()}
    keys = node["k"]
    if any(isinstance(k, str) and COMPILED_PREFIX in k for k in keys) and not any(
            COMPILED_PREFIX in name for name in by_name):
        keys = _if_distinct(keys, [k.replace(COMPILED_PREFIX, "") if isinstance(k, str) else k for k in keys])
    if (keys and all(isinstance(k, str) and k.startswith(PARALLEL_PREFIX) for k in keys)
            and not any(name.startswith(PARALLEL_PREFIX) for name in by_name)):
        bare = [k[len(PARALLEL_PREFIX):] for k in keys]
        if set(bare) <= set(by_name):
            keys = bare
    values = [strip_wrappers(v, by_name.get(str(k))) for k, v in zip(keys, node["v"])]
    if keys is node["k"] and all(a is b for a, b in zip(values, node["v"])):
        return node
    return {**node, "k": keys, "v": values}


def _if_distinct(keys: list, renamed: list) -> list:
    """`renamed` unless two keys would become one."""
    return renamed if len(set(map(str, renamed))) == len(keys) else keys
