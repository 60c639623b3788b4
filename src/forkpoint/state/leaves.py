"""Leaf adapters: turn tensors and arrays into raw little-endian bytes and back.

torch is imported only when a torch object is met (or a torch leaf must be rebuilt), so
numpy-only users never load it.
"""

import sys
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedTypeError

NUMPY_KINDS = "biufc"


def is_torch_tensor(obj) -> bool:
    """True for a torch.Tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


@dataclass
class LeafData:
    """A leaf ready to store: format kind, dtype name, shape, device and its bytes (uint8 array)."""

    kind: str
    dtype: str
    shape: tuple
    device: str
    data: np.ndarray


def torch_leaf(t, path: str, copy: bool) -> LeafData:
    """Describe a tensor; the bytes alias it when it is a contiguous CPU tensor and copy is False."""
    import torch

    quantized = t.is_quantized or str(t.dtype).startswith(("torch.qint", "torch.quint"))
    if quantized or t.is_sparse or t.layout != torch.strided:
        raise UnsupportedTypeError(
            f"state path {path!r} holds a {'quantized' if quantized else 'sparse'} "
            f"tensor ({t.dtype}, {t.layout}); forkpoint stores dense, non-quantized tensors: convert it "
            "(e.g. .to_dense() / .dequantize()) first"
        )
    device = str(t.device)
    src = t.detach()
    if src.device.type != "cpu":
        src = src.to("cpu")
    elif copy:
        src = src.clone(memory_format=torch.contiguous_format)
    if not src.is_contiguous():
        src = src.contiguous()
    if src.is_conj():
        src = src.resolve_conj()
    if src.is_neg():
        src = src.resolve_neg()
    flat = src.reshape(-1).view(torch.uint8) if src.numel() else torch.empty(0, dtype=torch.uint8)
    return LeafData("torch", str(t.dtype).removeprefix("torch."), tuple(t.shape), device, flat.numpy())


def numpy_leaf(a: np.ndarray, path: str, copy: bool, kind: str = "numpy") -> LeafData:
    """Describe a numpy array or scalar; bytes alias the array when possible and copy is False."""
    if a.dtype.kind not in NUMPY_KINDS or a.dtype.fields is not None:
        raise UnsupportedTypeError(
            f"state path {path!r} holds a numpy array of dtype {a.dtype}; forkpoint stores bool, "
            "integer, float and complex arrays without pickle (pass allow_pickle=True for others)"
        )
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.array(a, copy=True, order="C") if copy else np.asarray(a, order="C")
    return LeafData(kind, a.dtype.name, tuple(a.shape), "cpu", a.reshape(-1).view(np.uint8))


def torch_dtype(name: str, path: str):
    """Return the torch dtype called `name`, or raise naming the leaf."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedTypeError(
            f"leaf {path!r} has torch dtype {name!r}, which this torch ({torch.__version__}) lacks"
        )
    return dtype


def empty_leaf(kind: str, dtype: str, shape, device: str, path: str):
    """Allocate an uninitialised leaf; return (object, its bytes as a writable uint8 array)."""
    if kind == "torch":
        import torch

        t = torch.empty(tuple(shape), dtype=torch_dtype(dtype, path), device="cpu")
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return t, flat.numpy()
    if kind in ("numpy", "numpy_scalar"):
        a = np.empty(tuple(shape), dtype=np.dtype(dtype))
        return a, a.reshape(-1).view(np.uint8)
    if kind in ("bytes", "pickle"):
        a = np.empty(int(np.prod(shape)), dtype=np.uint8)
        return a, a
    raise UnsupportedTypeError(f"leaf {path!r} has kind {kind!r}, unknown to this forkpoint")


def finish_leaf(kind: str, obj, device: str, map_location, allow_pickle: bool, path: str):
    """Turn a filled buffer into the user-facing value (device move, scalar, bytes, unpickle)."""
    if kind == "torch":
        target = map_location if map_location is not None else "cpu"
        if callable(target):
            return target(obj, device)
        return obj if str(target) == "cpu" else obj.to(target)
    if kind == "numpy_scalar":
        return obj[()]
    if kind == "bytes":
        return obj.tobytes()
    if kind == "pickle":
        if not allow_pickle:
            raise UnsupportedTypeError(
                f"leaf {path!r} was stored with pickle; loading it would run code. Pass "
                "allow_pickle=True only if you trust this repository"
            )
        import pickle

        return pickle.loads(obj.tobytes())
    return obj


def live_buffer(obj):
    """Return (kind, dtype, shape, uint8 view) of a live CPU leaf writable in place, else None."""
    if is_torch_tensor(obj):
        import torch

        if (obj.device.type != "cpu" or not obj.is_contiguous() or obj.is_conj() or obj.is_neg()
                or obj.layout != torch.strided or obj.is_quantized):
            return None
        t = obj.detach()
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return "torch", str(obj.dtype).removeprefix("torch."), tuple(obj.shape), flat.numpy()
    if isinstance(obj, np.ndarray) and obj.flags.c_contiguous and obj.flags.writeable:
        if obj.dtype.kind in NUMPY_KINDS and obj.dtype.byteorder != ">":
            return "numpy", obj.dtype.name, tuple(obj.shape), obj.reshape(-1).view(np.uint8)
    return None
