"""Fingerprints of what a training loop's next steps depend on: a digest per piece of state,
so two processes can say which piece differs without exchanging the state itself."""

import functools
import hashlib
import random
import struct
import sys
import types

import numpy as np

from ..state.stateful import is_stateful


def _digest(parts: list[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return h.hexdigest()


def value_digest(obj, depth: int = 0) -> str | None:
    """A digest of `obj`'s value (tensors by bytes, dtype and shape; containers by content;
    objects with state_dict() by it); None for what cannot be read without changing it
    (an iterator, a generator) or nests deeper than 20."""
    if depth > 20:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _digest([b"tensor", str(t.dtype).encode(), str(list(t.shape)).encode(), raw])
    if isinstance(obj, np.ndarray):
        return _digest([b"array", str(obj.dtype).encode(), str(obj.shape).encode(), np.ascontiguousarray(obj).tobytes()])
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, np.generic)):
        return _digest([b"scalar", type(obj).__name__.encode(), repr(obj).encode()])
    if isinstance(obj, dict):
        parts = [b"dict"]
        for k in sorted(obj, key=repr):
            d = value_digest(obj[k], depth + 1)
            if d is None:
                return None
            parts += [repr(k).encode(), d.encode()]
        return _digest(parts)
    if isinstance(obj, (list, tuple)):
        parts = [type(obj).__name__.encode()]
        for v in obj:
            d = value_digest(v, depth + 1)
            if d is None:
                return None
            parts.append(d.encode())
        return _digest(parts)
    if is_stateful(obj):
        return value_digest(obj.state_dict(), depth + 1)
    if isinstance(obj, (types.GeneratorType, types.FunctionType, types.ModuleType, type)):
        return None
    fields = getattr(obj, "__dict__", None)
    if isinstance(fields, dict) and fields:
        plain = {k: v for k, v in fields.items() if not k.startswith("__")}
        return value_digest(plain, depth + 1)
    return None


def rng_fingerprints() -> dict[str, str]:
    """Digests of the global random streams: Python, numpy, torch CPU and each CUDA device."""
    out = {"Python RNG": value_digest(list(random.getstate()[1])),
           "numpy RNG": value_digest(np.random.get_state()[1])}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch RNG"] = value_digest(torch.get_rng_state())
        if torch.cuda.is_available():
            out["CUDA RNG"] = value_digest(torch.cuda.get_rng_state_all())
    return out


def object_kind(obj) -> str:
    """What a piece of loop state is, in the words of the audit's diagnosis."""
    torch = sys.modules.get("torch")
    names = {c.__name__ for c in type(obj).__mro__}
    if names & {"LRScheduler", "_LRScheduler", "ReduceLROnPlateau"}:
        return "LR scheduler"
    if "GradScaler" in names:
        return "GradScaler"
    if names & {"Sampler", "DataLoader", "ResumableSampler", "_BaseDataLoaderIter"} or \
            isinstance(obj, (types.GeneratorType,)) or type(obj).__name__.endswith("iterator"):
        return "sampler or data-loader position"
    if torch is not None and isinstance(obj, torch.nn.Module):
        return "module"
    if torch is not None and isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return "a Python counter in the loop"
    return type(obj).__name__


def loop_objects(fn, extra: dict | None = None) -> dict[str, object]:
    """The objects a step function can reach: its closure cells and the module globals it
    names (and their attributes one level down), plus `extra` by name."""
    found: dict[str, object] = dict(extra or {})
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                found.setdefault(name, cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        module_globals = getattr(fn, "__globals__", {})
        for name in code.co_names:
            if name in module_globals:
                value = module_globals[name]
                if not isinstance(value, (types.ModuleType, types.FunctionType, type, types.BuiltinFunctionType)):
                    found.setdefault(name, value)
    return found
