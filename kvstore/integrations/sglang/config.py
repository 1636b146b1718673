"""Options of the SGLang HiCache backend (``--hicache-storage-backend-extra-config``),
checked up front, and where each SGLang rank keeps its store, with which share of the
engine's capacity.

Kept apart from :mod:`kvstore.integrations.sglang` so that it imports without SGLang (and
is unit-tested in the main test environment).  docs/sglang.md has the launch line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.codecs.pipeline import CodecSpec
from kvstore.integrations.common.extra_config import (
    CODECS,
    STORE_KEYS,
    codec_name,
    engine_store_defaults,
    refuse_integration_keys,
    store_open_options,
    store_options,
)
from kvstore.integrations.common.ranks import rank_options
from kvstore.options import StoreOptions
from kvstore.tiers.remote.config import RemoteConfig

__all__ = ["CODECS", "SGLANG_KEYS", "BackendConfig", "rank_dir", "rank_store"]

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

    Every store option of :func:`kvstore.open` (:class:`~kvstore.options.StoreOptions`:
    ``capacity_bytes``, ``codec``, ``sync``, ``extent_bytes``, ``staging_bytes``,
    ``memory_bytes``, ``backlog_bytes``, ``file_mode``, ``scrub_bytes_per_s`` (a
    background scrub at that rate), ``remote``, ...) is a key too,
    with the store's default, in the JSON forms of
    :mod:`kvstore.integrations.common.extra_config` (``io_engine`` for ``engine``, a codec's
    name, an octal string for ``file_mode``); they make ``store``.  For SGLang: the codec
    is part of the key scope (pages written under one codec are not read under
    another); ``sync`` True (the default): a saved page survives power loss once
    ``batch_set*`` returned True; ``staging_bytes`` bounds the largest page segment
    (one page's K or V, all layers); ``remote`` is the shared S3 tier behind the store
    (credentials from the AWS environment, never from this config, which SGLang
    logs), attached once the key scope is known.  The backend's own:

    ``path``            store directory (created if missing); each SGLang rank process
                        has its own below it when there are several (:func:`rank_dir`),
                        and ``capacity_bytes`` and ``memory_bytes`` are then split
                        between them (:func:`rank_store`).
    ``background_saves``  False (default): every ``batch_set`` is written before it
                        returns (SGLang's backup thread waits, the forward pass does
                        not).  True: under backpressure (``backlog_bytes``) a batch is
                        dropped whole and its pages reported as not stored.
    ``model``           the name of the weights in the key scope, instead of SGLang's
                        ``model_name`` (``--served-model-name`` / ``--model-path``); set
                        it to a build id when one name serves different weights.
    ``cache_salt``      any string, added to the key scope (two deployments of the same
                        model that must not share pages).
    """

    path: str
    store: StoreOptions = field(default_factory=engine_store_defaults)
    background_saves: bool = False
    model: str | None = None
    cache_salt: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> BackendConfig:
        """Validate SGLang's extra config (a JSON object); every error names the key."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"{_P}: the extra config must be a JSON object, got {extra!r}")
        options = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        refuse_integration_keys(options, _P, "the extra config")
        own = {f.name for f in fields(cls)} - {"store"}
        unknown = sorted(set(options) - own - set(STORE_KEYS))
        if unknown:
            raise ValueError(f"{_P}: unknown extra config keys {unknown}; kvstore's keys are "
                             f"{sorted(own | set(STORE_KEYS))}, SGLang's {sorted(SGLANG_KEYS)}")
        path = options.get("path")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f'{_P}: the extra config needs "path", the store directory '
                             '(e.g. {"path": "/nvme/kvstore"})')
        options["path"] = os.fspath(path)
        store = store_options(options, _P, "the extra config")
        if "background_saves" in options and not isinstance(options["background_saves"], bool):
            raise ValueError(f"{_P}: background_saves must be true or false, "
                             f"got {options['background_saves']!r}")
        for name in ("model", "cache_salt"):
            value = options.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{_P}: {name} must be a non-empty string, got {value!r}")
        return cls(store=store, **options)

    @property
    def codec(self) -> str:
        """The store's codec by its :data:`CODECS` name (part of the key scope)."""
        return codec_name(self.store.codec)

    @property
    def codec_spec(self) -> CodecSpec | None:
        return self.store.codec

    @property
    def remote(self) -> RemoteConfig | None:
        return self.store.remote

    def open_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`kvstore.open_blocking` (the remote tier is attached
        once the key scope is known, when SGLang registers its host pool)."""
        return store_open_options(self.store)


def rank_dir(path: str, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
             attn_cp_rank: int, attn_cp_size: int, replicated: bool) -> str:
    """The store directory of one SGLang scheduler process.

    SGLang runs one scheduler process per TP x PP x CP rank (and per data-parallel
    attention group).  Ranks that hold different shards of a page get a directory each,
    ``path/<its ranks>``, e.g. ``path/tp1of2`` (they never read each other's pages, and
    would only contend on one index); a single process uses ``path`` itself.  Processes
    that hold the same KV share one directory, as several processes may (issue 43):
    data-parallel attention groups, several servers on one path, and the TP ranks of an
    MLA model (``replicated``: every TP rank holds the same KV; SGLang writes it from
    rank 0, every rank reads it)."""
    parts = []
    if tp_size > 1 and not replicated:
        parts.append(f"tp{tp_rank}of{tp_size}")
    if pp_size > 1:
        parts.append(f"pp{pp_rank}of{pp_size}")
    if attn_cp_size > 1:
        parts.append(f"cp{attn_cp_rank}of{attn_cp_size}")
    return os.path.join(path, "-".join(parts)) if parts else path


def rank_store(config: BackendConfig, storage_config: Any, *, replicated: bool
               ) -> tuple[str, StoreOptions]:
    """The store directory of this SGLang rank process (:func:`rank_dir`) and its store
    options: the engine's capacity and memory tier split between the rank processes
    that share the disk (TP x PP x attention CP), by the rule of every integration
    (:func:`kvstore.integrations.common.ranks.rank_options`).  Data-parallel attention
    groups are not counted: they share one directory, and so its capacity."""
    sc = storage_config
    path = rank_dir(config.path, tp_rank=sc.tp_rank, tp_size=sc.tp_size,
                    pp_rank=sc.pp_rank, pp_size=sc.pp_size, attn_cp_rank=sc.attn_cp_rank,
                    attn_cp_size=sc.attn_cp_size, replicated=replicated)
    ranks = (1 if replicated else sc.tp_size) * sc.pp_size * sc.attn_cp_size
    return path, rank_options(config.store, path, ranks, _P)
