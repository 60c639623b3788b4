"""Capture live objects (modules, optimizers, providers) as trees, and restore trees into them.

An object is *stateful* when it has callable `state_dict` and `load_state_dict`. Capture
replaces each stateful object of the user's tree by its state_dict (whose tensors alias the
live ones); restore merges loaded values into that capture and hands each object its part.
"""

from collections import OrderedDict

import numpy as np

from ..errors import StateMismatchError
from ..format.paths import join_path
from .leaves import is_torch_tensor


def is_stateful(obj) -> bool:
    """True for objects that expose state_dict() and load_state_dict()."""
    return (not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)) and not is_torch_tensor(obj))


def is_module(obj) -> bool:
    """True for a torch.nn.Module (without importing torch)."""
    return any(c.__module__ == "torch.nn.modules.module" and c.__name__ == "Module"
               for c in type(obj).__mro__)


WRAPPERS = {("torch._dynamo", "OptimizedModule"): "_orig_mod",
            ("torch.nn.parallel", "DistributedDataParallel"): "module",
            ("torch.nn.parallel", "DataParallel"): "module"}
"""Modules that wrap another (torch.compile, DDP, DataParallel) and the attribute holding it."""


def unwrap(obj):
    """The module a torch.compile, DDP or DataParallel wrapper holds (its parameters are the
    same tensors), else `obj`: saved through it, a wrapped model's state has no "_orig_mod." or
    "module." before each key, so wrapped and plain models save and restore the same versions."""
    for klass in type(obj).__mro__:
        attribute = next((a for (where, name), a in WRAPPERS.items()
                          if klass.__name__ == name and klass.__module__.startswith(where)), None)
        if attribute is not None and getattr(obj, attribute, None) is not None:
            return unwrap(getattr(obj, attribute))
    return obj


def class_name(obj) -> str:
    """`module:qualname` of `obj`'s class, as a manifest's `classes` records it."""
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def another_class(was: str, now: str) -> bool:
    """Whether two class_name records name different classes by the rule forkpoint checks:
    both torch's (the user's own may be renamed freely) and of another class name (torch
    moves classes between modules across releases)."""
    return (was.startswith("torch.") and now.startswith("torch.")
            and was.rpartition(":")[2] != now.rpartition(":")[2])


def classes_of(objects: list[tuple[tuple, object]]) -> dict[str, str]:
    """{state path: class_name} of `capture`'s objects, as a manifest's `classes` holds them."""
    return {join_path(*keys): class_name(obj) for keys, obj in objects}


def capture(state) -> tuple[object, list[tuple[tuple, object]]]:
    """Return (tree with stateful objects replaced by their state_dicts, [(keys, object)])."""
    objects: list[tuple[tuple, object]] = []

    def walk(obj, keys):
        if is_stateful(obj):
            obj = unwrap(obj)
            objects.append((keys, obj))
            return obj.state_dict()
        if isinstance(obj, dict):
            out = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = walk(v, keys + (k,))
            return out
        if isinstance(obj, list):
            return [walk(v, keys + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return same_tuple(obj, [walk(v, keys + (i,)) for i, v in enumerate(obj)])
        return obj

    return walk(state, ()), objects


def same_tuple(like: tuple, items: list) -> tuple:
    """`items` as a tuple of the type of `like`: a namedtuple stays one (its fields in order)."""
    return like._make(items) if hasattr(like, "_fields") and hasattr(like, "_make") else tuple(items)


def get_at(tree, keys: tuple):
    """Return the value at typed `keys` in `tree` (KeyError/IndexError when absent)."""
    for k in keys:
        tree = tree[_key_in(tree, k)]
    return tree


def _key_in(container, key):
    if isinstance(container, dict):
        if key in container:
            return key
        alt = str(key) if isinstance(key, int) else (int(key) if str(key).lstrip("-").isdigit() else key)
        return alt if alt in container else key
    if isinstance(container, (list, tuple)):
        return int(key)
    raise KeyError(key)


def merge(live, loaded):
    """Merge `loaded` into `live`: containers in place, tensors/arrays copied into live memory."""
    if loaded is live:
        return live
    if isinstance(live, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            key = _key_in(live, k)
            live[key] = merge(live[key], v) if key in live else v
        return live
    if isinstance(live, (list, tuple)) and isinstance(loaded, dict):
        items = list(live)
        for k, v in loaded.items():
            items[int(k)] = merge(items[int(k)], v)
        if isinstance(live, list):
            live[:] = items
            return live
        return same_tuple(live, items)
    if isinstance(live, list) and isinstance(loaded, (list, tuple)) and len(live) == len(loaded):
        for i, v in enumerate(loaded):
            live[i] = merge(live[i], v)
        return live
    if isinstance(live, tuple) and isinstance(loaded, (list, tuple)) and len(live) == len(loaded):
        return same_tuple(live, [merge(a, b) for a, b in zip(live, loaded)])
    if is_torch_tensor(live) and is_torch_tensor(loaded):
        if live.shape == loaded.shape:
            import torch

            with torch.no_grad():
                live.copy_(loaded)
            return live
        return loaded
    if isinstance(live, np.ndarray) and isinstance(loaded, np.ndarray):
        if live.shape == loaded.shape and live.flags.writeable:
            np.copyto(live, loaded, casting="unsafe")
            return live
    return loaded


def restore_objects(captured, objects, state, module_strict: bool, where: str = "the version") -> None:
    """Hand each stateful object its merged subtree; update plain containers of `state` in
    place. An object that refuses its state is a StateMismatchError naming it and `where`."""
    for keys, obj in objects:
        sd = get_at(captured, keys)
        try:
            if is_module(obj):
                obj.load_state_dict(sd, strict=module_strict)
            else:
                obj.load_state_dict(sd)
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
            path = "/".join(map(str, keys)) or "the state"
            raise StateMismatchError(
                f"cannot restore {path!r} ({type(obj).__name__}) from {where}: its load_state_dict refused the "
                f"saved state ({type(e).__name__}: {e}). Build it as it was when saved (the same parameter "
                f"groups, options and parts), or leave it out with paths=[...]") from e
    if isinstance(state, (dict, list)) and not is_stateful(state):
        _write_back(state, captured)


def _write_back(live, captured):
    """Copy values of `captured` into the user's plain containers, leaving stateful objects alone."""
    items = live.items() if isinstance(live, dict) else enumerate(live)
    for k, v in list(items):
        if is_stateful(v):
            continue
        new = captured[k]
        if isinstance(v, (dict, list)) and isinstance(new, type(v)):
            _write_back(v, new)
        elif new is not v:
            live[k] = new
