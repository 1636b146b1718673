"""The optional compiled kernels: their C sources (``fp8.c``, the FP8 codec's rows;
``slots.c``, slot staging, verification and CRC32C), the libraries setup.py builds from
them next to the sources (``_fp8*.so``, ``_slots*.so``), the ctypes loader both bindings
use (``lib``) and the derivation of ``slots.c``'s CRC32C constants
(``crc32c_constants``).  The bindings live with their users (:mod:`kvstore.codecs` and
:mod:`kvstore.io`), which fall back to Python without the libraries.  Imports nothing of
kvstore.
"""
