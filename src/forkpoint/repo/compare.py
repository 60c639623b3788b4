"""Comparing versions: per-leaf diff and the first divergence of two runs."""

import json
from collections.abc import Callable

import numpy as np

from ..format.manifest import Leaf, Manifest, Version
from ..state import walk_skeleton
from ..state.leaves import is_torch_tensor
from ..state.stateful import another_class
from .records import Divergence, LeafDiff


class Comparison:
    """Diffs of two versions and the first divergence of two runs, over three reads of a Repo:
    `readable(ref)` (a readable Manifest), `read_values(m, indices)` ({index: value}), `log(ref)`."""

    def __init__(self, readable: Callable[[str], Manifest], read_values: Callable[[Manifest, list[int]], dict],
                 log: Callable[[str], list[Version]]):
        self._readable, self._read_values, self._log = readable, read_values, log

    def diff(self, a: str, b: str, numeric: bool = True) -> list[LeafDiff]:
        """Compare two versions leaf by leaf; identical hashes are 'same' without reading data.
        A torch object saved from another class at one path (AdamW, then SGD) is a change too."""
        ma, mb = self._readable(a), self._readable(b)
        na = {p: n for p, _, n in walk_skeleton(ma.tree)}
        nb = {p: n for p, _, n in walk_skeleton(mb.tree)}
        out = [LeafDiff(p, "changed", f"class {ma.classes[p].replace(':', '.')} -> {mb.classes[p].replace(':', '.')}")
               for p in sorted(set(ma.classes) & set(mb.classes)) if another_class(ma.classes[p], mb.classes[p])]
        for path in sorted(set(na) | set(nb)):
            if path not in nb:
                out.append(LeafDiff(path, "removed"))
            elif path not in na:
                out.append(LeafDiff(path, "added"))
            else:
                out.append(self._diff_node(ma, mb, path, na[path], nb[path], numeric))
        return sorted(out, key=lambda d: d.path)

    def _leaf_of(self, m: Manifest, node: dict) -> Leaf:
        leaf = m.leaves[node["i"]]
        return m.leaves[leaf.alias_of] if leaf.alias_of is not None else leaf

    def _diff_node(self, ma, mb, path, x, y, numeric) -> LeafDiff:
        if x.get("t") != "leaf" or y.get("t") != "leaf":
            if x == y:
                return LeafDiff(path, "same")
            d = LeafDiff(path, "changed", f"{_node_repr(x)} -> {_node_repr(y)}")
            if x.get("t") in ("int", "float") and y.get("t") in ("int", "float"):
                d.max_abs = abs(_scalar(y) - _scalar(x))
            return d
        la, lb = self._leaf_of(ma, x), self._leaf_of(mb, y)
        if la.digest == lb.digest:
            return LeafDiff(path, "same")
        if (la.dtype, la.shape) != (lb.dtype, lb.shape):
            return LeafDiff(path, "changed", f"{la.dtype}{la.shape} -> {lb.dtype}{lb.shape}")
        d = LeafDiff(path, "changed", "values")
        if numeric and la.kind in ("torch", "numpy", "numpy_scalar"):
            va = _as_float64(self._read_values(ma, [x["i"]])[x["i"]])
            vb = _as_float64(self._read_values(mb, [y["i"]])[y["i"]])
            if va is not None and vb is not None:
                delta = np.abs(vb - va)
                d.max_abs = float(delta.max()) if delta.size else 0.0
                norm = float(np.linalg.norm(va.ravel()))
                d.rel_l2 = float(np.linalg.norm((vb - va).ravel())) / norm if norm else float("inf")
        return d

    def first_divergence(self, branch_a: str, branch_b: str, atol: float = 0.0) -> Divergence | None:
        """Return the earliest common step whose states differ by more than `atol`, or None."""
        by_step_a = {v.step: v for v in reversed(self._log(branch_a)) if v.step is not None}
        by_step_b = {v.step: v for v in reversed(self._log(branch_b)) if v.step is not None}
        for step in sorted(set(by_step_a) & set(by_step_b)):
            va, vb = by_step_a[step], by_step_b[step]
            if va.id == vb.id or va.pruned or vb.pruned:
                continue
            diffs = [d for d in self.diff(va.id, vb.id, numeric=atol > 0) if d.status != "same"]
            beyond = [d for d in diffs if d.max_abs is None or d.max_abs > atol]
            if beyond:
                worst = max((d.max_abs for d in beyond if d.max_abs is not None), default=None)
                return Divergence(step, va.id, vb.id, [d.path for d in beyond], worst)
        return None


class CompareCommands:
    """The comparisons of a Repo's public API, over `self.comparison` (see repo.core)."""

    comparison: Comparison

    def diff(self, a: str, b: str, numeric: bool = True) -> list[LeafDiff]:
        """Compare two versions leaf by leaf; identical hashes are 'same' without reading data."""
        return self.comparison.diff(a, b, numeric)

    def first_divergence(self, branch_a: str, branch_b: str, atol: float = 0.0) -> Divergence | None:
        """Return the earliest common step whose states differ by more than `atol`, or None."""
        return self.comparison.first_divergence(branch_a, branch_b, atol)


def _node_repr(node: dict) -> str:
    if node.get("t") == "float":
        return repr(float.fromhex(node["v"]))
    if node.get("t") == "leaf":
        return "<array>"
    return json.dumps(node.get("v", node.get("t")))[:60]


def _scalar(node: dict) -> float:
    return float.fromhex(node["v"]) if node["t"] == "float" else float(node["v"])


def _as_float64(value):
    """Return a float64/complex128 numpy array of a tensor or array, or None when not numeric."""
    if is_torch_tensor(value):
        import torch

        t = value.detach().cpu()
        t = t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)
        return t.numpy()
    a = np.asarray(value)
    if a.dtype.kind not in "biufc":
        return None
    return a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)
