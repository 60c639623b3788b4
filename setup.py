"""Build the optional native kernels (the float-planes codec's, streaming copies); the package works
without them."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("forkpoint.format._planes", ["src/forkpoint/format/_planes.c"],
                             extra_compile_args=["-O3"], optional=True),
                   Extension("forkpoint.storage._stream", ["src/forkpoint/storage/_stream.c"],
                             extra_compile_args=["-O3"], optional=True)])
