"""Options of the vLLM connector (``kv_connector_extra_config``), checked up front.

Kept apart from :mod:`kvstore.integrations.vllm` so that it imports without vLLM (and
is unit-tested in the main test environment).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.codecs import CodecSpec
from kvstore.integrations.extra_config import file_mode, remote_config
from kvstore.remote.config import RemoteConfig

__all__ = ["CODECS", "ConnectorConfig"]

# How long the scheduler waits for a lookup when a remote tier may answer it: a local
# lookup (an index read, well under a millisecond) is still answered in the step that asks,
# a round trip to S3 is not waited for (the request is asked about again next step).
DEFAULT_REMOTE_LOOKUP_WAIT_S = 0.005

CODECS: dict[str, CodecSpec | None] = {
    "raw": None, "zstd": CodecSpec(zstd=True),
    "fp8_e4m3": CodecSpec(fp8="e4m3"), "fp8_e5m2": CodecSpec(fp8="e5m2"),
    "fp8_e4m3+zstd": CodecSpec(fp8="e4m3", zstd=True),
    "fp8_e5m2+zstd": CodecSpec(fp8="e5m2", zstd=True)}


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of the connector; only ``path`` is required.

    ``path``            store directory (created if missing).
    ``capacity_bytes``  bound on stored bytes; least-recently-used chains' tails are
                        evicted first (default: the store's, 90% of free disk space).
    ``codec``           ``"raw"`` (default), ``"zstd"`` (lossless), or the lossy
                        ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (each optionally ``+zstd``).
    ``sync``            True (default): a saved block survives power loss once written.
                        False: it survives a process crash only (no fdatasync).
    ``extent_bytes``    size of each preallocated extent file (default 1 GiB).
    ``staging_bytes``   the store's host staging arena (default 256 MiB); bounds the
                        largest block (all layers of one vLLM block).
    ``io_engine``       ``"auto"`` (default), ``"io_uring"`` or ``"threads"``.
    ``max_pending_save_bytes``  saves in flight before a step waits for the oldest
                        (default 1 GiB of staged KV).
    ``weights_fingerprint``  how the model's weight files enter the key scope:
                        ``"sample"`` (default: names, sizes, headers and sampled
                        blocks, milliseconds at start) or ``"full"`` (every byte).
    ``model_id``        the operator's name for these exact weights (a build id, a
                        commit), used instead of reading the files; required where
                        the weights are not local files (streamed from object storage).
    ``file_mode``       permissions of the store's files, an int or an octal string
                        (``"0660"``: shared with the group); default the store's own
                        (owner-only 0600 for a new store).  See ``kvstore.open``.
    ``strict_permissions``  refuse to start on a store other users can reach (default:
                        log a warning naming the files and the fixing chmod).
    ``memory_bytes``    host-memory tier in front of the disk (default 0: off); loads of
                        blocks in it do no disk I/O.
    ``prefetch``        with the memory tier on: a lookup that finds stored blocks starts
                        bringing them into memory at once, before vLLM schedules the
                        load (default True).
    ``backlog_bytes``   bytes of saves in flight in the store beyond which a background
                        save is dropped whole (default 1 GiB).
    ``background_saves``  True (default): saves are droppable (``put_many(background=
                        True)``): under backpressure a save is dropped whole and counted,
                        the step never waits for the disk.  False: every save is written;
                        past ``max_pending_save_bytes`` a step waits for the oldest.
    ``remote``          the shared S3 tier behind the store (README, "Remote tier"): an
                        object of :class:`~kvstore.remote.RemoteConfig` options, e.g.
                        ``{"bucket": "kv", "endpoint": "http://10.0.0.5:8333",
                        "prefix": "fleet"}``; ``hmac_key_file`` names a file holding
                        the HMAC key.  Credentials come from the AWS environment
                        (``AWS_ACCESS_KEY_ID`` ...), never from this config (vLLM logs
                        it).  Needs ``pip install kvstore[remote]``.  Each rank's store
                        shares its own namespace's objects.
    ``async_loads``     True (default): a request with a hit waits in vLLM's
                        ``WAITING_FOR_REMOTE_KVS`` while its blocks are read in the
                        background and other requests keep running.  False: the lookup
                        reads and verifies the hit blocks at once (the scheduler waits)
                        and they are copied into the paged KV before the step's forward;
                        the request runs in the step that found the hit.
    ``lookup_wait_ms``  how long vLLM's scheduler waits for a prefix lookup before it
                        schedules other requests and asks about this one again at a later
                        step (the lookup goes on meanwhile; vLLM's "needs more time").
                        Default: 5 ms with ``remote`` (a lookup may wait on S3), else
                        ``null``: always wait (a local lookup is an index read).

    With tensor/pipeline parallel (world size W > 1) every rank has a store of its own
    in ``path/rank-R-of-W`` (:mod:`kvstore.integrations.vllm_ranks`), and
    ``capacity_bytes`` and ``memory_bytes`` are totals, split evenly between the ranks.
    """

    path: str
    capacity_bytes: int | None = None
    codec: str = "raw"
    sync: bool = True
    extent_bytes: int = 1 << 30
    staging_bytes: int = 256 << 20
    io_engine: str = "auto"
    max_pending_save_bytes: int = 1 << 30
    weights_fingerprint: str = "sample"
    model_id: str | None = None
    file_mode: int | None = None
    strict_permissions: bool = False
    memory_bytes: int = 0
    prefetch: bool = True
    backlog_bytes: int = 1 << 30
    background_saves: bool = True
    remote: RemoteConfig | None = None
    async_loads: bool = True
    lookup_wait_ms: float | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvstore connector: unknown kv_connector_extra_config keys "
                             f"{unknown}; known keys are {sorted(known)}")
        if not isinstance(extra.get("path"), (str, os.PathLike)) or not os.fspath(extra["path"]):
            raise ValueError('kvstore connector: kv_connector_extra_config needs "path", the '
                             'store directory (e.g. {"path": "/nvme/kvstore"})')
        extra["path"] = os.fspath(extra["path"])
        for name in ("capacity_bytes", "extent_bytes", "staging_bytes", "max_pending_save_bytes",
                     "backlog_bytes"):
            value = extra.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"kvstore connector: {name} must be a positive int, "
                                 f"got {value!r}")
        memory = extra.get("memory_bytes", 0)
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            raise ValueError("kvstore connector: memory_bytes must be an int >= 0 (0: no "
                             f"memory tier), got {memory!r}")
        for name in ("sync", "strict_permissions", "prefetch", "background_saves",
                     "async_loads"):
            if name in extra and not isinstance(extra[name], bool):
                raise ValueError(f"kvstore connector: {name} must be true or false, "
                                 f"got {extra[name]!r}")
        if extra.get("remote") is not None:
            extra["remote"] = remote_config(extra["remote"], "kvstore connector", "kv_connector_extra_config")
        if extra.get("file_mode") is not None:
            extra["file_mode"] = file_mode(extra["file_mode"], "kvstore connector")
        if extra.get("codec", "raw") not in CODECS:
            raise ValueError(f"kvstore connector: codec must be one of {sorted(CODECS)}, "
                             f"got {extra['codec']!r}")
        if extra.get("io_engine", "auto") not in ("auto", "io_uring", "threads"):
            raise ValueError("kvstore connector: io_engine must be 'auto', 'io_uring' or "
                             f"'threads', got {extra['io_engine']!r}")
        if extra.get("weights_fingerprint", "sample") not in ("sample", "full"):
            raise ValueError("kvstore connector: weights_fingerprint must be 'sample' or "
                             f"'full', got {extra['weights_fingerprint']!r}")
        wait = extra.get("lookup_wait_ms")
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or not 0 <= wait < float("inf")):
            raise ValueError("kvstore connector: lookup_wait_ms must be a number of "
                             f"milliseconds >= 0 (or null: always wait), got {wait!r}")
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError("kvstore connector: model_id must be a non-empty string naming "
                             f"these exact weights, got {model_id!r}")
        return cls(**extra)

    def lookup_wait_s(self) -> float | None:
        """The scheduler's wait for a lookup in seconds (None: wait for the answer)."""
        if self.lookup_wait_ms is not None:
            return self.lookup_wait_ms / 1000
        return DEFAULT_REMOTE_LOOKUP_WAIT_S if self.remote is not None else None

    def open_options(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity_bytes, "codec": CODECS[self.codec],
                "sync": self.sync, "extent_bytes": self.extent_bytes,
                "staging_bytes": self.staging_bytes, "engine": self.io_engine,
                "file_mode": self.file_mode, "strict_permissions": self.strict_permissions,
                "memory_bytes": self.memory_bytes, "backlog_bytes": self.backlog_bytes,
                "allow_new_namespace": True}
