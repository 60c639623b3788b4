"""The transforms of a segment's elements into byte planes, and of its top plane before coding.

Elements are split into byte planes, the top two optionally rotated left by one bit as one
16-bit word (the sign moves below the exponent, so the top plane of a float32 or bfloat16
holds exactly its exponent). Where the caller names the length of a row (a weight matrix's
columns), the top plane may instead be coded as its residual under a grid model: byte = row
shift + column shift + residual (mod 256), the shifts being medians (an Adam moment's exponents
are close to log|u_r| + log|v_c|, as a sum of outer products makes them; the residual has 25-35%
less entropy than the exponents). With or without rows, a top plane may instead be coded by row
matching: rows of MATCH_ROW bytes, each an earlier row (up to MATCH_REACH back) plus a constant
plus a residual (an Adam moment's rows are often an earlier row times a power of two).
The native kernels and numpy compute the same bytes.
"""

import numpy as np

from . import kernels

WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
GRID_DOWN, GRID_ACROSS = 128, 64
MATCH_ROW, MATCH_REACH, MATCH_LEAST, MATCH_SAMPLES = 256, 16, 8, 32

_LOW = np.uint64(0x0101010101010101)
_HIGH = np.uint64(0x8080808080808080)


def _rotate(top: np.ndarray, below: np.ndarray, left: bool) -> None:
    """Rotate the 16-bit words (top, below) by one bit, in place, left or right (8 bytes at a
    time, masking the bits that would cross into the next byte)."""
    whole = top.size - top.size % 8
    if whole:
        _rotate_words(top[:whole].view(np.uint64), below[:whole].view(np.uint64), left)
    if whole < top.size:
        _rotate_bytes(top[whole:], below[whole:], left)


def _rotate_words(top: np.ndarray, below: np.ndarray, left: bool) -> None:
    one = np.uint64(1)
    seven = np.uint64(7)
    if left:
        carry = (top >> seven) & _LOW
        top <<= one
        top &= ~_LOW
        top |= (below >> seven) & _LOW
        below <<= one
        below &= ~_LOW
        below |= carry
    else:
        carry = (below & _LOW) << seven
        below >>= one
        below &= ~_HIGH
        below |= (top & _LOW) << seven
        top >>= one
        top &= ~_HIGH
        top |= carry


def _rotate_bytes(top: np.ndarray, below: np.ndarray, left: bool) -> None:
    if left:
        carry = top >> 7
        top <<= 1
        top |= below >> 7
        below <<= 1
        below |= carry
    else:
        carry = below & 1
        below >>= 1
        below |= top << 7
        top >>= 1
        top |= carry << 7


def to_planes(elements: np.ndarray, itemsize: int, rotated: bool, planes: np.ndarray) -> None:
    """Write `elements` (uint8, whole elements) into `planes` (itemsize x count), rotated if asked."""
    if kernels.planes is not None and itemsize in WORDS:
        kernels.planes.to_planes(elements, planes, itemsize, rotated)
        return
    planes[...] = elements.reshape(-1, itemsize).T
    if rotated:
        _rotate(planes[-1], planes[-2], True)


def from_planes(planes: np.ndarray, itemsize: int, rotated: bool, out: np.ndarray) -> None:
    if kernels.planes is not None and itemsize in WORDS:
        kernels.planes.from_planes(planes, out, itemsize, rotated)
        return
    if rotated:
        _rotate(planes[-1], planes[-2], False)
    out.reshape(-1, itemsize)[...] = planes.T


def _lower_median(values: np.ndarray, axis: int) -> np.ndarray:
    middle = (values.shape[axis] - 1) // 2
    return np.take(np.partition(values, middle, axis=axis), middle, axis=axis)


def fit_grid(plane: np.ndarray, cols: int) -> np.ndarray:
    """The grid model of a plane of rows of `cols` bytes: its row shifts (one byte per row)
    then its column shifts (`cols` bytes): each column's lower median over up to GRID_DOWN evenly
    spaced rows, then each row's lower median of (byte - column shift) over up to GRID_ACROSS
    evenly spaced columns (native and numpy pick the same)."""
    rows = plane.size // cols
    shifts = np.empty(rows + cols, np.uint8)
    if kernels.planes is not None:
        kernels.planes.fit_grid(plane, cols, GRID_DOWN, GRID_ACROSS, shifts[:rows], shifts[rows:])
        return shifts
    grid = plane.reshape(rows, cols)
    picked = min(rows, GRID_DOWN)
    column = _lower_median(grid[np.arange(picked) * rows // picked], axis=0)
    picked = min(cols, GRID_ACROSS)
    at = np.arange(picked) * cols // picked
    row = _lower_median(grid[:, at].astype(np.int16) - column[at].astype(np.int16), axis=1)
    shifts[:rows], shifts[rows:] = row & 255, column
    return shifts


def apply_grid(src: np.ndarray, dst: np.ndarray, shifts: np.ndarray, cols: int, add: bool) -> None:
    """dst = src - row shift - column shift (+ where `add`), per byte, modulo 256, for a plane
    of rows of `cols` bytes and its `shifts` (see fit_grid)."""
    rows = src.size // cols
    row, column = shifts[:rows], shifts[rows:]
    if kernels.planes is not None:
        kernels.planes.apply_grid(src, dst, row, column, add)
        return
    grid, out = src.reshape(rows, -1), dst.reshape(rows, -1)
    combine = np.add if add else np.subtract
    combine(grid, column, out=out)
    combine(out, row[:, None], out=out)


def match_rows(plane: np.ndarray) -> np.ndarray:
    """Code `plane` (in place) as rows of MATCH_ROW bytes, each an earlier row (up to MATCH_REACH
    back) plus a constant plus the residual left in the plane; return the side bytes (each row's
    distance back, 0 for none, then each row's constant). See match_rows in _planes.c: the numpy
    path picks the same rows and constants."""
    side = np.zeros(match_side_bytes(plane.size), np.uint8)
    rows = side.size // 2
    if kernels.planes is not None:
        kernels.planes.match_rows(plane, plane, side, MATCH_ROW, MATCH_REACH, MATCH_LEAST)
        return side
    whole = plane.size // MATCH_ROW
    if whole < 2:
        return side
    grid = plane[:whole * MATCH_ROW].reshape(whole, MATCH_ROW)
    samples = grid[:, ::MATCH_ROW // MATCH_SAMPLES].astype(np.int16)
    best = np.full(whole, MATCH_LEAST - 1)
    back = np.zeros(whole, np.int64)
    shift = np.zeros(whole, np.uint8)
    for o in range(1, min(MATCH_REACH, whole - 1) + 1):
        d = (samples[o:] - samples[:-o]) & 255
        for c in range(4):
            t = d[:, c * (MATCH_SAMPLES // 4)]
            score = (d == t[:, None]).sum(axis=1)
            better = score > best[o:]
            best[o:][better] = score[better]
            back[o:][better] = o
            shift[o:][better] = t[better]
    rows_at = np.arange(whole)
    matched = back > 0
    reference = grid[rows_at[matched] - back[matched]]
    grid[matched] = grid[matched] - reference - shift[matched][:, None]
    side[:whole], side[rows:rows + whole] = back, shift
    return side


def unmatch_rows(plane: np.ndarray, side) -> None:
    """Inverse of match_rows, in place: `plane` holds the residual and becomes the rows."""
    side = np.frombuffer(side, np.uint8)
    if kernels.planes is not None:
        kernels.planes.unmatch_rows(plane, side, MATCH_ROW)
        return
    rows = side.size // 2
    for r in np.flatnonzero(side[:rows]).tolist():
        back = int(side[r])
        if back > r:
            raise ValueError(f"row matching: row {r} refers to a row before the first")
        here = plane[r * MATCH_ROW:(r + 1) * MATCH_ROW]
        here += plane[(r - back) * MATCH_ROW:(r - back) * MATCH_ROW + here.size] + side[rows + r]


def match_side_bytes(nbytes: int) -> int:
    return 2 * -(-nbytes // MATCH_ROW)


