"""kvstore: a persistent, crash-consistent NVMe tier for LLM attention KV-cache blocks.

Public API (everything else is private and may change)::

    async with kvstore.open(path, namespace=ns) as store:
        keys = ns.chain_keys(token_ids)
        await store.put_many(keys, blocks, parents=kvstore.chain_parents(keys))
        n = await store.match_prefix(keys)
        blocks = await store.get_many(keys[:n])

This top folder is the public API (``store``, ``events``, ``blocking``, ``options``,
``stats``, ``errors``, ``keys``, ``metrics``) and may import every folder below it; the folders and
what each may import are in docs/architecture.md (checked by tests/test_imports.py).
"""

from kvstore.blocking import BlockingStore, open_blocking
from kvstore.core.events import BlockEvent, EventGap, Subscription
from kvstore.core.snapshot import StoredBlock
from kvstore.disk.format import FORMAT_VERSION
from kvstore.errors import (
    BlockTooLargeError,
    CapacityError,
    CorruptionError,
    FormatVersionError,
    IndexCorruptionError,
    InsecurePermissionsError,
    InvalidKeyError,
    InvalidTagError,
    KVStoreError,
    NamespaceMismatchError,
    OptionMismatchError,
    OutputMismatchError,
    ReadOnlyError,
    RemoteAuthError,
    RemoteError,
    StoreClosedError,
    StoreFullError,
    StoreIOError,
    StoreLockedError,
    UnsafePathError,
    UnsupportedTensorError,
)
from kvstore.io.scheduler import IoSchedule
from kvstore.keys import Namespace, chain_parents
from kvstore.options import StoreOptions
from kvstore.store import PutResult, Store, StoreStats, open

# Optional parts load only when used: kvstore.cuda with the first store that page-locks
# its staging arena (kvstore.io.page_locking), the remote tier's client with the first store
# opened with remote=..., kvstore.metrics and the engine integrations when imported.

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "BlockEvent",
    "BlockTooLargeError",
    "BlockingStore",
    "CapacityError",
    "CorruptionError",
    "EventGap",
    "FormatVersionError",
    "IndexCorruptionError",
    "InsecurePermissionsError",
    "InvalidKeyError",
    "InvalidTagError",
    "IoSchedule",
    "KVStoreError",
    "Namespace",
    "NamespaceMismatchError",
    "OptionMismatchError",
    "OutputMismatchError",
    "PutResult",
    "ReadOnlyError",
    "RemoteAuthError",
    "RemoteError",
    "Store",
    "StoreOptions",
    "StoreClosedError",
    "StoreFullError",
    "StoreIOError",
    "StoreLockedError",
    "StoreStats",
    "StoredBlock",
    "Subscription",
    "UnsafePathError",
    "UnsupportedTensorError",
    "__version__",
    "chain_parents",
    "open",
    "open_blocking",
]
