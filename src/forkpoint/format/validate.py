"""The schema of a version manifest: every field, tree node and chunk box checked before use.

A manifest read from storage is untrusted input. `check_record` checks the version record
(ids, lineage, numbers), `check_manifest` also the skeleton and the leaf table: kinds and
dtypes known, sizes consistent, and each leaf's chunk boxes tiling its global shape exactly
(no gap, no overlap, inside the bounds). Limits keep a hostile manifest from costing
unbounded memory or recursion. Failures raise FormatError naming the manifest, the leaf path
or tree path, and what was wrong.
"""

import base64
import binascii
import math
import re

import numpy as np

from ..errors import FormatError
from .dtypes import DTYPE_ITEMSIZE, LEAF_KINDS

MAX_TREE_DEPTH = 200
MAX_LEAVES = 5_000_000
MAX_DIMS = 64
MAX_NAME_CHARS = 4096
MAX_LEAF_BYTES = 1 << 50
MAX_CHUNKS_PER_LEAF = 1_000_000
MAX_DELTA_CHAIN = 1024
MAX_PARENTS = 64
MAX_INLINE_BYTES = 4096
MAX_CLASSES = 100_000
_GRID_CELLS_MAX = 1 << 22
_PAIRWISE_MAX = 4096

_VERSION_ID = re.compile(r"^[0-9a-f]{1,64}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_HEX_FLOAT = re.compile(r"^-?(0x[0-9a-f]+(\.[0-9a-f]*)?p[+-]?\d+|nan|inf)$")
_SCALAR_NODES = {"none": None, "bool": bool, "int": int, "str": str}
_DEVICE = re.compile(r"^[a-z_]{1,32}(:\d{1,6})?$")


def is_version_id(value) -> bool:
    """True for a version id as this format names one: hex digits, at most 64."""
    return isinstance(value, str) and _VERSION_ID.match(value) is not None


def is_digest(value) -> bool:
    """True for an object name: 64 lowercase hex digits."""
    return isinstance(value, str) and _DIGEST.match(value) is not None


def check_record(record: dict, where: str) -> None:
    """Raise FormatError unless the version fields of a manifest (or stub) are well formed."""
    def bad(what):
        raise FormatError(f"manifest {where}: {what}; the file is damaged or was not written by forkpoint")

    if not is_version_id(record.get("id")):
        bad(f"id {str(record.get('id'))[:80]!r} is not a version id (hex digits)")
    parents = record.get("parents", [])
    if not isinstance(parents, list) or len(parents) > MAX_PARENTS or not all(map(is_version_id, parents)):
        bad(f"parents {str(parents)[:120]} is not a list of at most {MAX_PARENTS} version ids")
    if record.get("id") in parents:
        bad("the version names itself as its parent")
    branch = record.get("branch", "")
    if not isinstance(branch, str) or len(branch) > MAX_NAME_CHARS:
        bad("branch is not a string")
    step = record.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        bad(f"step {step!r} is not an integer")
    for name in ("time", "logical_bytes", "stored_bytes"):
        value = record.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            bad(f"{name} {value!r} is not a number")
    for name in ("metrics", "meta", "env"):
        if not isinstance(record.get(name, {}), dict):
            bad(f"{name} is not a JSON object")
    if not isinstance(record.get("message", ""), str):
        bad("message is not a string")
    if not isinstance(record.get("pruned", False), bool) or not isinstance(record.get("pickle", False), bool):
        bad("pruned/pickle are not booleans")
    if not isinstance(record.get("tiers", []), list):
        bad("tiers is not a list")


def check_manifest(record: dict, where: str) -> None:
    """Raise FormatError unless a whole manifest record (version fields, skeleton and leaf
    table) is well formed and every leaf's chunks tile its shape exactly."""
    check_record(record, where)
    leaves = record.get("leaves", [])
    if not isinstance(leaves, list) or len(leaves) > MAX_LEAVES:
        raise FormatError(f"manifest {where}: the leaf table is not a list of at most {MAX_LEAVES} leaves")
    if record.get("pruned"):
        if leaves:
            raise FormatError(f"manifest {where}: a pruned record holds {len(leaves)} leaves")
        return
    for i, leaf in enumerate(leaves):
        check_leaf(leaf, i, leaves, where)
    check_tree(record.get("tree"), len(leaves), where)
    check_classes(record.get("classes", {}), where)


def check_classes(classes, where: str) -> None:
    """Raise FormatError unless `classes` (1.4) maps at most MAX_CLASSES state paths to class
    names, all strings of at most MAX_NAME_CHARS."""
    if not isinstance(classes, dict) or len(classes) > MAX_CLASSES or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_NAME_CHARS and len(v) <= MAX_NAME_CHARS
            for k, v in classes.items()):
        raise FormatError(f"manifest {where}: classes is not an object of at most {MAX_CLASSES} state paths "
                          "to class names; the file is damaged or was not written by forkpoint")


def check_tree(node, leaf_count: int, where: str) -> None:
    """Raise FormatError unless `node` is a skeleton of known nodes, at most MAX_TREE_DEPTH
    deep, whose leaf indices are within the leaf table."""
    stack = [(node, None, 0)]  # trail: (parent trail, key), joined into a path only for errors
    while stack:
        node, trail, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            _bad_node(where, trail, f"the state tree is nested deeper than {MAX_TREE_DEPTH}")
        t = node.get("t") if type(node) is dict else None
        if t == "leaf":
            i = node.get("i")
            if type(i) is not int or not 0 <= i < leaf_count:
                _bad_node(where, trail, f"leaf index {i!r} is outside the leaf table (0..{leaf_count - 1})")
        elif t == "dict" or t == "odict":
            keys, values = node.get("k"), node.get("v")
            if type(keys) is not list or type(values) is not list or len(keys) != len(values):
                _bad_node(where, trail, "a dict node needs key and value lists of one length")
            for k, v in zip(keys, values):
                if type(k) is not str and type(k) is not int or type(k) is str and len(k) > MAX_NAME_CHARS:
                    _bad_node(where, trail, f"dict key {str(k)[:80]!r} is not a string or integer")
                stack.append((v, (trail, k), depth + 1))
        elif t == "list" or t == "tuple" or t == "ranks":
            values = node.get("v")
            if type(values) is not list:
                _bad_node(where, trail, f"a {t} node needs a list of values")
            stack.extend((v, (trail, i), depth + 1) for i, v in enumerate(values))
        else:
            _check_value_node(node, t if type(t) is str else None, trail, where)


def _check_value_node(node, t, path, where: str) -> None:
    v = node.get("v") if isinstance(node, dict) else None
    if t in _SCALAR_NODES:
        kind = _SCALAR_NODES[t]
        if kind is None:
            return
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            _bad_node(where, path, f"a {t} node holds {str(v)[:80]!r}")
    elif t == "float":
        if not _is_hex_float(v):
            _bad_node(where, path, f"a float node holds {str(v)[:80]!r}, not a hex float")
    elif t == "complex":
        if not (isinstance(v, list) and len(v) == 2 and all(map(_is_hex_float, v))):
            _bad_node(where, path, f"a complex node holds {str(v)[:80]!r}, not two hex floats")
    elif t == "bytes":
        if not isinstance(v, str) or len(v) > 4 * (MAX_INLINE_BYTES // 3 + 1):
            _bad_node(where, path, "a bytes node holds no base64 string of at most 4096 bytes")
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            _bad_node(where, path, f"a bytes node holds {v[:80]!r}, not base64")
    elif t == "torch.dtype":
        if not isinstance(v, str) or v not in DTYPE_ITEMSIZE:
            _bad_node(where, path, f"a torch.dtype node names {str(v)[:80]!r}, not a dtype")
    elif t == "torch.device":
        if not isinstance(v, str) or not _DEVICE.match(v):
            _bad_node(where, path, f"a torch.device node names {str(v)[:80]!r}, not a device")
    else:
        _bad_node(where, path, f"unknown node {str(node)[:120]}")


def _is_hex_float(v) -> bool:
    return isinstance(v, str) and len(v) < 64 and _HEX_FLOAT.match(v) is not None


def _bad_node(where: str, trail, what: str):
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(str(key))
    path = "/".join(reversed(keys))
    raise FormatError(f"manifest {where}, state path {path or '/'!r}: {what}; the manifest is damaged")


def check_leaf(leaf, index: int, leaves: list, where: str) -> None:
    """Raise FormatError unless leaf record `index` is well formed and its chunks tile it."""
    if type(leaf) is not dict:
        raise FormatError(f"manifest {where}: leaf {index} is not a JSON object")
    path = leaf.get("path")
    if type(path) is not str or len(path) > 16 * MAX_NAME_CHARS:
        raise FormatError(f"manifest {where}: leaf {index} has no valid path")
    kind, dtype, shape = leaf.get("kind"), leaf.get("dtype"), leaf.get("shape")
    if type(kind) is not str or kind not in LEAF_KINDS:
        _bad_leaf(where, path, f"kind {str(kind)[:40]!r} is not one of {sorted(LEAF_KINDS)}")
    if type(dtype) is not str or dtype not in DTYPE_ITEMSIZE:
        _bad_leaf(where, path, f"dtype {str(dtype)[:40]!r} is not a dtype this format knows")
    if kind in ("bytes", "pickle") and (dtype != "uint8" or not isinstance(shape, list) or len(shape) != 1):
        _bad_leaf(where, path, f"a {kind} leaf has dtype {dtype} and shape {str(shape)[:40]}, not uint8 and [n]")
    if not _int_list(shape, MAX_DIMS) or (shape and min(shape) < 0):
        _bad_leaf(where, path, f"shape {str(shape)[:80]} is not a list of at most {MAX_DIMS} non-negative integers")
    if type(leaf.get("device", "cpu")) is not str:
        _bad_leaf(where, path, "device is not a string")
    count = math.prod(shape)
    itemsize = DTYPE_ITEMSIZE[dtype]
    nbytes = leaf.get("nbytes")
    if count * itemsize > MAX_LEAF_BYTES:
        _bad_leaf(where, path, f"shape {shape} of {dtype} is {count * itemsize} bytes, over the limit of {MAX_LEAF_BYTES}")
    if type(nbytes) is not int or nbytes != count * itemsize:
        _bad_leaf(where, path, f"nbytes {nbytes!r} is not product(shape) x {itemsize} = {count * itemsize}")
    chunks = leaf.get("chunks", [])
    if type(chunks) is not list or len(chunks) > MAX_CHUNKS_PER_LEAF:
        _bad_leaf(where, path, "chunks is not a list")
    alias = leaf.get("alias_of")
    if alias is not None:
        if type(alias) is not int or not 0 <= alias < index:
            _bad_leaf(where, path, f"alias_of {alias!r} does not name an earlier leaf")
        base = leaves[alias]
        if base.get("alias_of") is not None or (base.get("dtype"), base.get("shape")) != (dtype, shape):
            _bad_leaf(where, path, f"alias_of {alias} names leaf {base.get('path')!r}, not a stored leaf of the "
                                   "same dtype and shape")
        if chunks:
            _bad_leaf(where, path, "an alias leaf holds chunks")
        return
    boxes = [_check_chunk(c, shape, itemsize, where, path) for c in chunks
             if type(c) is not dict or c.get("object") != "" or c.get("size") != 0]  # empty leaves before 1.1
    _check_tiling(shape, boxes, lambda what: _bad_leaf(where, path, what))


def _bad_leaf(where: str, path: str, what: str):
    raise FormatError(f"manifest {where}, leaf {path!r}: {what}; the manifest is damaged")


_INTS = {int}


def _int_list(value, limit: int) -> bool:
    return type(value) is list and len(value) <= limit and (not value or set(map(type, value)) == _INTS)


def _check_chunk(c, shape: list, itemsize: int, where: str, path: str) -> tuple[list, list]:
    if type(c) is not dict:
        _bad_leaf(where, path, "a chunk is not a JSON object")
    offsets, lengths = c.get("offsets"), c.get("lengths")
    if not (_int_list(offsets, MAX_DIMS) and _int_list(lengths, MAX_DIMS)) or \
            len(offsets) != len(shape) or len(lengths) != len(shape):
        _bad_leaf(where, path, f"a chunk's box {str(offsets)[:60]} + {str(lengths)[:60]} does not have "
                               f"{len(shape)} dimensions")
    whole = lengths == shape and not any(offsets)  # the common single-box leaf
    if not whole and any(o < 0 or n < 1 or o + n > dim for o, n, dim in zip(offsets, lengths, shape)):
        _bad_leaf(where, path, f"a chunk's box at {offsets} of {lengths} lies outside the shape {shape}")
    digest, obj = c.get("hash"), c.get("object")
    if type(digest) is not str or type(obj) is not str or not (_DIGEST.match(digest) and _DIGEST.match(obj)):
        _bad_leaf(where, path, f"invalid object name {str(obj)[:80]!r} or hash {str(digest)[:80]!r} in a chunk: "
                               "expected 64 hex digits")
    start, size = c.get("start"), c.get("size")
    if type(start) is not int or type(size) is not int or start < 0 or start + size > MAX_LEAF_BYTES:
        _bad_leaf(where, path, f"a chunk's byte range start {start!r}, size {size!r} is invalid")
    if size != math.prod(lengths) * itemsize:
        _bad_leaf(where, path, f"a chunk of box {lengths} holds {size} bytes, not {math.prod(lengths) * itemsize}")
    if type(c.get("codec", "raw")) is not str:
        _bad_leaf(where, path, "a chunk's codec is not a string")
    lossy, delta = c.get("lossy"), c.get("delta")
    if lossy is not None and type(lossy) is not dict:
        _bad_leaf(where, path, "a chunk's lossy record is not a JSON object")
    if delta is not None:
        chain = delta.get("chain") if type(delta) is dict else None
        if type(chain) is not list or not chain or len(chain) > MAX_DELTA_CHAIN or \
                not all(map(is_digest, chain)) or start != 0:
            _bad_leaf(where, path, f"a chunk's delta record {str(delta)[:120]} is invalid")
    return offsets, lengths


def _check_tiling(shape: list, boxes: list, bad) -> None:
    """Raise through `bad` unless `boxes` (each inside `shape`) cover it exactly once."""
    if math.prod(shape) == 0:
        if boxes:
            bad(f"an empty leaf of shape {shape} holds {len(boxes)} chunks")
        return
    if not boxes:
        bad(f"a leaf of shape {shape} has no chunks: its bytes are nowhere")
    if len(boxes) == 1:
        if boxes[0][1] != shape:
            bad(f"its one chunk covers {boxes[0][1]} of the shape {shape}")
        return
    if sum(math.prod(n) for _, n in boxes) != math.prod(shape):
        bad(f"its {len(boxes)} chunks cover {sum(math.prod(n) for _, n in boxes)} elements of {math.prod(shape)}: "
            "they leave a gap or overlap")
    if all(n[1:] == shape[1:] for _, n in boxes):  # row ranges: the common split
        rows = sorted((o[0], n[0]) for o, n in boxes)
        at = 0
        for lo, n in rows:
            if lo != at:
                bad(f"its chunks {'overlap' if lo < at else 'leave a gap'} at row {min(lo, at)}")
            at = lo + n
        return
    cuts = [sorted({0, dim} | {o[d] for o, _ in boxes} | {o[d] + n[d] for o, n in boxes})
            for d, dim in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells <= _GRID_CELLS_MAX:
        cover = np.zeros([len(c) - 1 for c in cuts], np.int32)
        at = [{x: i for i, x in enumerate(c)} for c in cuts]
        for o, n in boxes:
            cover[tuple(slice(a[x], a[x + m]) for a, x, m in zip(at, o, n))] += 1
        if (cover != 1).any():
            bad("its chunks overlap or leave a gap")
        return
    if len(boxes) > _PAIRWISE_MAX:
        bad(f"its {len(boxes)} chunks are too many, too irregular boxes to check")
    lo = np.array([o for o, _ in boxes], np.int64)
    hi = lo + np.array([n for _, n in boxes], np.int64)
    for i in range(len(boxes)):
        meet = np.all((lo[i] < hi[i + 1:]) & (lo[i + 1:] < hi[i]), axis=1)
        if meet.any():
            bad("its chunks overlap")
