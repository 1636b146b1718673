"""kvstore as SGLang HiCache's storage backend: the backend class SGLang's dynamic
backend loader instantiates (``backend``: ``KVStoreHiCache``), its v2 (hybrid) calls
(``hybrid``) over SGLang's sidecar host pools (``sidecars``), the chains across SGLang's
backup batches (``chains``), its options, rank directories and each rank's share of the
capacity (``config``: ``BackendConfig``), and what it reports (``storage_stats``);
``config``, ``chains`` and ``storage_stats`` import without SGLang.  It may import
the public API, :mod:`kvstore.codecs`, the remote tier's options and
:mod:`kvstore.integrations.common`.  SGLang names the backend by this package
(``"module_path": "kvstore.integrations.sglang"``), so its public names are re-exported
here, imported on first use: ``config`` imports without SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.integrations.sglang.backend import KVStoreHiCache, KVStoreStorageStats
    from kvstore.integrations.sglang.config import BackendConfig

__all__ = ["BackendConfig", "KVStoreHiCache", "KVStoreStorageStats"]


def __getattr__(name: str) -> Any:
    if name == "BackendConfig":  # without SGLang
        from kvstore.integrations.sglang.config import BackendConfig

        return BackendConfig
    if name in __all__:
        from kvstore.integrations.sglang import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
