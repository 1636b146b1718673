"""kvstore/cuda/paged.py: the kernel is given only memory the GPU can reach.

A kernel that writes a pageable host tensor through its pointer faults on the GPU (a
sticky error that ends the process's CUDA context), so gather/scatter must take the
torch path for it.  The decision, ``device_can_reach``, is tested here on real host
tensors; a range the store registered is registered through the stand-in runtime
(tests/cuda/standin.py), since cudaHostRegister cannot run here.  tests/gpu checks the
whole gather/scatter into such tensors on a GPU.
"""

from __future__ import annotations

import torch

from kvstore.cuda import paged
from kvstore.cuda.page_locked import pool
from kvstore.io.arena import Arena
from tests.cuda.standin import StandInLibrary

GPU = torch.device("cuda", 0)


def test_pageable_host_tensor_is_not_reachable() -> None:
    staging = torch.empty(4, 1024, dtype=torch.uint8)
    assert not staging.is_pinned()
    assert not paged.device_can_reach(staging, GPU)


def test_tensor_inside_a_registered_arena_is_reachable(standin: StandInLibrary) -> None:
    arena = Arena(1 << 20)
    try:
        inside = torch.frombuffer(arena.array, dtype=torch.uint8)[4096:8192]
        assert not paged.device_can_reach(inside, GPU)    # not registered yet
        pool().register(arena.address, arena.size, "test arena")
        try:
            assert paged.device_can_reach(inside, GPU)
            elsewhere = torch.empty(4096, dtype=torch.uint8)
            assert not paged.device_can_reach(elsewhere, GPU)
        finally:
            pool().unregister(arena.address)
        assert not paged.device_can_reach(inside, GPU)
    finally:
        arena.close()


def test_tensors_of_other_devices_are_not_reachable() -> None:
    assert not paged.device_can_reach(torch.empty(8, device="meta"), GPU)


def test_cpu_layers_take_the_torch_path_whatever_the_staging() -> None:
    layers = [torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)]
    out = torch.empty(paged.staging_shape(layers[0].shape, 1, 2, "kv_first"))
    got = paged.gather(layers, [4, 1], "kv_first", out=out)
    assert got is out and torch.equal(out, paged.gather_reference(layers, [4, 1], "kv_first"))
