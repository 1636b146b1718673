"""kvstore's CUDA path: page-locked staging, async copies, paged gather/scatter, FP8 kernels.

The kernels live in a plain shared library, ``libkvcuda.so``, built from ``cuda_ext/``
by ``python -m kvstore cuda build`` (see :mod:`kvstore.cuda.build` for where it goes
and why it is not built at install time) and bound with ctypes: it takes raw pointers
and the caller's CUDA stream as an integer, so it is independent of torch's C++ ABI
and of the CUDA runtime torch brought (the library links its runtime statically).

Everything works without it.  :func:`available` says whether the GPU path is used and
:func:`reason` why (or why not: not built, no driver, driver too old, no device);
when it is not, every function here runs its CPU path with identical results:

* :mod:`kvstore.cuda.page_locked` -- the store's staging arena registered as page-locked
  memory (``kvstore.open(..., page_lock_staging=None|True|False)``), bounded, released at
  close and at exit;
* :mod:`kvstore.cuda.device`  -- streams, device buffers, async copies whose completion
  is awaited through an eventfd (no blocked thread, no polling);
* :mod:`kvstore.cuda.paged`   -- gather/scatter between vLLM paged caches and staging;
* :mod:`kvstore.cuda.fp8`     -- FP8 encode/decode, byte-identical to kvstore.codecs.pipeline;
* :mod:`kvstore.cuda.copies`, :mod:`kvstore.cuda.torch_copies` -- the store's
  stream-ordered copies between its host memory and CUDA tensors, through kvstore's
  library or, without it, through torch;
* :mod:`kvstore.cuda.mover` -- the data mover engines use: ``copy_out`` (saves) and
  ``copy_in`` (loads) over ``mover_core``, ``batches``, ``backpressure`` and
  ``staging`` (its bounded page-locked staging).

Submodules
----------
``build``  nvcc invocation; ``_lib`` the ctypes binding and the probe.

It may import :mod:`kvstore.io.arena` (the staging it page-locks) and
:mod:`kvstore.codecs` (the payloads its FP8 kernels match); the vLLM worker side and
the command line import it, the store only on first use (page-locking, device copies:
``kvstore._cuda_path``).
"""

from __future__ import annotations

from typing import Any

from kvstore.cuda._lib import CudaError, runtime

__all__ = ["CudaError", "available", "reason", "stats"]


def available() -> bool:
    """True when the library is built, loads, and sees at least one CUDA device."""
    return runtime().usable


def reason() -> str:
    """One sentence: which device is used, or why the CPU paths are used instead."""
    return runtime().reason


def stats() -> dict[str, Any]:
    """What is in use: ``path`` is ``"cuda"`` or ``"cpu"``, plus library, device, driver
    and page-locked memory figures (``page_locked_bytes``, ``page_locked_regions``,
    ``page_locked_limit_bytes``).  ``pinned_bytes``, ``pinned_regions`` and
    ``pinned_limit_bytes`` are the same figures under their old names, deprecated: they
    go in the next release ("pin" means only never-evict, ``Store.pin``)."""
    from kvstore.cuda.page_locked import pool

    rt = runtime()
    p = pool()
    return {
        "path": "cuda" if rt.usable else "cpu",
        "available": rt.usable,
        "reason": rt.reason,
        "library": str(rt.lib.path) if rt.lib else None,
        "build": rt.lib.build_info if rt.lib else None,
        "device": rt.device if rt.usable else None,
        "device_name": rt.device_name or None,
        "device_count": rt.device_count,
        "driver_version": rt.driver_version,
        "runtime_version": rt.runtime_version,
        "page_locked_bytes": p.registered_bytes,
        "page_locked_regions": p.regions,
        "page_locked_limit_bytes": p.limit_bytes,
        # deprecated aliases of the three above, for one release
        "pinned_bytes": p.registered_bytes,
        "pinned_regions": p.regions,
        "pinned_limit_bytes": p.limit_bytes,
    }
