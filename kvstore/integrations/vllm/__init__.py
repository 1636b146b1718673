"""The vLLM (v1) KV connector: the class vLLM instantiates (``connector``:
``KVStoreConnector``, both roles), what its two sides share (``config``, ``metadata``,
``metrics``, ``scope``, ``ranks``, the lookup socket ``lookup_socket`` and the open store
``open_store``) and the two sides
(:mod:`kvstore.integrations.vllm.scheduler`, :mod:`kvstore.integrations.vllm.worker`).
Modules at this level may import the public API, :mod:`kvstore.codecs`, the remote
tier's options and :mod:`kvstore.integrations.common`; the connector also both sides.
vLLM names the connector by this package (``kv_connector_module_path``:
``kvstore.integrations.vllm``), so the connector's public names are re-exported here,
imported on first use: the modules below import without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.integrations.vllm.connector import (
        ConnectorConfig,
        KVStoreConnector,
        KVStoreConnectorMetadata,
        all_connector_stats,
        connector_stats,
    )

__all__ = ["ConnectorConfig", "KVStoreConnector", "KVStoreConnectorMetadata",
           "all_connector_stats", "connector_stats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvstore.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
