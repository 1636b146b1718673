"""kvstore: a persistent, crash-consistent NVMe tier for LLM attention KV-cache blocks.

Public API (everything else is private and may change)::

    async with kvstore.open(path, namespace=ns) as store:
        keys = ns.chain_keys(token_ids)
        await store.put_many(keys, blocks, parents=kvstore.chain_parents(keys))
        n = await store.match_prefix(keys)
        blocks = await store.get_many(keys[:n])
"""

from kvstore import pinning as _pinning
from kvstore.blocking import BlockingStore, open_blocking
from kvstore.cuda.pinned import pin_arena as _pin_arena
from kvstore.errors import (
    BlockTooLargeError,
    CapacityError,
    CorruptionError,
    FormatVersionError,
    IndexCorruptionError,
    InsecurePermissionsError,
    InvalidKeyError,
    KVStoreError,
    NamespaceMismatchError,
    OutputMismatchError,
    ReadOnlyError,
    RemoteAuthError,
    RemoteError,
    StoreClosedError,
    StoreFullError,
    StoreIOError,
    StoreLockedError,
    UnsupportedTensorError,
)
from kvstore.format import FORMAT_VERSION
from kvstore.io.scheduler import IoSchedule
from kvstore.keys import Namespace, chain_parents
from kvstore.options import StoreOptions
from kvstore.store import PutResult, Store, StoreStats, open

# The store pins its staging arena through a hook (kvstore.pinning), so that it does not
# depend on the optional CUDA package, which sits above it and is installed here.
_pinning.set_default_pinner(_pin_arena)

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "BlockTooLargeError",
    "BlockingStore",
    "CapacityError",
    "CorruptionError",
    "FormatVersionError",
    "IndexCorruptionError",
    "InsecurePermissionsError",
    "InvalidKeyError",
    "IoSchedule",
    "KVStoreError",
    "Namespace",
    "NamespaceMismatchError",
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
    "UnsupportedTensorError",
    "__version__",
    "chain_parents",
    "open",
    "open_blocking",
]
