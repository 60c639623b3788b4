"""Copies of large buffers that nothing reads right after (a restore's copies out of the memory
tier, an asynchronous save's captures), with non-temporal stores where the native kernel is built
(`_stream.c`): they skip reading each destination line into the caches first."""

import numpy as np

try:
    from . import _stream
except ImportError:  # the package works without its native kernels
    _stream = None

STREAM_MIN_BYTES = 1 << 20


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src for arrays of one shape and dtype that do not overlap: streaming stores
    where both are contiguous and at least STREAM_MIN_BYTES, else numpy's copy (both let go of
    the GIL)."""
    if (_stream is not None and src.nbytes >= STREAM_MIN_BYTES and dst.shape == src.shape
            and dst.dtype == src.dtype and dst.flags.c_contiguous and src.flags.c_contiguous):
        _stream.copy(dst, src)
    else:
        np.copyto(dst, src)
