"""Chunk deltas: a chunk stored as the difference from the same chunk of an earlier version.

Integer data uses wrapping subtraction per element, everything else XOR of the bytes. A delta
chunk records its chain: the full base object first, then the delta objects in order; its
value is the base combined with each delta in turn (see docs/FORMAT.md).
"""

from dataclasses import dataclass

import numpy as np

OPS = ("xor", "sub")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INTEGERS = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64))


@dataclass(frozen=True)
class Delta:
    """Store a chunk as its delta against the parent version's chunk where that encodes smaller.

    A full chunk is stored at least every `max_chain` versions (a restore reads at most that
    many objects per chunk); the values of the newest version's chunks are kept in memory up to
    `cache_bytes` so that the next save need not read them back.
    """

    max_chain: int = 10
    cache_bytes: int = 8 << 30

    def __post_init__(self):
        if self.max_chain < 1:
            raise ValueError(f"Delta(max_chain=...) must be at least 1, got {self.max_chain}")


def op_for(dtype: str) -> str:
    """The delta operation for a leaf dtype: 'sub' for integers, 'xor' for everything else."""
    return "sub" if dtype in _INTEGERS else "xor"


def _words(data: np.ndarray, op: str, itemsize: int) -> np.ndarray:
    if op == "sub":
        return data.view(_UINT[itemsize])
    for width in (8, 4, 2):
        if data.nbytes % width == 0:
            return data.view(_UINT[width])
    return data


def make_delta(op: str, value: np.ndarray, base: np.ndarray, itemsize: int, out=None) -> np.ndarray:
    """The delta (uint8) that turns `base` into `value` (both uint8 of the same length), written
    into `out` (uint8, at least as long) when given."""
    out = np.empty_like(value) if out is None else out[:value.nbytes]
    if op == "sub":
        np.subtract(_words(value, op, itemsize), _words(base, op, itemsize), out=_words(out, op, itemsize))
    else:
        np.bitwise_xor(_words(value, op, itemsize), _words(base, op, itemsize), out=_words(out, op, itemsize))
    return out


def apply_delta(op: str, acc: np.ndarray, delta: np.ndarray, itemsize: int) -> None:
    """Turn `acc` (writable uint8) into the value `delta` leads to, in place."""
    if op == "sub":
        np.add(_words(acc, op, itemsize), _words(delta, op, itemsize), out=_words(acc, op, itemsize))
    elif op == "xor":
        np.bitwise_xor(_words(acc, op, itemsize), _words(delta, op, itemsize), out=_words(acc, op, itemsize))
    else:
        raise ValueError(f"unknown delta operation {op!r}; known: {OPS}")
