"""Build hook for the optional compiled FP8 kernels (everything else is in pyproject.toml).

``kvstore/_native/fp8.c`` is a plain C library loaded with ctypes (no Python C API), built
as an optional extension: without a C compiler the install still succeeds and
``kvstore.codecs`` uses its NumPy/torch path, which gives bit-identical results, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._fp8",
            sources=["kvstore/_native/fp8.c"],
            # Never -ffast-math: the kernels rely on IEEE rounding of float additions.
            # -fno-trapping-math only lets GCC if-convert (vectorise) the selects; it
            # changes no result (see the comment at the top of fp8.c).
            extra_compile_args=["-O3", "-std=c11", "-fno-fast-math", "-fno-trapping-math",
                                "-Wall", "-Wextra"],
            optional=True,
        )
    ]
)
