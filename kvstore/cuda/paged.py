"""Gather/scatter of paged KV blocks between an engine's cache and contiguous staging.

vLLM keeps one cache tensor per layer, in one of two families of layouts:

``"kv_first"``      ``[2, num_blocks, ...]`` -- e.g. FlashAttention's
                    ``[2, num_blocks, block_size, kv_heads, head_dim]`` (or its HND
                    variant ``[2, num_blocks, kv_heads, block_size, head_dim]``);
``"blocks_first"``  ``[num_blocks, ...]`` -- e.g. FlashInfer's
                    ``[num_blocks, 2, block_size, kv_heads, head_dim]``, MLA's
                    ``[num_blocks, block_size, head_dim]``, or one cross-layer tensor
                    ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``.

Everything after the block axis is one block's data and must be contiguous (the
tensor itself may be a strided view, e.g. a slice along the block axis).  The staging
tensor holds block ``i`` = ``block_ids[i]`` contiguously, layers in order:
``[n, num_layers, *per_block]`` with ``per_block = (2, *layer.shape[2:])`` for
``kv_first`` and ``layer.shape[1:]`` for ``blocks_first``.  That is the byte layout
the kernels (``cuda_ext/gather_scatter.cu``) produce, so a staged block can be put as
one kvstore block.

:func:`gather` / :func:`scatter` run the kernel on the caller's torch stream when the
tensors are on a CUDA device, the staging tensor is memory the kernel can reach (that
device's, or page-locked host memory: :func:`device_can_reach`) and the library
is usable; otherwise the torch reference
(:func:`gather_reference` / :func:`scatter_reference`, index_select/index_copy_) runs,
on any device, with identical bytes.  :func:`gather_ptrs` / :func:`scatter_ptrs` take
raw device pointers (for callers without torch CUDA, e.g. the GPU checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from kvstore.cuda._lib import Library, runtime
from kvstore.cuda.device import on_device
from kvstore.cuda.page_locked import pool

__all__ = ["LAYOUTS", "Layout", "cuda_index", "device_can_reach", "gather", "gather_ptrs",
           "gather_reference",
           "scatter", "scatter_ptrs", "scatter_reference", "staging_shape"]

Layout = Literal["kv_first", "blocks_first"]
LAYOUTS: tuple[str, ...] = ("kv_first", "blocks_first")


def _block_axis(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "kv_first" else 0


def _check_layers(layers: Sequence[torch.Tensor], layout: str) -> int:
    axis = _block_axis(layout)
    if not layers:
        raise ValueError("gather/scatter needs at least one layer tensor")
    first = layers[0]
    for i, t in enumerate(layers):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; every "
                             f"layer must match layer 0 ({tuple(first.shape)} {first.dtype} "
                             f"on {first.device})")
    if first.dim() < axis + 2:
        raise ValueError(f"a {layout} cache needs at least {axis + 2} dims, got shape "
                         f"{tuple(first.shape)}")
    if layout == "kv_first" and first.shape[0] != 2:
        raise ValueError(f"a kv_first cache is [2, num_blocks, ...], got shape {tuple(first.shape)}")
    return axis


def staging_shape(layer_shape: Sequence[int], n_layers: int, n_blocks: int,
                  layout: str) -> tuple[int, ...]:
    """Shape of the staging tensor for ``n_blocks`` blocks of ``n_layers`` layers."""
    shape = tuple(int(d) for d in layer_shape)
    per_block = (2, *shape[2:]) if _block_axis(layout) == 1 else shape[1:]
    return (n_blocks, n_layers, *per_block)


def _ids(block_ids: Sequence[int] | torch.Tensor | npt.NDArray[np.int64], num_blocks: int,
         unique: bool) -> npt.NDArray[np.int64]:
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    else:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(f"block ids must be in [0, {num_blocks}), got min {int(ids.min())}, "
                         f"max {int(ids.max())}")
    if unique and np.unique(ids).size != ids.size:
        raise ValueError("scatter block ids must be distinct (two staging blocks cannot land "
                         "in one cache block)")
    return np.ascontiguousarray(ids)


def _check_staging(staging: torch.Tensor, want: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(staging.shape) != want or staging.dtype != dtype:
        raise ValueError(f"staging must be {want} {dtype}, got {tuple(staging.shape)} "
                         f"{staging.dtype}")


# ------------------------------------------------------------------------ reference


def gather_reference(layers: Sequence[torch.Tensor],
                     block_ids: Sequence[int] | torch.Tensor | npt.NDArray[np.int64],
                     layout: Layout, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch gather (any device): the CPU fallback and the kernels' reference."""
    axis = _check_layers(layers, layout)
    ids_np = _ids(block_ids, layers[0].shape[axis], unique=False)
    ids = torch.from_numpy(ids_np).to(layers[0].device)
    per_layer = []
    for t in layers:
        sel = t.index_select(axis, ids)            # kv_first: [2, n, ...]; else [n, ...]
        per_layer.append(sel.transpose(0, 1) if axis == 1 else sel)
    staged = torch.stack(per_layer, dim=1)
    if out is None:
        return staged.contiguous()
    _check_staging(out, tuple(staged.shape), staged.dtype)
    out.copy_(staged)
    return out


def scatter_reference(staging: torch.Tensor, layers: Sequence[torch.Tensor],
                      block_ids: Sequence[int] | torch.Tensor | npt.NDArray[np.int64],
                      layout: Layout) -> None:
    """torch scatter (any device), the inverse of :func:`gather_reference`."""
    axis = _check_layers(layers, layout)
    ids_np = _ids(block_ids, layers[0].shape[axis], unique=True)
    _check_staging(staging, staging_shape(layers[0].shape, len(layers), ids_np.size, layout),
                   layers[0].dtype)
    ids = torch.from_numpy(ids_np).to(layers[0].device)
    src = staging.to(layers[0].device)
    for i, t in enumerate(layers):
        part = src[:, i]
        t.index_copy_(axis, ids, part.transpose(0, 1) if axis == 1 else part)


# ------------------------------------------------------------------------ kernels


def _geometry(t: torch.Tensor, axis: int) -> tuple[int, int, int, int]:
    """(outer, outer_stride, block_stride, inner_bytes) of a layer, bytes; the per-block
    part must be contiguous."""
    esz = t.element_size()
    tail = t.shape[axis + 1:]
    expect = 1
    for d in range(t.dim() - 1, axis, -1):
        if t.shape[d] > 1 and t.stride(d) != expect:
            raise ValueError(f"the per-block part of a cache tensor must be contiguous "
                             f"(shape {tuple(t.shape)}, strides {t.stride()})")
        expect *= t.shape[d]
    inner = int(np.prod(tail, dtype=np.int64)) * esz
    outer = 2 if axis == 1 else 1
    outer_stride = t.stride(0) * esz if axis == 1 else 0
    return outer, outer_stride, t.stride(axis) * esz, inner


def gather_ptrs(lib: Library, layer_ptrs: Sequence[int], outer: int, outer_stride: int,
                block_stride: int, inner_bytes: int, block_ids: npt.NDArray[np.int64],
                staging_ptr: int, stream: int) -> None:
    """Enqueue the gather kernel (raw pointers; see ``cuda_ext/kvcuda.h``)."""
    ptrs = np.asarray(layer_ptrs, dtype=np.uint64)
    ids = np.ascontiguousarray(block_ids, dtype=np.int64)
    lib.call("kvc_gather", ptrs.ctypes.data, ptrs.size, outer, outer_stride, block_stride,
             inner_bytes, ids.ctypes.data, ids.size, staging_ptr, stream)


def scatter_ptrs(lib: Library, layer_ptrs: Sequence[int], outer: int, outer_stride: int,
                 block_stride: int, inner_bytes: int, block_ids: npt.NDArray[np.int64],
                 staging_ptr: int, stream: int) -> None:
    """Enqueue the scatter kernel (raw pointers)."""
    ptrs = np.asarray(layer_ptrs, dtype=np.uint64)
    ids = np.ascontiguousarray(block_ids, dtype=np.int64)
    lib.call("kvc_scatter", ptrs.ctypes.data, ptrs.size, outer, outer_stride, block_stride,
             inner_bytes, ids.ctypes.data, ids.size, staging_ptr, stream)


def _use_kernel(layers: Sequence[torch.Tensor]) -> Library | None:
    rt = runtime()
    if layers[0].device.type == "cuda" and rt.usable:
        return rt.lib
    return None


def device_can_reach(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a kernel on CUDA ``device`` may read and write ``t`` (contiguous) through
    its pointer: memory of that device, or host memory that is page-locked (torch's
    ``pin_memory()``) or inside a range kvstore registered (the staging arena).  Pageable
    host memory is not mapped for the GPU: the kernel would fault, a sticky error that
    leaves the process's CUDA context unusable; another GPU's memory needs peer access
    that nothing here sets up.  Otherwise gather/scatter take the torch path."""
    if t.device.type == "cuda":
        return t.device == device
    if t.device.type != "cpu":
        return False
    if pool().covers(t.data_ptr(), t.numel() * t.element_size()):
        return True
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # a torch without CUDA cannot tell, and cannot pin either
        return False


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (``cuda`` alone: torch's current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def gather(layers: Sequence[torch.Tensor],
           block_ids: Sequence[int] | torch.Tensor | npt.NDArray[np.int64], layout: Layout,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into one staging tensor (module docstring).
    ``out`` may be a CUDA tensor or page-locked host memory the device can reach; the kernel
    is enqueued on torch's current stream (synchronise or await before reading ``out``
    on the host)."""
    axis = _check_layers(layers, layout)
    lib = _use_kernel(layers)
    if lib is None or (out is not None and not device_can_reach(out, layers[0].device)):
        return gather_reference(layers, block_ids, layout, out)
    ids = _ids(block_ids, layers[0].shape[axis], unique=False)
    want = staging_shape(layers[0].shape, len(layers), ids.size, layout)
    if out is None:
        out = torch.empty(want, dtype=layers[0].dtype, device=layers[0].device)
    _check_staging(out, want, layers[0].dtype)
    if not out.is_contiguous():
        raise ValueError("the staging tensor must be contiguous")
    outer, ostride, bstride, inner = _geometry(layers[0], axis)
    for t in layers[1:]:
        if _geometry(t, axis) != (outer, ostride, bstride, inner):
            raise ValueError("every layer must have the same strides")
    stream = int(torch.cuda.current_stream(layers[0].device).cuda_stream)
    with on_device(cuda_index(layers[0].device), lib):  # the stream's device
        gather_ptrs(lib, [t.data_ptr() for t in layers], outer, ostride, bstride, inner, ids,
                    out.data_ptr(), stream)
    return out


def scatter(staging: torch.Tensor, layers: Sequence[torch.Tensor],
            block_ids: Sequence[int] | torch.Tensor | npt.NDArray[np.int64],
            layout: Layout) -> None:
    """Copy staged blocks back into the cache at ``block_ids`` (distinct ids)."""
    axis = _check_layers(layers, layout)
    lib = _use_kernel(layers)
    if lib is None or not staging.is_contiguous() \
            or not device_can_reach(staging, layers[0].device):
        scatter_reference(staging, layers, block_ids, layout)
        return
    ids = _ids(block_ids, layers[0].shape[axis], unique=True)
    _check_staging(staging, staging_shape(layers[0].shape, len(layers), ids.size, layout),
                   layers[0].dtype)
    outer, ostride, bstride, inner = _geometry(layers[0], axis)
    for t in layers[1:]:
        if _geometry(t, axis) != (outer, ostride, bstride, inner):
            raise ValueError("every layer must have the same strides")
    stream = int(torch.cuda.current_stream(layers[0].device).cuda_stream)
    with on_device(cuda_index(layers[0].device), lib):
        scatter_ptrs(lib, [t.data_ptr() for t in layers], outer, ostride, bstride, inner, ids,
                     staging.data_ptr(), stream)
