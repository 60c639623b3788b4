"""A block of a domain-decomposed array: the part of one global array a process holds.

Saved from every rank of a collective repository (fp.mpi.Repo, fp.dist.Repo), the blocks
become the chunks of one global leaf; restored, each rank's block is filled with the stored
values inside its box, whatever decomposition wrote them.
"""

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedTypeError
from .leaves import LeafData, numpy_leaf


def box_fits(offset, shape, global_shape) -> bool:
    """Whether a box of `shape` at `offset` lies inside an array of `global_shape` (same rank)."""
    return len(offset) == len(shape) == len(global_shape) and all(
        o >= 0 and n >= 0 and o + n <= g for o, n, g in zip(offset, shape, global_shape))


@dataclass(eq=False)
class Block:
    """`local` (a numpy array, ghost cells excluded) at `offset` in an array of `global_shape`.
    Blocks of one global array must not overlap and together must cover it."""

    local: np.ndarray
    offset: tuple
    global_shape: tuple

    def __post_init__(self):
        if not isinstance(self.local, np.ndarray):
            raise TypeError(f"fp.Block holds a numpy array, got {type(self.local).__name__}")
        self.offset = tuple(int(x) for x in self.offset)
        self.global_shape = tuple(int(x) for x in self.global_shape)
        shape = self.local.shape
        if not (len(self.offset) == len(self.global_shape) == len(shape)):
            raise ValueError(f"fp.Block: local shape {shape}, offset {self.offset} and global shape "
                             f"{self.global_shape} must have the same number of dimensions")
        if not box_fits(self.offset, shape, self.global_shape):
            raise ValueError(f"fp.Block: a block of shape {shape} at offset {self.offset} does not fit in "
                             f"the global shape {self.global_shape}")

    @property
    def box(self) -> tuple | None:
        """(offsets, lengths) in the global array; None when the block is the whole array."""
        if self.local.shape == self.global_shape:
            return None
        return list(self.offset), list(self.local.shape)

    def leaf(self, path: str, copy: bool) -> LeafData:
        """The block as a leaf of the global array."""
        leaf = numpy_leaf(self.local, path, copy)
        leaf.shape, leaf.box, leaf.itemsize = self.global_shape, self.box, self.local.dtype.itemsize
        return leaf

    def live_buffer(self):
        """(kind, dtype, global shape, uint8 view, box) to restore into, or None when the local
        array cannot be written in place."""
        a = self.local
        if not (a.flags.c_contiguous and a.flags.writeable) or a.dtype.byteorder == ">":
            return None
        if a.dtype.kind not in "biufc":
            raise UnsupportedTypeError(f"fp.Block of dtype {a.dtype}: blocks hold bool, integer, float or "
                                       "complex arrays")
        return "numpy", a.dtype.name, self.global_shape, a.reshape(-1).view(np.uint8), self.box
