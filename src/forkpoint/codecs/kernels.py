"""The native byte-plane kernels (codecs/_planes.c) and the deflate library the codecs use.

`planes` is None where the extension was not built (no C compiler at install time): callers then
do the same work in numpy, writing payloads that either reads. `deflate` is zlib-ng where
installed, else the standard zlib, which writes and reads the same streams, slower.
"""

import zlib

try:
    from zlib_ng import zlib_ng as deflate
except ImportError:
    deflate = zlib
try:
    from . import _planes as planes
except ImportError:
    planes = None
