"""Opt-in lossy storage of floating-point data with an error bound relative to each value.

`Lossy(rel_error=1e-3)` rounds each value's significand to the fewest bits that keep
|stored - value| <= rel_error * |value| (round to nearest even); `Lossy(dtype="bfloat16")`
or `"float16"` rounds to that type's precision. The exponent is never touched, so small
values (Adam's second moment) keep their magnitude instead of becoming zero, as they would
with an error bound relative to the tensor's range; zeros, infinities and NaNs are kept
exactly, and so are subnormal values (which have fewer significant bits than the bound
needs). The rounded values are ordinary floats of the original dtype: the low bits become
zero and the lossless byte-plane codec then stores those planes in almost nothing.
"""

import math
from dataclasses import dataclass

import numpy as np

from . import kernels

SIGNIFICAND_BITS = {2: 10, 4: 23, 8: 52}
NARROW_BITS = {"bfloat16": 7, "float16": 10}
_UINT = {4: np.uint32, 8: np.uint64}
_EXPONENT = {4: (23, 0xFF), 8: (52, 0x7FF)}


@dataclass(frozen=True)
class Lossy:
    """A lossy policy: `rel_error` (value-relative bound) or `dtype` ("bfloat16"/"float16" precision)."""

    rel_error: float | None = None
    dtype: str | None = None

    def __post_init__(self):
        if (self.rel_error is None) == (self.dtype is None):
            raise ValueError("give fp.Lossy exactly one of rel_error=... or dtype=...")
        if self.rel_error is not None and not (0 < self.rel_error < 0.5):
            raise ValueError(f"rel_error must be in (0, 0.5), got {self.rel_error}")
        if self.dtype is not None and self.dtype not in NARROW_BITS:
            raise ValueError(f"dtype must be one of {sorted(NARROW_BITS)}, got {self.dtype!r}")

    def keep_bits(self, itemsize: int) -> int:
        """Significand bits kept for elements of `itemsize` bytes."""
        full = SIGNIFICAND_BITS[itemsize]
        if self.dtype is not None:
            return min(full, NARROW_BITS[self.dtype])
        return min(full, max(1, math.ceil(-math.log2(self.rel_error)) - 1))

    def describe(self) -> str:
        return f"rel_error={self.rel_error:g}" if self.rel_error is not None else f"dtype={self.dtype}"


def supports(itemsize: int, floating: bool) -> bool:
    """True for the element types the lossy modes handle (float32 and float64)."""
    return floating and itemsize in _UINT


def round_significand(data: np.ndarray, itemsize: int, keep: int) -> float:
    """Round the floats in `data` (a uint8 array, changed in place) to `keep` significand bits;
    return the largest relative error made (0.0 when nothing changed)."""
    drop = SIGNIFICAND_BITS[itemsize] - keep
    if drop <= 0 or data.nbytes == 0:
        return 0.0
    if kernels.planes is not None:
        return kernels.planes.round_significand(data, itemsize, drop)
    return _round_numpy(data, itemsize, drop)


def _round_numpy(data: np.ndarray, itemsize: int, drop: int) -> float:
    uint = _UINT[itemsize]
    shift, exp_max = _EXPONENT[itemsize]
    bits = data.view(uint)
    original = bits.copy()
    one = uint(1)
    half = uint((1 << (drop - 1)) - 1)
    odd = (bits >> uint(drop)) & one
    rounded = (bits + half + odd) & ~uint((1 << drop) - 1)
    exponent = (original >> uint(shift)) & uint(exp_max)
    keep_mask = ((exponent == uint(exp_max)) | (exponent == uint(0))
                 | (((rounded >> uint(shift)) & uint(exp_max)) == uint(exp_max)))
    np.copyto(bits, np.where(keep_mask, original, rounded))
    ftype = np.float32 if itemsize == 4 else np.float64
    before, after = original.view(ftype), bits.view(ftype)
    finite = np.isfinite(before) & (before != 0)
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(after[finite].astype(np.float64) - before[finite]) / np.abs(before[finite])))
