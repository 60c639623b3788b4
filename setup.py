"""Build the optional native kernels (the float-planes codec's, streaming copies); the package works
without them."""

from setuptools import Extension, setup

SHARED = ["src/forkpoint/kernel_choice.h", "src/forkpoint/codecs/planes_decode.h"]

setup(ext_modules=[Extension("forkpoint.codecs._planes", ["src/forkpoint/codecs/_planes.c"], depends=SHARED,
                             extra_compile_args=["-O3"], optional=True),
                   Extension("forkpoint.storage._stream", ["src/forkpoint/storage/_stream.c"], depends=SHARED,
                             extra_compile_args=["-O3"], optional=True)])
