"""Options of the SGLang HiCache backend (``--hicache-storage-backend-extra-config``),
checked up front, and where each SGLang rank keeps its store.

Kept apart from :mod:`kvstore.integrations.sglang` so that it imports without SGLang (and
is unit-tested in the main test environment).  docs/sglang.md has the launch line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.codecs import CodecSpec
from kvstore.integrations.extra_config import file_mode, remote_config
from kvstore.integrations.vllm_config import CODECS
from kvstore.remote.config import RemoteConfig

__all__ = ["CODECS", "SGLANG_KEYS", "BackendConfig", "rank_dir"]

# Keys of the extra config that are SGLang's own: the factory's (dynamic loading) and the
# cache controller's.  Accepted and left to SGLang.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size"})

_P = "kvstore HiCache backend"


@dataclass(frozen=True)
class BackendConfig:
    """The extra config's kvstore options; only ``path`` is required.

    ``path``            store directory (created if missing); each SGLang rank process
                        has its own below it when there are several (:func:`rank_dir`).
    ``capacity_bytes``  bound on stored bytes; least-recently-used chains' tails are
                        evicted first (default: the store's, 90% of free disk space).
    ``codec``           ``"raw"`` (default), ``"zstd"`` (lossless), or the lossy
                        ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (each optionally ``+zstd``).
                        Part of the key scope: pages written under one codec are not
                        read under another.
    ``sync``            True (default): a saved page survives power loss once
                        ``batch_set*`` returned True.  False: it survives a crash of the
                        process only (no fdatasync).
    ``extent_bytes``    size of each preallocated extent file (default 1 GiB).
    ``staging_bytes``   the store's host staging arena (default 256 MiB); bounds the
                        largest page segment (one page's K or V, all layers).
    ``io_engine``       ``"auto"`` (default), ``"io_uring"`` or ``"threads"``.
    ``memory_bytes``    host-memory tier in front of the disk (default 0: off).
    ``backlog_bytes``   bytes of saves in flight beyond which a background save is
                        dropped whole (default 1 GiB); see ``background_saves``.
    ``background_saves``  False (default): every ``batch_set`` is written before it
                        returns (SGLang's backup thread waits, the forward pass does
                        not).  True: under backpressure a batch is dropped whole and its
                        pages reported as not stored.
    ``remote``          the shared S3 tier behind the store: an object of
                        :class:`~kvstore.remote.RemoteConfig` options (``hmac_key_file``
                        names a file holding the HMAC key; credentials come from the AWS
                        environment, never from this config, which SGLang logs).
    ``model``           the name of the weights in the key scope, instead of SGLang's
                        ``model_name`` (``--served-model-name`` / ``--model-path``); set
                        it to a build id when one name serves different weights.
    ``cache_salt``      any string, added to the key scope (two deployments of the same
                        model that must not share pages).
    ``file_mode``       permissions of the store's files, an int or an octal string.
    """

    path: str
    capacity_bytes: int | None = None
    codec: str = "raw"
    sync: bool = True
    extent_bytes: int = 1 << 30
    staging_bytes: int = 256 << 20
    io_engine: str = "auto"
    memory_bytes: int = 0
    backlog_bytes: int = 1 << 30
    background_saves: bool = False
    remote: RemoteConfig | None = None
    model: str | None = None
    cache_salt: str | None = None
    file_mode: int | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> BackendConfig:
        """Validate SGLang's extra config (a JSON object); every error names the key."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"{_P}: the extra config must be a JSON object, got {extra!r}")
        options = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{_P}: unknown extra config keys {unknown}; kvstore's keys are "
                             f"{sorted(known)}, SGLang's {sorted(SGLANG_KEYS)}")
        path = options.get("path")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f'{_P}: the extra config needs "path", the store directory '
                             '(e.g. {"path": "/nvme/kvstore"})')
        options["path"] = os.fspath(path)
        for name in ("capacity_bytes", "extent_bytes", "staging_bytes", "backlog_bytes"):
            value = options.get(name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"{_P}: {name} must be a positive int, got {value!r}")
        memory = options.get("memory_bytes", 0)
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            raise ValueError(f"{_P}: memory_bytes must be an int >= 0 (0: no memory tier), "
                             f"got {memory!r}")
        for name in ("sync", "background_saves"):
            if name in options and not isinstance(options[name], bool):
                raise ValueError(f"{_P}: {name} must be true or false, got {options[name]!r}")
        if options.get("codec", "raw") not in CODECS:
            raise ValueError(f"{_P}: codec must be one of {sorted(CODECS)}, "
                             f"got {options['codec']!r}")
        if options.get("io_engine", "auto") not in ("auto", "io_uring", "threads"):
            raise ValueError(f"{_P}: io_engine must be 'auto', 'io_uring' or 'threads', "
                             f"got {options['io_engine']!r}")
        for name in ("model", "cache_salt"):
            value = options.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{_P}: {name} must be a non-empty string, got {value!r}")
        if options.get("remote") is not None:
            options["remote"] = remote_config(options["remote"], _P, "the extra config")
        if options.get("file_mode") is not None:
            options["file_mode"] = file_mode(options["file_mode"], _P)
        return cls(**options)

    @property
    def codec_spec(self) -> CodecSpec | None:
        return CODECS[self.codec]

    def open_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`kvstore.open_blocking` (the remote tier is attached
        once the key scope is known, when SGLang registers its host pool)."""
        return {"capacity_bytes": self.capacity_bytes, "codec": self.codec_spec,
                "sync": self.sync, "extent_bytes": self.extent_bytes,
                "staging_bytes": self.staging_bytes, "engine": self.io_engine,
                "file_mode": self.file_mode, "memory_bytes": self.memory_bytes,
                "backlog_bytes": self.backlog_bytes, "allow_new_namespace": True}


def _positive_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def rank_dir(path: str, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
             attn_cp_rank: int, attn_cp_size: int, dp_rank: int, replicated: bool) -> str:
    """The store directory of one SGLang scheduler process.

    A store directory is served by one process (its lock, its LMDB writer, its
    allocator), and SGLang runs one scheduler process per TP x PP x CP rank (and per
    data-parallel attention group): each gets ``path/<its ranks>``, e.g. ``path/tp1of2``;
    a single process uses ``path`` itself.  ``replicated`` (MLA: every TP rank holds
    the same KV) leaves the TP rank out."""
    parts = []
    if tp_size > 1 and not replicated:
        parts.append(f"tp{tp_rank}of{tp_size}")
    if pp_size > 1:
        parts.append(f"pp{pp_rank}of{pp_size}")
    if attn_cp_size > 1:
        parts.append(f"cp{attn_cp_rank}of{attn_cp_size}")
    if dp_rank:
        parts.append(f"dp{dp_rank}")
    return os.path.join(path, "-".join(parts)) if parts else path
