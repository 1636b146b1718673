"""``open(io_scheduling=...)``: True (the default bounds), False (no scheduler) or a
:class:`kvstore.IoSchedule` whose bounds the store's scheduler then uses; bad bounds are
refused when the schedule is made, a wrong type before anything is created.  The
scheduler itself is tested in tests/io/test_scheduler*.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.disk.format import PAGE
from kvstore.testing import parts
from tests.conformance import NS, keys, make_tensor, same

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (BLOCK,), i)


async def _get_then_put(store: kvstore.Store, tag: int) -> kvstore.StoreStats:
    """A get, then a put of 8 blocks right after it; the store's stats."""
    first, *rest = keys(9, tag)
    await store.put_many([first], [block(0)])
    (got,) = await store.get_many([first])
    assert got is not None and same(got, block(0))
    await store.put_many(rest, [block(i) for i in range(1, 9)])
    got_rest = await store.get_many(rest)
    assert all(g is not None and same(g, block(i + 1)) for i, g in enumerate(got_rest))
    return store.stats()


@pytest.mark.parametrize("grace", [0.0, 3600.0])
async def test_the_store_schedules_with_the_bounds_it_was_given(tmp_path: Path,
                                                                grace: float) -> None:
    """With an hour of grace the put after a get still counts as under a get: its
    writes go in 64 KiB pieces with a flush every 128 KiB; with none, no flush of the
    scheduler's own."""
    schedule = kvstore.IoSchedule(write_bytes_busy=16 * PAGE, dirty_bytes_busy=32 * PAGE,
                                  read_grace_s=grace)
    async with kvstore.open(tmp_path / "s", namespace=NS, create=True, extent_bytes=4 << 20,
                            io_scheduling=schedule) as store:
        assert parts(store).scheduler is not None
        st = await _get_then_put(store, 100)
    assert (st.io_busy_flushes > 0) == bool(grace)


async def test_without_scheduling_there_is_no_scheduler(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path / "s", namespace=NS, create=True, extent_bytes=4 << 20,
                            io_scheduling=False) as store:
        assert parts(store).scheduler is None
        st = await _get_then_put(store, 200)
    assert st.io_busy_flushes == 0 and st.io_deferred == {}


@pytest.mark.parametrize(("bounds", "message"), [
    ({"write_bytes_busy": 1000}, "write_bytes_busy must be an int >= 4096"),
    ({"write_bytes_busy": 3 * PAGE + 1}, "must be a multiple of 4096"),
    ({"write_bytes_busy": 128 << 20}, "must not exceed write_bytes"),
    ({"dirty_bytes_busy": -1}, "dirty_bytes_busy must be an int >= 0"),
    ({"read_grace_s": -0.1}, "read_grace_s must be a finite number of seconds >= 0"),
    ({"read_grace_s": float("inf")}, "read_grace_s must be a finite number"),
])
def test_bad_bounds_are_refused_with_the_field_named(bounds: dict[str, float],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvstore.IoSchedule(**bounds)  # type: ignore[arg-type]


async def test_a_wrong_type_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="io_scheduling must be True, False or a "
                                        "kvstore.IoSchedule"):
        async with kvstore.open(tmp_path / "s", namespace=NS, create=True,
                                io_scheduling="on"):  # type: ignore[arg-type]
            pass
    assert not (tmp_path / "s").exists()
