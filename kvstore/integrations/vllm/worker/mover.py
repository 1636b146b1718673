"""The vLLM connector worker's data mover (:class:`kvstore.cuda.mover.Mover`), made from
the connector's options: its save and load staging, the copy-out caps, and where loads
stage (device memory with ``device_loads``).  Part of
:class:`~kvstore.integrations.vllm.worker.side.WorkerSide`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec
from kvstore.cuda.mover import Mover
from kvstore.cuda.paged import Layout
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.open_store import warn_once

__all__ = ["load_blocks", "make_mover"]


def make_mover(layers: list[torch.Tensor], layout: Layout, config: ConnectorConfig,
               store_codec: CodecSpec | None,
               clock: Callable[[], float] = time.monotonic) -> Mover:
    """The data mover for the engine's ``layers``, sized and capped by ``config``
    (``clock``: the rate cap's, in seconds).  On a GPU with an FP8 codec, saves are
    quantised there (half the bytes over PCIe), stored as the codec's payload, and
    (``device_loads``) loads are dequantised there; a CPU engine's store encodes and
    decodes as before."""
    cuda = layers[0].device.type == "cuda"
    spec = store_codec if cuda else None
    fp8 = spec is not None and \
        codecs.codec_id(spec) & 0x0F in (codecs.FP8_E4M3, codecs.FP8_E5M2)
    device_loads = cuda and config.wants_device_loads(fp8)
    kw: dict[str, Any] = dict(
        staging_bytes=config.max_pending_save_bytes,
        load_staging_bytes=config.load_staging_bytes, codec=spec,
        max_save_bytes_per_s=config.max_save_bytes_per_s,
        max_save_bytes_per_batch=config.max_save_bytes_per_step, clock=clock)
    try:
        mover = Mover(layers, layout, device_loads=device_loads, **kw)
    except torch.OutOfMemoryError as e:
        if config.device_loads is True:
            raise RuntimeError(
                f"kvstore connector: no room on {layers[0].device} for "
                f"load_staging_bytes={config.load_staging_bytes} of device load staging "
                "(it comes out of what gpu_memory_utilization leaves the engine); lower "
                "load_staging_bytes or gpu_memory_utilization, or set device_loads to "
                "false") from e
        warn_once("device-loads", "kvstore connector: no room on %s for %d bytes of "
                  "device load staging (%s); loads stage in page-locked host memory",
                  layers[0].device, config.load_staging_bytes, e)
        mover = Mover(layers, layout, device_loads=False, **kw)
    _check_sizes(mover, config)
    return mover


def load_blocks(mover: Mover, config: ConnectorConfig) -> int:
    """How many blocks the load staging holds: ``load_staging_bytes`` as given (the
    staging is made of whole pages, which may hold a little more)."""
    return min(mover.max_load_blocks, config.load_staging_bytes // mover.block_bytes)


def _check_sizes(mover: Mover, config: ConnectorConfig) -> None:
    """Each staging must hold one block (a stored block is one vLLM block of every
    layer), and the per-step cap one block's copy-out: else every save or load would be
    dropped, silently.  Sizes as given: the staging, made of whole pages, may hold more,
    but an option means what it says."""
    step_cap = config.max_save_bytes_per_step
    wrong = [f"{name}={value} cannot hold one block ({need} bytes: one vLLM block of "
             f"all {mover.num_layers} layers)" for name, value, need, ok in (
                 ("max_pending_save_bytes", config.max_pending_save_bytes,
                  mover.stored_bytes(1), mover.max_blocks > 0
                  and config.max_pending_save_bytes >= mover.stored_bytes(1)),
                 ("load_staging_bytes", config.load_staging_bytes, mover.block_bytes,
                  load_blocks(mover, config) > 0),
                 ("max_save_bytes_per_step", step_cap, mover.copied_bytes(1),
                  step_cap is None or step_cap >= mover.copied_bytes(1)))
             if not ok]
    if wrong:
        mover.close()
        raise ValueError(f"kvstore connector: {'; '.join(wrong)}")
