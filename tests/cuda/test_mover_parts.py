"""The data mover's parts on their own (issue 32's split of kvstore/cuda/mover.py): the
backpressure (leases held until their copies ended, the copy-out rate cap) and the names
the facade re-exports.  The mover's behaviour through them is tests/cuda/test_mover.py's."""

from __future__ import annotations

import threading

import torch

from kvstore.cuda import _lib, batches, mover, mover_core
from kvstore.cuda.backpressure import PendingLeases, RateCap, fired


class _Notice:
    def __init__(self) -> None:
        self.done = False
        self.failed = False

    def poll(self) -> bool:
        if self.failed:
            raise _lib.CudaError("kvc_stream_query", 700, "an illegal memory access")
        return self.done


class _Lease:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_the_facade_re_exports_the_names_that_moved() -> None:
    assert mover.SaveBatch is batches.SaveBatch and mover.LoadBatch is batches.LoadBatch
    assert mover.MoverStats is mover_core.MoverStats
    assert mover.CaptureError is mover_core.CaptureError
    assert sorted(mover.__all__) == ["CaptureError", "LoadBatch", "Mover", "MoverStats",
                                     "SaveBatch"]


def test_a_lease_goes_back_only_once_its_notice_fired() -> None:
    leases = PendingLeases(threading.Lock())
    now, later, failed = _Lease(), _Lease(), _Lease()
    leases.retire(now, None)                        # nothing enqueued: back at once
    assert now.released == 1 and len(leases) == 0
    n1, n2 = _Notice(), _Notice()
    leases.retire(later, n1)                        # type: ignore[arg-type]
    leases.retire(failed, n2)                       # type: ignore[arg-type]
    assert len(leases) == 2 and leases.reap() == 0 and later.released == 0
    n2.failed = True                                # a failed stream ran its callback too
    assert fired(n2) and leases.reap() == 1 and failed.released == 1
    n1.done = True
    assert leases.reap() == 1 and later.released == 1 and len(leases) == 0
    held = _Lease()
    leases.retire(held, _Notice())                  # type: ignore[arg-type]
    leases.release_all()                            # at close, the streams drained
    assert held.released == 1 and len(leases) == 0


def test_the_rate_cap_refills_at_its_rate_with_one_second_of_burst() -> None:
    assert RateCap(None, lambda: 0.0).allow(1 << 40)
    now = [0.0]
    cap = RateCap(100.0, lambda: now[0])
    assert cap.allow(60) and not cap.allow(60)      # 40 left this second
    now[0] += 0.2                                   # +20
    assert cap.allow(60) and not cap.allow(1)
    now[0] += 10.0                                  # full again, not more than a second's
    assert cap.allow(100) and not cap.allow(1)


def test_a_batch_tells_its_reader_the_mover_s_geometry() -> None:
    # The connector reads batch.mover's cuda, codec, dtype and block_shape
    # (kvstore/integrations/vllm/worker/background_puts.py).
    layers = [torch.zeros(2, 4, 2, 1, 8) for _ in range(3)]
    m = mover.Mover(layers, "kv_first", staging_bytes=1 << 16, lib=None)
    batch = m.begin_save([1, 2])
    assert batch is not None
    core = batch.mover
    assert isinstance(core, mover_core.MoverCore)
    assert (core.cuda, core.codec, core.dtype, core.block_shape) == (
        m.cuda, m.codec, m.dtype, m.block_shape)
    assert batch.staged().shape == (2, *m.block_shape)
    batch.release()
    m.close()
