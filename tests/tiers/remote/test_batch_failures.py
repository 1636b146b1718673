"""One failed object in a batch is that object's failure, not its neighbours'
(kvstore/remote/): an object the cluster refuses (a 4xx about it) is neither a breaker
failure nor retried, a deleted bucket does not take the caller's code down with the
upload workers, and a promotion whose batch the local store refuses for one block
stores the others.

A real S3 endpoint on loopback (tests/tiers/remote/slow_s3.py) that answers the objects named
in ``refuse`` with the error given there and serves every other; nothing held, no
sleeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore.tiers.remote import objects
from tests.concurrency import DEADLINE, until
from tests.conformance import NS, keys, make_tensor, same
from tests.tiers.remote.slow_s3 import SlowS3
from tests.tiers.remote.test_slow_cluster import slow_config
from tests.tiers.remote.test_tier import open_store, parents, value

pytestmark = pytest.mark.anyio


def object_name(store: Any, key: bytes) -> str:
    return objects.object_name("slow", store.remote.namespace_digest, key)


async def write(s3: SlowS3, path: Path, ks: list[bytes], values: list[torch.Tensor],
                **options: Any) -> None:
    """Another node: stores ``ks`` and uploads them all."""
    async with kvstore.open(path, namespace=NS, remote=slow_config(s3), **options) as w:
        await w.put_many(ks, values, parents=parents(ks))
        with anyio.fail_after(DEADLINE):
            await w.remote.flush()
        assert w.remote.stats().uploaded_blocks == len(ks)


async def test_an_upload_the_cluster_refuses_is_given_up_alone(
        tmp_path: Path, anyio_backend: str) -> None:
    """Three blocks, the cluster refuses the middle one (400 EntityTooLarge): it is sent
    once and given up; the breaker stays closed and the others are uploaded.  Before,
    each refusal was a breaker failure and was retried: two opened the breaker, and every
    read and upload of the store stopped for ``breaker_reset_s``."""
    ks = keys(3)
    with SlowS3("kvstore", hold=()) as s3:
        async with open_store(tmp_path / "w", slow_config(s3, breaker_failures=2)) as w:
            s3.refuse[object_name(w, ks[1])] = (400, "EntityTooLarge")
            await w.put_many(ks, [value(i) for i in range(3)], parents=parents(ks))
            with anyio.fail_after(DEADLINE):
                await w.remote.flush()
            st = w.remote.stats()
            assert st.breaker_trips == 0 and st.state == "ok" and st.request_errors == 0
            assert s3.requests["PUT"] == 3  # the refused one was sent once
            assert (st.uploaded_blocks, st.upload_failed, st.refused_objects) == (2, 1, 1)


async def test_a_read_the_cluster_refuses_is_a_miss_alone(
        tmp_path: Path, anyio_backend: str) -> None:
    """A get of three blocks, one request at a time, the second object refused (400):
    that one is a miss, the third is still asked for and served.  Before, the refusal
    opened the breaker (``breaker_failures=1``) and the third was a fast miss."""
    ks = keys(3)
    with SlowS3("kvstore", hold=()) as s3:
        await write(s3, tmp_path / "w", ks, [value(i) for i in range(3)])
        cfg = slow_config(s3, concurrency=1, breaker_failures=1, read_deadline_s=DEADLINE)
        async with open_store(tmp_path / "r", cfg) as r:
            s3.refuse[object_name(r, ks[1])] = (400, "InvalidRequest")
            got = await r.get_many(ks)
            assert same(got[0], value(0)) and got[1] is None and same(got[2], value(2))
            st = r.remote.stats()
            assert st.breaker_trips == 0 and st.state == "ok"
            assert (st.hits, st.misses, st.refused_objects) == (2, 1, 1)


async def test_a_deleted_bucket_fails_the_uploads_not_the_callers_code(
        tmp_path: Path, anyio_backend: str) -> None:
    """Every PUT answered ``NoSuchBucket`` (the bucket deleted under a running store):
    the uploads are given up after their attempts, the breaker opens, and the caller's
    code goes on; the store closes cleanly.  Before, the first such answer ended every
    upload worker and cancelled the store's background task group, and with it the
    caller's code inside ``open()`` (a CancelledError in ``flush()``, an ExceptionGroup
    out of ``async with``)."""
    ks = keys(3)
    with SlowS3("kvstore", hold=()) as s3:
        cfg = slow_config(s3, breaker_reset_s=0.01)
        async with open_store(tmp_path / "w", cfg) as w:
            for k in ks:
                s3.refuse[object_name(w, k)] = (404, "NoSuchBucket")
            await w.put_many(ks, [value(i) for i in range(3)], parents=parents(ks))
            with anyio.fail_after(DEADLINE):
                await w.remote.flush()
            st = w.remote.stats()
            assert st.upload_failed == 3 and st.uploaded_blocks == 0
            assert st.breaker_trips >= 1
            assert await w.contains_many(ks) == [True, True, True]


async def test_a_promotion_stores_the_blocks_that_fit_beside_one_that_does_not(
        tmp_path: Path, anyio_backend: str) -> None:
    """A chain of three in the bucket, the middle block 2 MiB, written by a node with
    large staging; a node whose staging holds 1 MiB gets all three (from the remote)
    and promotes the two that fit.  Before, the local put refused the batch whole for
    the one block (BlockTooLargeError) and none of the three was stored."""
    ks = keys(3)
    values = [make_tensor(torch.uint8, (n,), i) for i, n in enumerate((4096, 2 << 20, 4096))]
    with SlowS3("kvstore", hold=()) as s3:
        await write(s3, tmp_path / "w", ks, values, extent_bytes=8 << 20,
                    staging_bytes=8 << 20)
        async with kvstore.open(tmp_path / "r", namespace=NS, remote=slow_config(
                s3, read_deadline_s=DEADLINE), extent_bytes=4 << 20,
                staging_bytes=1 << 20) as r:
            got = await r.get_many(ks)
            assert all(same(g, v) for g, v in zip(got, values))
            with anyio.fail_after(DEADLINE):
                await until(lambda: r.remote.stats().promoting_blocks == 0)
            assert await r.contains_many(ks) == [True, False, True]
            st = r.remote.stats()
            assert (st.promoted_blocks, st.promotion_dropped) == (2, 1)
