"""Flatten a state tree into a JSON skeleton plus a list of array leaves, and back.

Containers (dict, OrderedDict, list, tuple) and Python scalars live in the skeleton; tensors,
arrays, large bytes and (opt-in) pickled objects become leaves referenced by index.
"""

import argparse
import base64
import dataclasses
import datetime
import enum
import os
import pickle
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, UnsupportedTypeError
from ..format.paths import child_path
from ..format.validate import MAX_TREE_DEPTH
from .block import Block
from .leaves import LeafData, is_dtensor, numpy_leaf, torch_dtype, torch_leaf

INLINE_BYTES_MAX = 4096
CONTAINER_NODES = frozenset(("dict", "odict", "list", "tuple", "ranks"))


@dataclass(slots=True)
class FlatLeaf:
    """One leaf of a flattened tree: its path, typed keys and data (None for an alias)."""

    path: str
    keys: tuple
    data: LeafData | None
    alias_of: int | None = None


@dataclass(frozen=True)
class RankSlot:
    """Stands for a subtree whose value differs per rank; it becomes a "ranks" node that
    lists every rank's subtree (filled in by the coordinator of a distributed save)."""

    index: int


def _float_node(x: float) -> dict:
    return {"t": "float", "v": float(x).hex()}


def _tensor_identity(t):
    if is_dtensor(t):
        local = t.to_local()
        inner = _tensor_identity(local) if local.numel() else None
        return None if inner is None else ("dtensor", tuple(t.shape)) + inner
    if t.layout is not sys.modules["torch"].strided or t.is_quantized or t.is_nested:
        return None
    return t.data_ptr(), t.dtype, t.shape, t.stride(), t.device


def flatten(tree, allow_pickle: bool = False, copy: bool = False,
            device_capture=None) -> tuple[dict, list[FlatLeaf]]:
    """Return (skeleton, leaves). With copy=True every leaf's bytes are an independent copy;
    `device_capture` copies accelerator tensors in the background (see leaves.torch_leaf)."""
    flattener = _Flattener(allow_pickle, copy, device_capture)
    return flattener.walk(tree, "", ()), flattener.leaves


class _Flattener:
    """One flatten: the leaves found so far, and each array's first leaf by its memory (a
    second reference to the same memory becomes an alias of the first)."""

    def __init__(self, allow_pickle: bool, copy: bool, device_capture):
        self.allow_pickle, self.copy, self.device_capture = allow_pickle, copy, device_capture
        self.leaves: list[FlatLeaf] = []
        self.seen: dict = {}
        self.torch = sys.modules.get("torch")
        self.tensor_type = self.torch.Tensor if self.torch is not None else ()

    def add_leaf(self, path, keys, make, identity) -> dict:
        if identity is not None and identity in self.seen:
            self.leaves.append(FlatLeaf(path, keys, None, alias_of=self.seen[identity]))
        else:
            if identity is not None:
                self.seen[identity] = len(self.leaves)
            self.leaves.append(FlatLeaf(path, keys, make()))
        return {"t": "leaf", "i": len(self.leaves) - 1}

    def walk(self, obj, path: str, keys: tuple) -> dict:
        """The skeleton node of `obj` at `path` (its leaves added)."""
        if isinstance(obj, self.tensor_type):
            ident = _tensor_identity(obj) if obj.numel() else None
            return self.add_leaf(path, keys, lambda: torch_leaf(obj, path, self.copy, self.device_capture), ident)
        node = _value_node(obj)
        if node is not None:
            return node
        if isinstance(obj, Block):
            ident = ("block", id(obj.local)) if obj.local.size else None
            return self.add_leaf(path, keys, lambda: obj.leaf(path, self.copy), ident)
        if isinstance(obj, (np.ndarray, np.generic, bytes, bytearray)):
            return self.array_node(obj, path, keys)
        if isinstance(obj, (dict, list, tuple)):
            return self.container_node(obj, path, keys)
        return self.other_node(obj, path, keys)

    def array_node(self, obj, path: str, keys: tuple) -> dict:
        if isinstance(obj, np.ndarray):
            ident = None
            if obj.size:
                ident = (obj.__array_interface__["data"][0], obj.shape, obj.strides, obj.dtype.str)
            return self.add_leaf(path, keys, lambda: numpy_leaf(obj, path, self.copy), ident)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            return self.add_leaf(path, keys, lambda: numpy_leaf(np.asarray(obj), path, True, "numpy_scalar"), None)
        if not isinstance(obj, (bytes, bytearray)):  # another numpy scalar (a date, a void)
            return self.other_node(obj, path, keys)
        if len(obj) <= INLINE_BYTES_MAX:
            return {"t": "bytes", "v": base64.b64encode(bytes(obj)).decode()}
        data = np.frombuffer(bytes(obj), dtype=np.uint8)
        return self.add_leaf(path, keys, lambda: LeafData("bytes", "uint8", (len(obj),), "cpu", data), None)

    def container_node(self, obj, path: str, keys: tuple) -> dict:
        if len(keys) >= MAX_TREE_DEPTH:
            raise UnsupportedTypeError(f"state path {path!r} is nested deeper than {MAX_TREE_DEPTH} containers, "
                                       "the format's limit: flatten the state")
        if isinstance(obj, dict):
            ks = list(obj.keys())
            for k in ks:
                if not isinstance(k, (str, int)) or isinstance(k, np.generic):
                    raise UnsupportedTypeError(
                        f"state path {path or '/'!r} has a dict key {k!r} of type {type(k).__name__}; "
                        "forkpoint stores str and int keys"
                    )
            paths = [child_path(path, k) for k in ks]
            if len(set(paths)) < len(paths):
                _refuse_shared_path(path, ks, paths)
            return {"t": "odict" if isinstance(obj, OrderedDict) else "dict", "k": ks,
                    "v": [self.walk(obj[k], p, keys + (k,)) for k, p in zip(ks, paths)]}
        kind = "list" if isinstance(obj, list) else "tuple"
        return {"t": kind, "v": [self.walk(v, child_path(path, i), keys + (i,)) for i, v in enumerate(obj)]}

    def other_node(self, obj, path: str, keys: tuple) -> dict:
        torch = self.torch
        if torch is not None and isinstance(obj, torch.dtype):
            return {"t": "torch.dtype", "v": str(obj).removeprefix("torch.")}
        if torch is not None and isinstance(obj, torch.device):
            return {"t": "torch.device", "v": str(obj)}
        if self.allow_pickle:
            try:
                blob = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            except Exception as e:
                raise UnsupportedTypeError(f"state path {path or '/'!r}: cannot pickle "
                                           f"{type(obj).__qualname__}: {e}") from e
            return self.add_leaf(path, keys, lambda: LeafData("pickle", "uint8", (blob.size,), "cpu", blob), None)
        convert = plain_conversion(obj)
        name = str(keys[-1]) if keys and str(keys[-1]).isidentifier() else "value"
        ways = (f"store {convert.format(name)} instead (load returns that plain data)" if convert else
                _DATA_POSITION if _is_data_loading(obj) else
                "give it state_dict()/load_state_dict(), convert it to tensors/arrays/Python values")
        raise UnsupportedTypeError(
            f"state path {path or '/'!r} holds a value of type {type(obj).__module__}.{type(obj).__qualname__}, "
            f"which forkpoint does not store without pickle: {ways}, or pass allow_pickle=True on save and load")


def plain_conversion(obj) -> str | None:
    """The expression, `{}` standing for `obj`, that turns it into plain data forkpoint stores
    (`vars({})` for an argparse.Namespace, `dataclasses.asdict({})` for a dataclass...), or
    None when none is known."""
    klass = type(obj)
    names = {f"{c.__module__}.{c.__qualname__}" for c in klass.__mro__}
    if dataclasses.is_dataclass(obj):
        return "dataclasses.asdict({})"
    if isinstance(obj, enum.Enum):
        return "{}.value (or .name)"
    if isinstance(obj, (set, frozenset)):
        return "sorted({}) (or list)"
    if isinstance(obj, os.PathLike):
        return "str({})"
    if isinstance(obj, argparse.Namespace):
        return "vars({})"
    if isinstance(obj, (datetime.date, datetime.time, datetime.timedelta)):
        return "{}.total_seconds()" if isinstance(obj, datetime.timedelta) else "{}.isoformat()"
    if names & {"numpy.random._generator.Generator", "numpy.random.mtrand.RandomState"}:
        return "{}.bit_generator.state" if hasattr(obj, "bit_generator") else "{}.get_state()"
    if isinstance(obj, random.Random):
        return "{}.getstate()"
    if "torch._C.Generator" in names:
        return "{}.get_state()"
    if names & {"omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig"}:
        return "OmegaConf.to_container({}, resolve=True)"
    if callable(getattr(obj, "to_dict", None)):  # a transformers PretrainedConfig, a pandas Series
        return "{}.to_dict()"
    return None


_DATA_POSITION = ("to resume at the next unseen batch, build fp.ResumableLoader(dataset, batch_size=..., "
                  "shuffle=True, seed=...) in place of the DataLoader and store that")


def _is_data_loading(obj) -> bool:
    """Whether `obj` is a torch DataLoader, sampler or loader iterator (they hold no state of their own)."""
    return any(c.__module__.startswith("torch.utils.data") and c.__name__ in ("DataLoader", "Sampler", "_BaseDataLoaderIter")
               for c in type(obj).__mro__)


def _value_node(obj) -> dict | None:
    """The skeleton node of a plain value (None, bool, int, float, complex, str, a rank slot),
    or None for anything else."""
    if obj is None:
        return {"t": "none"}
    if isinstance(obj, bool):
        return {"t": "bool", "v": obj}
    if isinstance(obj, int) and not isinstance(obj, np.generic):
        return {"t": "int", "v": int(obj)}
    if isinstance(obj, float):
        return _float_node(obj)
    if isinstance(obj, complex):
        return {"t": "complex", "v": [obj.real.hex(), obj.imag.hex()]}
    if isinstance(obj, str):
        return {"t": "str", "v": obj}
    if isinstance(obj, RankSlot):
        return {"t": "ranks", "slot": obj.index}
    return None


def _refuse_shared_path(path: str, ks: list, paths: list[str]) -> None:
    """Raise UnsupportedTypeError for two keys of one dict whose paths are equal (an int key
    and its digits as a str: a restore could not tell their leaves apart)."""
    first: dict[str, object] = {}
    for k, p in zip(ks, paths):
        if p in first:
            raise UnsupportedTypeError(
                f"state path {path or '/'!r} has dict keys {first[p]!r} and {k!r}, which share the state "
                f"path {p!r}: rename one of them")
        first[p] = k


def unflatten(node, values: list, where: str = "manifest"):
    """Rebuild a tree from a skeleton; `values[i]` is the object for leaf i."""
    t = node.get("t") if isinstance(node, dict) else None
    if t == "leaf":
        return values[node["i"]]
    if t in ("dict", "odict"):
        cls = OrderedDict if t == "odict" else dict
        return cls((k, unflatten(v, values, where)) for k, v in zip(node["k"], node["v"]))
    if t in ("list", "ranks"):
        return [unflatten(v, values, where) for v in node["v"]]
    if t == "tuple":
        return tuple(unflatten(v, values, where) for v in node["v"])
    if t == "none":
        return None
    if t in ("bool", "int", "str"):
        return node["v"]
    if t == "float":
        return float.fromhex(node["v"])
    if t == "complex":
        return complex(float.fromhex(node["v"][0]), float.fromhex(node["v"][1]))
    if t == "bytes":
        return base64.b64decode(node["v"], validate=True)
    if t == "torch.dtype":
        return torch_dtype(node["v"], where)
    if t == "torch.device":
        import torch

        return torch.device(node["v"])
    raise FormatError(f"{where}: unknown tree node {node!r}")


def walk_skeleton(node, path: str = "", keys: tuple = (), containers: bool = False):
    """Yield (path, keys, node) for every leaf and scalar node of a skeleton (and, with
    `containers`, every dict, list and tuple node before its children)."""
    t = node.get("t")
    if containers and t in CONTAINER_NODES:
        yield path, keys, node
    if t in ("dict", "odict"):
        for k, v in zip(node["k"], node["v"]):
            yield from walk_skeleton(v, child_path(path, k), keys + (k,), containers)
    elif t in ("list", "tuple", "ranks"):
        for i, v in enumerate(node["v"]):
            yield from walk_skeleton(v, child_path(path, i), keys + (i,), containers)
    else:
        yield path, keys, node
