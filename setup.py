"""Build the optional native kernels of the float-planes codec; the package works without them."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("forkpoint.format._planes", ["src/forkpoint/format/_planes.c"],
                             extra_compile_args=["-O3"], optional=True)])
