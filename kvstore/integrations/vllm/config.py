"""Options of the vLLM connector (``kv_connector_extra_config``), checked up front.

Kept apart from :mod:`kvstore.integrations.vllm` so that it imports without vLLM (and
is unit-tested in the main test environment).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.integrations.common.extra_config import (
    CODECS,
    STORE_KEYS,
    codec_name,
    engine_store_defaults,
    refuse_integration_keys,
    store_open_options,
    store_options,
)
from kvstore.options import StoreOptions
from kvstore.tiers.remote.config import RemoteConfig

__all__ = ["CODECS", "ConnectorConfig"]

# How long the scheduler waits for a lookup when a remote tier may answer it: a local
# lookup (an index read, well under a millisecond) is still answered in the step that asks,
# a round trip to S3 is not waited for (the request is asked about again next step).
DEFAULT_REMOTE_LOOKUP_WAIT_S = 0.005

_WHO = "kvstore connector"
_WHERE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of the connector; only ``path`` is required.

    Every store option of :func:`kvstore.open` (:class:`~kvstore.options.StoreOptions`:
    ``capacity_bytes``, ``codec``, ``sync``, ``extent_bytes``, ``staging_bytes``,
    ``memory_bytes``, ``backlog_bytes``, ``file_mode``, ``strict_permissions``,
    ``scrub_bytes_per_s`` (a background scrub at that rate), ``remote``, ...) is a key too, with the store's default, in the JSON forms of
    :mod:`kvstore.integrations.common.extra_config` (``io_engine`` for ``engine``, a codec's
    name, an octal string for ``file_mode``); they make ``store``.  The connector's own:

    ``path``            store directory (created if missing).
    ``max_pending_save_bytes``  the data mover's staging for saves in flight (default
                        1 GiB, page-locked on a GPU): a step whose save finds no room
                        drops it.  At least one block, as given.
    ``load_staging_bytes``  the data mover's staging for loads in flight (default
                        512 MiB: a 4k-token prefix of Llama-3-8B in bf16): page-locked
                        host memory, or with ``device_loads`` the GPU's memory (taken
                        from the headroom vLLM's ``gpu_memory_utilization`` leaves).
                        A lookup claims no more blocks than it holds; a background load
                        that finds it busy waits for room.  At least one block, as given
                        (the staging is whole pages, which may hold a little more).
    ``device_loads``    ``"auto"`` (default: on for an FP8 ``codec`` on a CUDA KV cache),
                        ``true`` or ``false``: loads land in device staging straight from
                        the store's arena (an FP8 block dequantised on the GPU), no host
                        copy.
    ``max_save_bytes_per_s``  cap on the saves' copy-out in bytes/s over PCIe (token
                        bucket, one second of burst; default none); a step's save over
                        it is dropped whole, counted.
    ``max_save_bytes_per_step``  cap on one step's copy-out in bytes (default none);
                        a step's save over it is dropped whole, counted.
    ``weights_fingerprint``  how the model's weight files enter the key scope:
                        ``"sample"`` (default: names, sizes, headers and sampled
                        blocks, milliseconds at start) or ``"full"`` (every byte).
    ``model_id``        the operator's name for these exact weights (a build id, a
                        commit), used instead of reading the files; required where
                        the weights are not local files (streamed from object storage).
    ``prefetch``        with the memory tier on: a lookup that finds stored blocks starts
                        bringing them into memory at once, before vLLM schedules the
                        load (default True).
    ``background_saves``  True (default): saves are droppable (``put_many(background=
                        True)``): under the store's backpressure a save is dropped whole
                        and counted.  False: the store writes every save it gets.  Either
                        way a step never waits for the disk: a save that finds no staging
                        (``max_pending_save_bytes``) is dropped.
    ``async_loads``     True (default): a request with a hit waits in vLLM's
                        ``WAITING_FOR_REMOTE_KVS`` while its blocks are read in the
                        background and other requests keep running.  False: the lookup
                        reads and verifies the hit blocks at once (the scheduler waits)
                        and they are copied into the paged KV before the step's forward;
                        the request runs in the step that found the hit.
    ``kv_events_replay``  with vLLM's KV events on (``--kv-events-config``): at start,
                        and after a weight update moved the key scope, announce every
                        block the store already holds of the scope (``BlockStored``,
                        medium ``STORAGE``), a page of 1024 blocks per engine step, so a
                        router learns the disk's content after a restart (default True;
                        docs/events.md).
    ``lookup_wait_ms``  how long vLLM's scheduler waits for a prefix lookup before it
                        schedules other requests and asks about this one again at a later
                        step (the lookup goes on meanwhile; vLLM's "needs more time").
                        Default: 5 ms with ``remote`` (a lookup may wait on S3), else
                        ``null``: always wait (a local lookup is an index read).

    The store options' meaning for the connector: ``remote`` is the shared S3 tier
    behind each rank's store (``hmac_key_file`` names a file holding the HMAC key;
    credentials come from the AWS environment, never from this config, which vLLM
    logs); each rank's store shares its own namespace's objects.  With tensor/pipeline
    parallel (world size W > 1) every rank has a store of its own in
    ``path/rank-R-of-W`` (:mod:`kvstore.integrations.vllm.ranks`), and
    ``capacity_bytes`` and ``memory_bytes`` are totals, split evenly between the ranks.
    """

    path: str
    store: StoreOptions = field(default_factory=engine_store_defaults)
    max_pending_save_bytes: int = 1 << 30
    load_staging_bytes: int = 512 << 20
    device_loads: bool | str = "auto"
    max_save_bytes_per_s: float | None = None
    max_save_bytes_per_step: int | None = None
    weights_fingerprint: str = "sample"
    model_id: str | None = None
    prefetch: bool = True
    background_saves: bool = True
    async_loads: bool = True
    kv_events_replay: bool = True
    lookup_wait_ms: float | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        refuse_integration_keys(extra, _WHO, _WHERE)
        own = {f.name for f in fields(cls)} - {"store"}
        unknown = sorted(set(extra) - own - set(STORE_KEYS))
        if unknown:
            raise ValueError(f"{_WHO}: unknown {_WHERE} keys {unknown}; known keys are "
                             f"{sorted(own | set(STORE_KEYS))}")
        if not isinstance(extra.get("path"), (str, os.PathLike)) or not os.fspath(extra["path"]):
            raise ValueError(f'{_WHO}: {_WHERE} needs "path", the '
                             'store directory (e.g. {"path": "/nvme/kvstore"})')
        extra["path"] = os.fspath(extra["path"])
        store = store_options(extra, _WHO, _WHERE)
        _check_mover_options(extra)
        for name in ("prefetch", "background_saves", "async_loads", "kv_events_replay"):
            if name in extra and not isinstance(extra[name], bool):
                raise ValueError(f"{_WHO}: {name} must be true or false, got {extra[name]!r}")
        if extra.get("weights_fingerprint", "sample") not in ("sample", "full"):
            raise ValueError(f"{_WHO}: weights_fingerprint must be 'sample' or "
                             f"'full', got {extra['weights_fingerprint']!r}")
        wait = extra.get("lookup_wait_ms")
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or not 0 <= wait < float("inf")):
            raise ValueError(f"{_WHO}: lookup_wait_ms must be a number of "
                             f"milliseconds >= 0 (or null: always wait), got {wait!r}")
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"{_WHO}: model_id must be a non-empty string naming "
                             f"these exact weights, got {model_id!r}")
        return cls(store=store, **extra)

    def wants_device_loads(self, fp8: bool) -> bool:
        """Whether loads stage in device memory, on a CUDA KV cache with kvstore's CUDA
        library (``"auto"``: with an FP8 codec, whose blocks are then dequantised on
        the GPU and cross PCIe at about half their size)."""
        return fp8 if self.device_loads == "auto" else bool(self.device_loads)

    @property
    def codec(self) -> str:
        """The store's codec by its :data:`CODECS` name (part of the key scope)."""
        return codec_name(self.store.codec)

    @property
    def remote(self) -> RemoteConfig | None:
        return self.store.remote

    def lookup_wait_s(self) -> float | None:
        """The scheduler's wait for a lookup in seconds (None: wait for the answer)."""
        if self.lookup_wait_ms is not None:
            return self.lookup_wait_ms / 1000
        return DEFAULT_REMOTE_LOOKUP_WAIT_S if self.remote is not None else None

    def open_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`kvstore.open` (the remote tier is attached once
        the key scope is known)."""
        return store_open_options(self.store)


def _check_mover_options(extra: Mapping[str, Any]) -> None:
    """The data mover's options: sizes and caps, each with what it must be."""
    for name, unset in (("max_pending_save_bytes", ""), ("load_staging_bytes", ""),
                        ("max_save_bytes_per_step", " or null (no cap)")):
        value = extra.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            raise ValueError(f"{_WHO}: {name} must be a positive int (bytes){unset}, "
                             f"got {value!r}")
    value = extra.get("max_save_bytes_per_s")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < float("inf")):
        raise ValueError(f"{_WHO}: max_save_bytes_per_s must be a positive number of "
                         f"bytes per second or null (no cap), got {value!r}")
    loads = extra.get("device_loads", "auto")
    if not (loads == "auto" or isinstance(loads, bool)):
        raise ValueError(f'{_WHO}: device_loads must be "auto", true or false, got '
                         f"{loads!r}")
