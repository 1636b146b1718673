"""kvstore/cuda/fp8.py: the device paths allocate their scratch memory and launch on the
tensor's GPU, not on whichever device the thread happens to have current, and give the
thread its device back.

Runs the real encode_device/decode_device code against the stand-in runtime
(tests/cuda/standin.py): "device memory" is host memory and the kernels are the built
library's real host twins, so the payloads are checked against kvstore.codecs too.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec, KVLayout
from kvstore.cuda import fp8
from tests.cuda.standin import StandInLibrary

SPEC = CodecSpec(fp8="e4m3", layout=KVLayout(0, 1, 2))


def test_encode_device_allocates_and_launches_on_the_tensors_device(
        standin_kernels: StandInLibrary) -> None:
    x = torch.randn(2, 16, 4, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    # the thread is on device 0; the block lives on device 1
    codec, payload = fp8.encode_device(x.data_ptr(), x.dtype, tuple(x.shape), SPEC,
                                       stream=0, device=1)
    want = codecs.encode(x, SPEC)
    assert codec == want[0] and np.array_equal(payload, want[1])
    assert standin_kernels.devices_of("kvc_malloc") == [1]
    assert standin_kernels.devices_of("kvc_fp8_encode") == [1]
    assert standin_kernels.current == 0


def test_decode_device_allocates_and_launches_on_the_output_device(
        standin_kernels: StandInLibrary) -> None:
    x = torch.randn(2, 8, 4, 32, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    codec, payload = codecs.encode(x, SPEC)
    out = torch.empty_like(x)
    fp8.decode_device(codec, payload, x.dtype, tuple(x.shape), out.data_ptr(), stream=0,
                      device=1)
    assert torch.equal(out.view(torch.int16),
                       codecs.decode(codec, payload, x.dtype, tuple(x.shape)).view(torch.int16))
    assert standin_kernels.devices_of("kvc_malloc") == [1]
    assert standin_kernels.devices_of("kvc_fp8_decode") == [1]
    assert standin_kernels.current == 0


def test_encode_device_without_a_device_uses_the_current_one(
        standin_kernels: StandInLibrary) -> None:
    x = torch.ones(4, 32, dtype=torch.float16)
    fp8.encode_device(x.data_ptr(), x.dtype, tuple(x.shape), CodecSpec(fp8="e5m2"))
    assert standin_kernels.devices_of("kvc_malloc") == [0]
    assert "kvc_set_device" not in [n for n, _ in standin_kernels.calls]
