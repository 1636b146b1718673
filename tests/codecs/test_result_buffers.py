"""Recycled memory for new result tensors (``kvstore.codecs.result_buffers``): memory comes back
only when nothing sees it any more, a get never writes into a tensor a caller still
holds, the pool stays within its bound, and a slab returned while the pool's lock is
held (a collection inside an allocation) neither deadlocks nor is lost."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import kvstore
from kvstore.codecs import result_buffers
from kvstore.codecs.pipeline import CodecSpec
from kvstore.codecs.result_buffers import MIN_BYTES, ResultBuffers
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor, same

SHAPE = (4, MIN_BYTES // 8)  # bfloat16: MIN_BYTES exactly
NBYTES = MIN_BYTES


def test_memory_comes_back_only_when_every_view_of_it_is_gone() -> None:
    pool = ResultBuffers(4 * NBYTES)
    first = pool.empty(SHAPE, torch.bfloat16)
    address = first.data_ptr()
    row = first[1]  # a view: holds the storage
    array = first[2].view(torch.int16).numpy()  # a numpy array over it: holds it too
    del first
    assert pool.empty(SHAPE, torch.bfloat16).data_ptr() != address
    del row
    assert pool.empty(SHAPE, torch.bfloat16).data_ptr() != address
    assert pool.stats().reused == 1  # the second empty() took the one just dropped
    del array
    again = pool.empty(SHAPE, torch.bfloat16)
    assert again.data_ptr() == address
    assert pool.stats().reused == 2


def test_a_result_is_an_ordinary_writable_tensor() -> None:
    pool = ResultBuffers(4 * NBYTES)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.uint8,
                  torch.float8_e4m3fn):
        n = NBYTES // dtype.itemsize
        t = pool.empty((2, n // 2), dtype)
        assert (t.dtype, t.shape, t.is_contiguous(), t.device.type) == \
            (dtype, torch.Size((2, n // 2)), True, "cpu")
        t.view(torch.uint8).fill_(7)
        assert int(t.view(torch.uint8).sum()) == 7 * NBYTES
        del t


def test_small_results_and_a_disabled_pool_use_plain_allocations() -> None:
    pool = ResultBuffers(4 * NBYTES)
    small = pool.empty((MIN_BYTES // 2 - 1,), torch.uint8)
    del small
    assert pool.stats() == result_buffers.ResultBufferStats()
    off = ResultBuffers(0)
    for _ in range(2):
        t = off.empty(SHAPE, torch.bfloat16)
        del t
    assert off.stats().reused == 0 and off.stats().idle_bytes == 0


def test_idle_memory_stays_within_the_bound_least_recently_returned_size_first() -> None:
    pool = ResultBuffers(3 * NBYTES)
    big = [pool.empty((NBYTES,), torch.uint8) for _ in range(2)]
    bigger = [pool.empty((NBYTES * 2,), torch.uint8) for _ in range(1)]
    del big  # 2 x NBYTES idle
    assert pool.stats().idle_bytes == 2 * NBYTES
    del bigger  # 4 x NBYTES would be idle: the oldest size (NBYTES) gives way
    s = pool.stats()
    assert s.idle_bytes == 3 * NBYTES and s.dropped == 1
    pool.resize(2 * NBYTES)  # the older size goes first
    s = pool.stats()
    assert s.idle_bytes == 2 * NBYTES and s.dropped == 2
    t = pool.empty((NBYTES * 2,), torch.uint8)
    assert pool.stats().reused == 1
    del t
    pool.release()
    assert pool.stats().idle_bytes == 0
    with pytest.raises(ValueError, match=">= 0"):
        pool.resize(-1)


def test_dropped_results_are_filed_at_once_within_the_bound() -> None:
    """A process that drops a large read and goes idle keeps at most the bound: slabs
    are filed (and trimmed) when they come back, not at the next allocation."""
    pool = ResultBuffers(2 * NBYTES)
    held = [pool.empty((NBYTES,), torch.uint8) for _ in range(5)]
    del held
    assert not pool._returned and pool._idle_bytes == 2 * NBYTES
    assert pool.stats().dropped == 3
    out = [pool.empty((NBYTES,), torch.uint8) for _ in range(3)]
    pool.resize(0)  # off while results are out: they are not kept when they die
    del out
    assert not pool._returned and pool._idle_bytes == 0


def test_a_slab_returned_while_the_pool_is_locked_is_filed_later() -> None:
    """The weakref callback runs wherever the last reference dies, e.g. in a garbage
    collection that an allocation inside ``empty`` triggered, with the lock held: it
    must not take the lock (a deadlock) and the slab must not be lost."""
    pool = ResultBuffers(4 * NBYTES)
    t = pool.empty(SHAPE, torch.bfloat16)
    address = t.data_ptr()
    finished = threading.Event()

    def drop_while_locked() -> None:
        nonlocal t
        with pool._lock:
            del t  # the callback runs here, under the lock
        finished.set()

    worker = threading.Thread(target=drop_while_locked, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert finished.is_set(), "the release callback took the pool's lock: deadlock"
    assert pool.empty(SHAPE, torch.bfloat16).data_ptr() == address


def test_threads_taking_and_dropping_never_share_live_memory() -> None:
    pool = ResultBuffers(8 * NBYTES)
    errors: list[str] = []
    start = threading.Barrier(4)

    def worker(tag: int) -> None:
        start.wait()
        held: list[tuple[int, torch.Tensor]] = []
        for i in range(200):
            value = (tag * 64 + i) % 251
            t = pool.empty((NBYTES,), torch.uint8)
            t.fill_(value)
            held.append((value, t))
            if len(held) > 3:  # drop the oldest: its slab goes back for anyone
                old_value, old = held.pop(0)
                if not bool((old == old_value).all()):
                    errors.append(f"thread {tag}: a held result was overwritten")
                del old
        for value, t in held:
            if not bool((t == value).all()):
                errors.append(f"thread {tag}: a held result was overwritten")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    s = pool.stats()
    assert s.reused > 0 and s.reused + s.allocated == 800
    assert s.idle_bytes <= 8 * NBYTES


def test_a_bad_size_in_the_environment_is_a_clear_error(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv("KVSTORE_RESULT_BUFFER_BYTES", "lots")
    with pytest.raises(ValueError, match="KVSTORE_RESULT_BUFFER_BYTES='lots'"):
        result_buffers._default_max_bytes()
    monkeypatch.setenv("KVSTORE_RESULT_BUFFER_BYTES", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        result_buffers._default_max_bytes()
    monkeypatch.setenv("KVSTORE_RESULT_BUFFER_BYTES", str(64 << 20))
    assert result_buffers._default_max_bytes() == 64 << 20


@pytest.mark.anyio
@pytest.mark.parametrize("memory_bytes", [0, 32 << 20], ids=["disk", "memory-tier"])
@pytest.mark.parametrize("codec", [None, CodecSpec(zstd=True)], ids=["raw", "zstd"])
async def test_a_get_never_writes_into_a_result_the_caller_still_holds(
        tmp_path: Path, memory_bytes: int, codec: CodecSpec | None) -> None:
    """Gets into new tensors take recycled memory, but only memory whose earlier
    results are gone: results held across later gets keep their bytes."""
    shape = (4, 16, MIN_BYTES // 128)  # bfloat16: MIN_BYTES per block
    ks = keys(8)
    values = [make_tensor(torch.bfloat16, shape, i) for i in range(8)]
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT,
                            memory_bytes=memory_bytes, codec=codec) as store:
        await store.put_many(ks, values, parents=kvstore.chain_parents(ks))
        held = await store.get_many(ks[:4])
        before = result_buffers.stats()
        for _ in range(3):  # results dropped at once: their memory is reused
            dropped = await store.get_many(ks[4:])
            assert all(same(g, v) for g, v in zip(dropped, values[4:]))
            del dropped
        after = result_buffers.stats()
        assert after.reused - before.reused >= 8
        assert all(same(g, v) for g, v in zip(held, values[:4]))
        addresses = {t.data_ptr() for t in held if t is not None}
        again = await store.get_many(ks)
        assert not addresses & {t.data_ptr() for t in again if t is not None}
        assert all(same(g, v) for g, v in zip(again, values))
        assert all(same(g, v) for g, v in zip(held, values[:4]))
    assert np.array_equal(held[0].view(torch.int16).numpy(), values[0].view(torch.int16).numpy())
