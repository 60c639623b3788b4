"""Leaf adapters: turn tensors and arrays into raw little-endian bytes and back.

torch is imported only when a torch object is met (or a torch leaf must be rebuilt), so
numpy-only users never load it.
"""

import sys
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import OutOfMemoryError, UnsupportedTypeError

NUMPY_KINDS = "biufc"


def is_torch_tensor(obj) -> bool:
    """True for a torch.Tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


@dataclass(slots=True)
class LeafData:
    """A leaf ready to store: format kind, dtype name, global shape, device and the bytes this
    process holds (uint8 array): the whole leaf, or the shard at `box` ((offsets, lengths)).
    `pending` is the device-to-host copy filling `data` (state.device.DeviceCopy) until it is
    over; `live_ptr` the address of the live memory the bytes come from (the device memory a
    pending copy reads; 0 where not recorded); `watch`, the live CPU tensor `data` aliases,
    and `version`, its in-place write counter when it was described; `unwatched`, True where
    `data` aliases live memory whose in-place writes nothing counts (a numpy array, an
    inference tensor), so only waiting for its copy keeps an asynchronous save exact."""

    kind: str
    dtype: str
    shape: tuple
    device: str
    data: np.ndarray
    box: tuple | None = None
    owner: bool = True
    itemsize: int = 0
    pending: object = None
    live_ptr: int = 0
    watch: object = None
    version: int = 0
    unwatched: bool = False

    def changed(self) -> bool:
        """Whether the live tensor `data` aliases was written in place since it was described,
        so a copy of `data` taken now may hold a later state (torch counts in-place writes)."""
        return self.watch is not None and self.watch._version != self.version

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) leaf."""
        if self.box is None:
            return int(self.data.nbytes)
        return self.itemsize * int(np.prod(self.shape, dtype=np.int64))

    @property
    def local_shape(self) -> tuple:
        """Shape of the bytes held here (the box's lengths for a shard)."""
        return tuple(self.box[1]) if self.box is not None else tuple(self.shape)

    @property
    def offsets(self) -> list[int]:
        """Where the held bytes start in the global shape."""
        return list(self.box[0]) if self.box is not None else [0] * len(self.shape)


_NUMPY_VIEW: dict = {}
_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """The format's name of torch dtype `dtype` ("float32", "bfloat16", ...)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _numpy_view(dtype):
    """The dtype to view a tensor of `dtype` as before .numpy() (itself when numpy has it, else
    the integer type of its size); None when there is none."""
    if dtype not in _NUMPY_VIEW:
        import torch

        view = dtype
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.empty(1, dtype=dtype).numpy()
        except (TypeError, RuntimeError):
            size = torch.empty(0, dtype=dtype).element_size()
            view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
        _NUMPY_VIEW[dtype] = view
    return _NUMPY_VIEW[dtype]


def plain_cpu(t) -> bool:
    """True for a dense, contiguous, non-empty CPU torch.Tensor or Parameter (no subclass, no
    conjugate or negative bit): its bytes are `host_bytes(t)` in place."""
    import torch

    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cpu and t.layout is torch.strided
            and not t.is_quantized and not t.is_nested and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and t.numel() > 0 and _numpy_view(t.dtype) is not None)


def host_bytes(t) -> np.ndarray:
    """The bytes of a `plain_cpu` tensor as a uint8 array over its memory (keeps it alive)."""
    if t.requires_grad:
        t = t.detach()
    view = _numpy_view(t.dtype)
    return np.frombuffer((t if view is t.dtype else t.view(view)).numpy(), np.uint8)


def is_dtensor(t) -> bool:
    """True for a torch.distributed DTensor (without importing torch.distributed)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def dtensor_layout(t):
    """(local tensor, global shape, box or None, owner) of a DTensor; None for other tensors.

    `box` is None when the local tensor is the whole (replicated) tensor; `owner` is False
    when another rank of a replicated mesh dimension holds the same shard."""
    if not is_dtensor(t):
        return None
    placements = t.placements
    if any(p.is_partial() for p in placements):
        raise UnsupportedTypeError(
            f"a DTensor with a Partial placement ({placements}) holds unreduced values; "
            "redistribute it to Shard or Replicate before saving")
    local = t.to_local()
    [chunk] = t.__create_chunk_list__()
    offsets, lengths = [int(x) for x in chunk.offsets], [int(x) for x in chunk.sizes]
    shape = tuple(int(x) for x in t.shape)
    coordinate = t.device_mesh.get_coordinate() or []
    sharded = any(p.is_shard() for p in placements)
    owner = not sharded or all(c == 0 for c, p in zip(coordinate, placements) if p.is_replicate())
    box = None if lengths == list(shape) else (offsets, lengths)
    return local, shape, box, owner


def torch_leaf(t, path: str, copy: bool, device_capture=None) -> LeafData:
    """Describe a tensor; the bytes alias it when it is a contiguous CPU tensor and copy is False.
    A DTensor is described by its global shape and the box of its local shard. An accelerator
    tensor is copied by `device_capture` (state.device.DeviceCapture) in the background when
    given and its pinned memory allows, else here."""
    if not copy and plain_cpu(t):
        counted = not t.is_inference()  # inference tensors keep no write counter
        return LeafData("torch", dtype_name(t.dtype), tuple(t.shape), "cpu", host_bytes(t), live_ptr=t.data_ptr(),
                        watch=t if counted else None, version=t._version if counted else 0,
                        unwatched=not counted)
    import torch

    layout = dtensor_layout(t)
    if layout is not None:
        local, shape, box, owner = layout
        leaf = torch_leaf(local, path, copy, device_capture)
        leaf.shape, leaf.box, leaf.owner, leaf.itemsize = shape, box, owner, local.element_size()
        return leaf

    if t.is_nested:
        raise UnsupportedTypeError(
            f"state path {path!r} holds a nested tensor ({t.dtype}, {t.layout}); forkpoint stores dense "
            "tensors: store its components (list(t.unbind())) or a padded copy (t.to_padded_tensor(0)) instead")
    dtype = dtype_name(t.dtype)
    quantized = t.is_quantized or dtype.startswith(("qint", "quint"))
    if quantized or t.is_sparse or t.layout != torch.strided:
        kind = "quantized" if quantized else "sparse" if "sparse" in str(t.layout) else f"{t.layout}"
        raise UnsupportedTypeError(
            f"state path {path!r} holds a {kind} tensor ({t.dtype}, {t.layout}); forkpoint stores dense, "
            "non-quantized tensors: convert it (e.g. .to_dense() / .dequantize()) first"
        )
    if t.is_meta:
        raise UnsupportedTypeError(
            f"state path {path!r} is a meta tensor ({t.dtype}, shape {list(t.shape)}): it has no data "
            "to store; materialize it first (e.g. module.to_empty(device=...) and initialize or load it)")
    on_host = t.device.type == "cpu"
    device = "cpu" if on_host else str(t.device)
    src = t.detach()
    if not on_host and device_capture is not None:
        live = src.resolve_conj().resolve_neg().contiguous()
        pending = device_capture.copy(live)
        if pending is not None:
            return LeafData("torch", dtype, tuple(t.shape), device, pending.host.numpy(),
                            pending=pending, live_ptr=src.data_ptr())
    if not on_host:
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
    return LeafData("torch", dtype, tuple(t.shape), device, flat.numpy())


def numpy_leaf(a: np.ndarray, path: str, copy: bool, kind: str = "numpy") -> LeafData:
    """Describe a numpy array or scalar; bytes alias the array when possible and copy is False."""
    if a.dtype.kind not in NUMPY_KINDS or a.dtype.fields is not None:
        raise UnsupportedTypeError(
            f"state path {path!r} holds a numpy array of dtype {a.dtype}; forkpoint stores bool, "
            "integer, float and complex arrays without pickle (pass allow_pickle=True for others)"
        )
    live = a
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.array(a, copy=True, order="C") if copy else np.asarray(a, order="C")
    return LeafData(kind, a.dtype.name, tuple(a.shape), "cpu", a.reshape(-1).view(np.uint8),
                    unwatched=not copy and a.size > 0 and np.may_share_memory(a, live))


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
    """Allocate an uninitialised leaf; return (object, its bytes as a writable uint8 array).
    OutOfMemoryError naming the leaf where this process cannot allocate it."""
    try:
        return _empty_leaf(kind, dtype, shape, path)
    except (MemoryError, RuntimeError, ValueError) as e:
        if isinstance(e, OutOfMemoryError) or "memory" not in str(e).lower() and "too big" not in str(e).lower():
            raise
        raise OutOfMemoryError(f"leaf {path!r} ({dtype}, shape {list(shape)}) cannot be allocated in this "
                               f"process ({e}); load a part of it (paths=, or a box) or use more memory") from None


def _empty_leaf(kind: str, dtype: str, shape, path: str):
    if kind == "torch":
        import torch

        t = torch.empty(tuple(shape), dtype=torch_dtype(dtype, path), device="cpu")
        if plain_cpu(t):
            return t, host_bytes(t)
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return t, flat.numpy()
    if kind in ("numpy", "numpy_scalar"):
        a = np.empty(tuple(shape), dtype=np.dtype(dtype))
        return a, a.reshape(-1).view(np.uint8)
    if kind in ("bytes", "pickle"):
        a = np.empty(int(np.prod(shape)), dtype=np.uint8)
        return a, a
    raise UnsupportedTypeError(f"leaf {path!r} has kind {kind!r}, unknown to this forkpoint")


def leaf_over(kind: str, dtype: str, shape, data: np.ndarray, path: str):
    """A tensor or array of `kind` that uses the bytes `data` in place (no copy), or None for
    kinds that cannot."""
    if kind == "torch":
        import torch

        dt = torch_dtype(dtype, path)
        if not data.size:
            return torch.empty(tuple(shape), dtype=dt)
        return torch.frombuffer(data, dtype=torch.uint8).view(dt).reshape(tuple(shape))
    if kind == "numpy":
        return data.view(np.dtype(dtype)).reshape(tuple(shape))
    return None


def check_map_location(map_location, present: bool = True) -> None:
    """Raise, before anything is read, on a map_location torch.load would not take (a dtype,
    a number), a device string torch does not parse, or (with `present`) a device this machine
    lacks. A dict's targets are checked for presence only when a leaf goes there."""
    if map_location is None:
        return
    if isinstance(map_location, dict):
        for target in map_location.values():
            check_map_location(target, present=False)
        return
    if callable(map_location):
        return
    if not isinstance(map_location, str) and type(map_location).__name__ != "device":
        raise TypeError(f"map_location={map_location!r} is not a device (e.g. 'cpu', 'cuda:0', "
                        "torch.device(...)), a dict from saved device to device, or a function "
                        "f(tensor, saved_device); to change dtypes, convert after loading")
    import torch

    try:
        device = torch.device(map_location)
    except RuntimeError as e:
        raise ValueError(f"map_location={map_location!r} is not a device torch knows: {e}") from None
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if present and device.type not in ("cpu", "meta") and callable(available) and not available():
        raise ValueError(f"map_location={map_location!r}, but this machine has no {device.type} device "
                         f"(torch.{device.type}.is_available() is False): load with map_location='cpu'")


def finish_leaf(kind: str, obj, device: str, map_location, allow_pickle: bool, path: str):
    """Turn a filled buffer into the user-facing value (device move, scalar, bytes, unpickle)."""
    if kind == "torch":
        target = map_location if map_location is not None else "cpu"
        if isinstance(target, dict):
            target = target.get(device, device)
        if callable(target):
            return target(obj, device)
        if str(target) == "cpu":
            return obj
        check_map_location(target)
        return obj.to(target)
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
    """Return (kind, dtype, global shape, uint8 view, box) of a live CPU leaf writable in place
    (box: where a DTensor's local shard sits, None for a whole tensor), else None."""
    if is_torch_tensor(obj):
        import torch

        layout = dtensor_layout(obj)
        if layout is not None:
            local, shape, box, _ = layout
            inner = live_buffer(local)
            return None if inner is None else (inner[0], inner[1], shape, inner[3], box)
        if plain_cpu(obj):
            return "torch", dtype_name(obj.dtype), tuple(obj.shape), host_bytes(obj), None
        if (obj.device.type != "cpu" or not obj.is_contiguous() or obj.is_conj() or obj.is_neg()
                or obj.layout != torch.strided or obj.is_quantized or obj.is_nested):
            return None
        t = obj.detach()
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return "torch", dtype_name(obj.dtype), tuple(obj.shape), flat.numpy(), None
    if callable(getattr(obj, "live_buffer", None)):  # a state.block.Block
        return obj.live_buffer()
    if isinstance(obj, np.ndarray) and obj.flags.c_contiguous and obj.flags.writeable:
        if obj.dtype.kind in NUMPY_KINDS and obj.dtype.byteorder != ">":
            return "numpy", obj.dtype.name, tuple(obj.shape), obj.reshape(-1).view(np.uint8), None
    return None
