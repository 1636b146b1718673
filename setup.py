"""Build hook for the optional compiled kernels (everything else is in pyproject.toml).

``kvstore/_native/fp8.c`` (FP8 codec rows), ``kvstore/_native/slots.c`` (slot staging
and verification, CRC32C) and ``kvstore/_native/marks.c`` (fenced read marks of the
processes sharing a store) are plain C libraries loaded with ctypes (no Python C API),
built as optional extensions: without a C compiler the install still succeeds and
``kvstore.codecs.fp8_kernels`` / ``kvstore.io.native_slots`` report them missing and their
users take the NumPy/torch/Python paths, which give bit-identical results, slower
(without the marks library a store is not shared: ``kvstore.io.marks``).  The
libraries are built next to their sources, as ``kvstore/_native/_fp8*.so``,
``kvstore/_native/_slots*.so`` and ``kvstore/_native/_marks*.so``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._native._fp8",
            sources=["kvstore/_native/fp8.c"],
            # Never -ffast-math: the kernels rely on IEEE rounding of float additions.
            # -fno-trapping-math only lets GCC if-convert (vectorise) the selects; it
            # changes no result (see the comment at the top of fp8.c).
            extra_compile_args=["-O3", "-std=c11", "-fno-fast-math", "-fno-trapping-math",
                                "-Wall", "-Wextra"],
            optional=True,
        ),
        Extension(
            "kvstore._native._slots",
            sources=["kvstore/_native/slots.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
            optional=True,
        ),
        Extension(
            "kvstore._native._marks",
            sources=["kvstore/_native/marks.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
            optional=True,
        ),
    ]
)
