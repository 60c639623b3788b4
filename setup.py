"""Build the optional native kernels (the float-planes codec's, streaming copies); the package works
without them."""

from setuptools import Extension, setup

SHARED = ["src/forkpoint/kernel_choice.h", "src/forkpoint/format/planes_decode.h"]

setup(ext_modules=[Extension("forkpoint.format._planes", ["src/forkpoint/format/_planes.c"], depends=SHARED,
                             extra_compile_args=["-O3"], optional=True),
                   Extension("forkpoint.storage._stream", ["src/forkpoint/storage/_stream.c"], depends=SHARED,
                             extra_compile_args=["-O3"], optional=True)])
