"""Finding and loading the optional compiled libraries (``kvstore/_native/*.c``, built by
setup.py as ``kvstore/_native/_<name>*.so``) with ctypes: shared by ``kvstore.codecs.fp8_kernels`` and
``kvstore.io.native_slots``, each of which falls back to Python/NumPy code without them."""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path


def load(stem: str, env: str, abi_symbol: str, abi: int, missing: str
         ) -> tuple[ctypes.CDLL | None, str]:
    """``(library, reason)``: the library ``kvstore/_native/<stem><extension suffix>`` if it is
    built, not disabled by ``env=0`` and of ABI version ``abi`` (the int its function
    ``abi_symbol`` returns), else ``None`` and why (``missing`` when it is not built)."""
    if os.environ.get(env, "1") == "0":
        return None, f"disabled by {env}=0"
    here = Path(__file__).resolve().parent
    path = next((p for suffix in importlib.machinery.EXTENSION_SUFFIXES
                 if (p := here / f"{stem}{suffix}").exists()), None)
    if path is None:
        return None, missing
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load {path.name}: {e}"
    version = getattr(lib, abi_symbol)
    version.restype = ctypes.c_int
    if version() != abi:
        return None, (f"{path.name} has ABI {version()}, this kvstore needs {abi}; "
                      "rebuild with `pip install -e .`")
    return lib, path.name
