"""The remote tier against a real SeaweedFS cluster (tests/tiers/remote/cluster.py): fleet
sharing across processes, a volume server killed, the S3 gateway stopped, corrupt and
foreign objects, refused credentials."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore.codecs.pipeline import CodecSpec
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.errors import RemoteAuthError
from kvstore.remote import RemoteConfig
from kvstore.testing import parts
from kvstore.tiers.remote import objects
from kvstore.tiers.remote.client import ObjectClient
from kvstore.tools import fsck
from tests.concurrency import until
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor, same
from tests.tiers.remote.cluster import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedCluster

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[3]
SHAPE = (16, 1024)  # bf16: 32 KiB blocks


def config(cluster: SeaweedCluster, prefix: str, **kw: Any) -> RemoteConfig:
    kw.setdefault("access_key_id", ACCESS_KEY)
    kw.setdefault("secret_access_key", SECRET_KEY)
    return RemoteConfig(bucket=BUCKET, endpoint=cluster.endpoint, prefix=prefix, **kw)


def fresh_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def value(i: int) -> torch.Tensor:
    return make_tensor(torch.bfloat16, SHAPE, 1000 + i)


def parents(ks: list[bytes]) -> list[bytes | None]:
    return [None, *ks[:-1]]


def open_store(path: Path, remote: RemoteConfig | None, **kw: Any) -> Any:
    return kvstore.open(path, namespace=NS, extent_bytes=SMALL_EXTENT,
                        staging_bytes=8 << 20, remote=remote, **kw)


_WRITER = """
import json, sys, anyio, torch
sys.path.insert(0, sys.argv[1])
import kvstore
from kvstore.codecs.pipeline import CodecSpec
from kvstore.remote import RemoteConfig
from tests.conformance import NS, SMALL_EXTENT, keys
from tests.tiers.remote.test_tier import value, parents

async def main(path, endpoint, prefix, n):
    ks = keys(n)
    # credentials from the standard AWS environment (the parent set them)
    remote = RemoteConfig(bucket="kvstore", endpoint=endpoint, prefix=prefix)
    async with kvstore.open(path, namespace=NS, extent_bytes=SMALL_EXTENT,
                            staging_bytes=8 << 20, remote=remote) as s:
        half = n // 2
        await s.put_many(ks[:half], [value(i) for i in range(half)], parents=parents(ks)[:half])
        await s.put_many(ks[half:], [value(i) for i in range(half, n)],
                         parents=parents(ks)[half:], codec=CodecSpec(fp8="e4m3"))
        await s.remote.flush()
        print(json.dumps(s.remote.stats().as_dict()))

anyio.run(main, sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
"""


async def test_two_processes_share_a_bucket_and_b_loads_what_a_wrote_bit_exact(
        seaweed: SeaweedCluster, tmp_path: Path, anyio_backend: str) -> None:
    prefix, n = fresh_prefix(), 12
    ks = keys(n)
    env = {**os.environ, **seaweed.env}
    out = subprocess.run([sys.executable, "-c", _WRITER, str(ROOT), str(tmp_path / "a"),
                          seaweed.endpoint, prefix, str(n)], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    a_stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert a_stats["uploaded_blocks"] == n and a_stats["upload_dropped"] == 0
    # what A's own store returns (the FP8 half is lossy: B must return the same values)
    async with open_store(tmp_path / "a", None) as a:
        expected = await a.get_many(ks)
    assert all(same(e, value(i)) for i, e in enumerate(expected[:n // 2]))

    async with open_store(tmp_path / "b", config(seaweed, prefix)) as b:
        assert await b.contains_many(ks) == [False] * n
        assert await b.match_prefix(ks[:4]) == 4  # fetched in chain order, promoted
        got = await b.get_many(ks)
        assert all(same(g, e) for g, e in zip(got, expected))  # type: ignore[arg-type]
        # the 4 blocks match_prefix fetched are not fetched again (stored locally by
        # now, or served from their promotion still in flight)
        assert b.remote.stats().gets == n
        await b.remote.flush()  # promotions run behind the gets
        assert await b.contains_many(ks) == [True] * n  # promoted into B's local store
        st = b.remote.stats()
        assert (st.hits, st.bad_objects, st.promoted_blocks) == (n, 0, n)
        assert st.uploaded_blocks == 0  # promoted blocks are not uploaded again
        again = await b.get_many(ks)
        assert b.remote.stats().gets == st.gets  # local hits: no remote lookups
        assert b.stats().remote["hits"] == n  # StoreStats and the metrics carry it
        from prometheus_client import CollectorRegistry, generate_latest

        from kvstore import metrics
        registry = CollectorRegistry()
        metrics.register(b, registry)
        text = generate_latest(registry).decode()
        assert f'kvstore_remote_hits_total{{store="{b.path}"}} {float(n)}' in text
        assert all(same(g, e) for g, e in zip(again, expected))  # type: ignore[arg-type]
    # both stores keep their local guarantees
    for path in ("a", "b"):
        report = fsck.check(str(tmp_path / path), deep=True)
        assert report.exit_code == 0, report.as_dict()


async def test_a_get_does_not_wait_for_its_promotion_which_is_dropped_under_backpressure(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """Fetched blocks are returned before their local put; until it lands they are
    served from the fetched copy; a promotion beyond ``backlog_bytes`` is dropped
    (counted) and the block is simply fetched again next time."""
    prefix = fresh_prefix()
    ks = keys(6)
    async with open_store(tmp_path / "a", config(seaweed, prefix)) as a:
        await a.put_many(ks, [value(i) for i in range(6)], parents=parents(ks))
        await a.remote.flush()
    holding, released = threading.Event(), threading.Event()

    def hold_the_writer(txn: Any) -> bool:
        holding.set()
        return released.wait(60)

    async with open_store(tmp_path / "b", config(seaweed, prefix), backlog_bytes=1) as b:
        holder = parts(b).writer.submit(hold_the_writer)
        try:
            await until(holding.is_set)  # no local put can commit now
            first = await b.get_many(ks[:3])  # returns while its promotion cannot land
            assert all(same(g, value(i)) for i, g in enumerate(first))  # type: ignore[arg-type]
            await until(lambda: b.stats().backlog_bytes > 0)  # the promotion's put started
            assert b.remote.stats().promoting_blocks == 3
            again = await b.get_many(ks[:3])  # served from the promotion's copy
            assert all(same(g, value(i)) for i, g in enumerate(again))  # type: ignore[arg-type]
            with torch.inference_mode():  # as vLLM's buffers are (written outside it)
                outs = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in range(3)]
            into = await b.get_many(ks[:3], outs)
            assert all(g is o and same(g, value(i))
                       for i, (g, o) in enumerate(zip(into, outs)))
            assert b.remote.stats().gets == 3
            with torch.inference_mode():
                outs = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in range(3)]
            # fetched into the caller's tensors; its promotion: over backlog_bytes, dropped
            second = await b.get_many(ks[3:], outs)
            assert all(g is o and same(g, value(3 + i))
                       for i, (g, o) in enumerate(zip(second, outs)))
            await until(lambda: b.remote.stats().promotion_dropped == 3)
            assert await b.contains_many(ks) == [False] * 6
        finally:
            released.set()
        assert holder.result() is True
        await b.remote.flush()
        assert await b.contains_many(ks) == [True] * 3 + [False] * 3
        st = b.remote.stats()
        assert (st.promoted_blocks, st.promotion_dropped, st.promoting_blocks) == (3, 3, 0)
        assert b.stats().dropped_blocks == 3
        third = await b.get_many(ks[3:])  # fetched again, and promoted this time
        assert all(same(g, value(3 + i)) for i, g in enumerate(third))  # type: ignore[arg-type]
        await b.remote.flush()
        assert b.remote.stats().gets == 9 and await b.contains_many(ks) == [True] * 6
    assert fsck.check(str(tmp_path / "b"), deep=True).exit_code == 0


async def test_a_chain_walk_stops_at_the_first_remote_miss(seaweed: SeaweedCluster,
                                                           tmp_path: Path) -> None:
    prefix = fresh_prefix()
    ks = keys(6)
    async with open_store(tmp_path / "a", config(seaweed, prefix)) as a:
        await a.put_many(ks[:3], [value(i) for i in range(3)], parents=parents(ks)[:3])
        await a.put_many(ks[4:], [value(i) for i in range(4, 6)], parents=parents(ks)[4:])
        await a.remote.flush()
    async with open_store(tmp_path / "b", config(seaweed, prefix)) as b:
        assert await b.match_prefix(ks) == 3
        await b.remote.flush()  # its promotion
        assert await b.contains_many(ks) == [True] * 3 + [False] * 3  # nothing past the hole


async def test_a_volume_server_killed_during_uploads_and_reads(seaweed: SeaweedCluster,
                                                               tmp_path: Path) -> None:
    """No wrong bytes, no hang, the local store goes on; replication keeps the data."""
    prefix, n = fresh_prefix(), 24
    ks = keys(n)
    victim = seaweed.volumes[0]
    try:
        with anyio.fail_after(120):
            async with open_store(tmp_path / "a", config(seaweed, prefix)) as a:
                await a.put_many(ks[:n // 2], [value(i) for i in range(n // 2)],
                                 parents=parents(ks)[:n // 2])
                assert victim.proc is not None
                victim.proc.send_signal(signal.SIGKILL)  # uploads still queued or in flight
                victim.proc.wait()
                await a.put_many(ks[n // 2:], [value(i) for i in range(n // 2, n)],
                                 parents=parents(ks)[n // 2:])
                assert all(same(g, value(i)) for i, g in enumerate(await a.get_many(ks)))
                await a.remote.flush()
                sa = a.remote.stats()
            assert sa.uploaded_blocks + sa.upload_failed + sa.upload_dropped == n
            async with open_store(tmp_path / "b", config(seaweed, prefix)) as b:
                got = await b.get_many(ks)
        # every block is either right or a miss; most made it despite the dead server
        assert all(g is None or same(g, value(i)) for i, g in enumerate(got))
        assert sum(g is not None for g in got) >= sa.uploaded_blocks // 2
    finally:
        victim.start()  # back for the next tests
        seaweed.wait_s3()


async def test_a_stopped_gateway_trips_the_breaker_local_service_goes_on_and_recovers(
        seaweed: SeaweedCluster, tmp_path: Path, anyio_backend: str) -> None:
    prefix = fresh_prefix()
    ks = keys(8)
    cfg = config(seaweed, prefix, breaker_failures=2, breaker_reset_s=0.5,
                 read_deadline_s=5.0, close_drain_s=0.0)
    async with open_store(tmp_path / "a", cfg) as a:
        await a.put_many(ks[:2], [value(i) for i in range(2)], parents=parents(ks)[:2])
        await a.remote.flush()
    s3 = seaweed.s3
    assert s3 is not None
    try:
        s3.stop(signal.SIGKILL)
        with anyio.fail_after(60):
            async with open_store(tmp_path / "b", cfg) as b:
                # local puts and gets work while the remote is gone
                await b.put_many(ks[4:], [value(i) for i in range(4, 8)], parents=parents(ks)[4:])
                assert all(same(g, value(i + 4)) for i, g in enumerate(await b.get_many(ks[4:])))
                assert await b.get_many(ks[:2]) == [None, None]  # remote misses
                st = b.remote.stats()
                assert st.state == "unreachable" and st.breaker_trips == 1
                assert st.reason  # says what failed
                requests = st.requests
                assert await b.get_many(ks[:2]) == [None, None]
                assert b.remote.stats().requests == requests  # fast: no request sent
                assert b.remote.stats().fast_misses >= 2
                s3.start()
                seaweed.wait_s3()
                # after breaker_reset_s one probe goes out and closes the breaker (while
                # it is out, the other keys are fast misses: poll until both came back)
                got = await b.get_many(ks[:2])
                while any(g is None for g in got):
                    await anyio.sleep(0.1)
                    got = await b.get_many(ks[:2])
                assert all(same(g, value(i)) for i, g in enumerate(got))
                assert b.remote.stats().state == "ok"
    finally:
        if not s3.alive:
            s3.start()
            seaweed.wait_s3()


async def test_corrupt_and_foreign_objects_are_counted_misses(seaweed: SeaweedCluster,
                                                               tmp_path: Path) -> None:
    prefix = fresh_prefix()
    hmac_key = os.urandom(32)
    ks = keys(4)
    async with open_store(tmp_path / "a", config(seaweed, prefix, hmac_key=hmac_key)) as a:
        await a.put_many(ks[:2], [value(i) for i in range(2)], parents=parents(ks)[:2])
        await a.remote.flush()
    client = ObjectClient(config(seaweed, prefix))
    name = [objects.object_name(prefix, NS.digest, k) for k in ks]
    good = client.get(name[0])
    assert good is not None
    flipped = bytearray(good)
    flipped[300] ^= 0x40
    client.put(name[0], bytes(flipped))  # bad CRC
    client.put(name[2], bytes(good))  # another key's object under this name
    unsigned = bytes(good[:-objects.AUTH_TRAILER_BYTES])
    client.put(name[3], unsigned.replace(ks[0], ks[3], 1))  # wrong header CRC now too
    # a well-formed object without a tag, written by a store without the key
    async with open_store(tmp_path / "x", config(seaweed, prefix)) as x:
        await x.put(ks[1], value(9), parent=ks[0])  # exists (signed): not overwritten
        await x.remote.flush()
        assert x.remote.stats().upload_existing == 1
    async with open_store(tmp_path / "b", config(seaweed, prefix, hmac_key=hmac_key)) as b:
        got = await b.get_many(ks)
        assert got[0] is None and got[2] is None and got[3] is None
        assert same(got[1], value(1))
        st = b.remote.stats()
        assert st.bad_objects == 3 and st.hits == 1
        await b.remote.flush()
        assert await b.contains_many(ks) == [False, True, False, False]  # never promoted
    # an unsigned object is refused by a store that requires tags
    other = fresh_prefix()
    async with open_store(tmp_path / "u", config(seaweed, other)) as u:
        await u.put(ks[0], value(0))
        await u.remote.flush()
    async with open_store(tmp_path / "v", config(seaweed, other, hmac_key=hmac_key)) as v:
        assert await v.get(ks[0]) is None
        assert v.remote.stats().bad_objects == 1


@pytest.mark.parametrize("with_out", [False, True])
async def test_a_flipped_payload_bit_in_an_unsigned_object_is_a_counted_miss(
        seaweed: SeaweedCluster, tmp_path: Path, with_out: bool) -> None:
    """Without an HMAC tag only the payload CRC32C catches a flipped bit; a get checks it
    while it decodes (one pass): a miss, counted, the caller's ``out`` left alone, and
    the block never promoted."""
    prefix = fresh_prefix()
    ks = keys(2)
    async with open_store(tmp_path / "a", config(seaweed, prefix)) as a:
        await a.put_many(ks, [value(0), value(1)], parents=parents(ks))
        await a.remote.flush()
    client = ObjectClient(config(seaweed, prefix))
    name = objects.object_name(prefix, NS.digest, ks[0])
    body = client.get(name)
    assert body is not None
    flipped = bytearray(body)
    flipped[SLOT_HEADER_BYTES + 1000] ^= 0x04
    client.put(name, bytes(flipped))
    async with open_store(tmp_path / "b", config(seaweed, prefix)) as b:
        outs = [torch.zeros_like(value(0)), torch.zeros_like(value(1))] if with_out else None
        got = await b.get_many(ks, out=outs)
        assert got[0] is None and same(got[1], value(1))
        assert outs is None or not outs[0].any()
        assert b.remote.stats().bad_objects == 1
        await b.remote.flush()
        assert await b.contains_many(ks) == [False, True]


async def test_wrong_credentials_are_a_clear_error_at_open_or_a_disabled_tier(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    bad = config(seaweed, fresh_prefix(), secret_access_key="wrong")
    with pytest.raises(RemoteAuthError, match="refused the credentials"):
        async with open_store(tmp_path / "a", bad):
            pass
    disabled = config(seaweed, fresh_prefix(), secret_access_key="wrong",
                      on_auth_error="disable")
    async with open_store(tmp_path / "a", disabled) as a:
        st = a.remote.stats()
        assert st.state == "disabled" and "refused the credentials" in st.reason
        await a.put(keys(1)[0], value(0))
        assert same(await a.get(keys(1)[0]), value(0))
        assert await a.get(keys(2)[1]) is None
        assert a.remote.stats().requests == 1  # only the check at open


async def test_remote_needs_a_namespace(seaweed: SeaweedCluster, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs namespace"):
        async with kvstore.open(tmp_path / "a", remote=config(seaweed, "x")):
            pass


async def test_a_remote_attached_after_open_shares_the_bucket(seaweed: SeaweedCluster,
                                                               tmp_path: Path) -> None:
    """``attach_remote``: for a caller that learns its namespace after opening (the vLLM
    connector); the same tier as ``open(remote=...)``, once."""
    prefix, ks = fresh_prefix(), keys(2)
    async with open_store(tmp_path / "a", config(seaweed, prefix)) as a:
        await a.put_many(ks, [value(0), value(1)], parents=parents(ks))
        await a.remote.flush()
    async with kvstore.open(tmp_path / "b", extent_bytes=SMALL_EXTENT,
                            allow_new_namespace=True) as b:
        assert b.remote is None
        await b.attach_remote(config(seaweed, prefix), NS)
        got = await b.get_many(ks)
        assert same(got[0], value(0)) and same(got[1], value(1))
        with pytest.raises(ValueError, match="already has a remote tier"):
            await b.attach_remote(config(seaweed, prefix), NS)
    with pytest.raises(kvstore.StoreClosedError):
        await b.attach_remote(config(seaweed, prefix), NS)
    bad = config(seaweed, prefix, secret_access_key="wrong")
    async with kvstore.open(tmp_path / "c", allow_new_namespace=True) as c:
        with pytest.raises(RemoteAuthError):
            await c.attach_remote(bad, NS)
        assert c.remote is None  # nothing half-attached


async def test_an_unreachable_cluster_at_open_is_not_an_error(tmp_path: Path) -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    cfg = RemoteConfig(bucket=BUCKET, endpoint=f"http://127.0.0.1:{port}", prefix="x",
                       access_key_id="a", secret_access_key="b", close_drain_s=0.0)
    async with open_store(tmp_path / "a", cfg) as a:
        assert a.remote.stats().state == "unreachable"
        await a.put(keys(1)[0], value(0), parent=None)
        assert same(await a.get(keys(1)[0]), value(0))
        assert await a.get(keys(2)[1]) is None
    _ = CodecSpec


def resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a read-only mapping that
    is never touched)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
            assert libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "hmac"])
async def test_uploads_read_their_blocks_back_around_the_page_cache(
        seaweed: SeaweedCluster, tmp_path: Path, signed: bool) -> None:
    """An upload reads its slot back with O_DIRECT into its worker's reused buffer and
    sends from it: the extent's pages stay out of the page cache, and every object is
    the slot's bytes exactly although each worker's buffer served many blocks."""
    prefix, ks = fresh_prefix(), keys(24)
    hmac_key = os.urandom(32) if signed else None
    values = [value(i) for i in range(24)]
    async with open_store(tmp_path, config(seaweed, prefix, hmac_key=hmac_key,
                                           upload_workers=2)) as store:
        if not parts(store).engine.direct:
            pytest.skip("this file system has no O_DIRECT: uploads read through the cache")
        await store.put_many(ks, values, parents=parents(ks))
        entries = parts(store).index.get_entries(ks)
        extents = {extent_path(str(tmp_path), e.extent) for e in entries if e is not None}
        before = sum(resident_pages(p) for p in extents)
        await store.remote.flush()
        after = sum(resident_pages(p) for p in extents)
        assert store.remote.stats().uploaded_blocks == 24
        slots = []
        for entry in entries:
            assert entry is not None
            with open(extent_path(str(tmp_path), entry.extent), "rb") as f:
                f.seek(entry.offset)
                slots.append(f.read(SLOT_HEADER_BYTES + entry.payload_len))
    # 24 slots of 9 pages each were read: a buffered read-back leaves them all cached
    assert after - before < 9, f"{after - before} extent pages came into the page cache"
    client = ObjectClient(config(seaweed, prefix))
    for key, slot in zip(ks, slots):
        body = client.get(objects.object_name(prefix, NS.digest, key))
        assert body is not None
        assert bytes(body[:len(slot)]) == slot
        assert len(body) == len(slot) + (objects.AUTH_TRAILER_BYTES if signed else 0)
        objects.verify(body, key, namespace_digest=NS.digest, hmac_key=hmac_key)
