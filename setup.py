"""The one native part of tierckpt: an optional C extension (the package works without it).

Everything else is declared in pyproject.toml. ``optional=True``: where it cannot be compiled (no C
compiler), the install goes on and reads fall back to ``pread`` (see tierckpt/backends/mapped_read.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tierckpt._copycrc", ["src/tierckpt/_native/copycrc.c"], optional=True, extra_compile_args=["-O2"]),
    ],
)
