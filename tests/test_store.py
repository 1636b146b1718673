"""Store-level behaviour that is not engine-specific: restarts in a new process, clear
errors for every kind of bad input, and namespace / format-version checks."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES, SLOT_VERSION, crc32c
from kvstore.index.index import META_FORMAT
from kvstore.testing import parts
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor, same

pytestmark = pytest.mark.anyio


def run_python(code: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, check=check, timeout=300)


async def test_restart_in_a_new_process_is_bit_exact(tmp_path: Path) -> None:
    """A writer process stores blocks and exits; a fresh process reads them back."""
    writer = """
        import sys, anyio, torch, kvstore
        from tests.conformance import NS, keys, make_tensor
        async def main():
            async with kvstore.open(sys.argv[1], namespace=NS, extent_bytes=8 << 20) as s:
                ks = keys(50)
                vals = [make_tensor(torch.bfloat16, (4, 16, 8), i) for i in range(50)]
                await s.put_many(ks, vals, parents=kvstore.chain_parents(ks))
        anyio.run(main)
    """
    run_python(writer, str(tmp_path))
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        got = await store.get_many(keys(50))
        assert await store.match_prefix(keys(50)) == 50
    assert all(same(g, make_tensor(torch.bfloat16, (4, 16, 8), i)) for i, g in enumerate(got))


async def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        pass
    for call in (store.get_many(keys(1)), store.put_many(keys(1), [torch.zeros(1)]),
                 store.match_prefix(keys(1)), store.delete_many(keys(1)),
                 store.contains_many(keys(1))):
        with pytest.raises(kvstore.StoreClosedError, match="closed"):
            await call
    with pytest.raises(kvstore.StoreClosedError):
        store.stats()


async def test_a_second_open_in_this_process_shares_the_store(tmp_path: Path) -> None:
    """Two Stores on one path are two owners of one store (issue 43): each sees what the
    other stored at its next lookup; closing one leaves the other open."""
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        await store.put(keys(2)[0], torch.ones(3))
        async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as other:
            assert same(await other.get(keys(2)[0]), torch.ones(3))
            await other.put(keys(2)[1], torch.full((3,), 2.0))
            assert same(await store.get(keys(2)[1]), torch.full((3,), 2.0))
        assert same(await store.get(keys(2)[0]), torch.ones(3))  # the first is unaffected


async def test_open_while_another_process_holds_the_store(tmp_path: Path) -> None:
    probe = """
        import sys, anyio, kvstore
        async def main():
            try:
                async with kvstore.open(sys.argv[1]):
                    print("opened")
            except kvstore.StoreLockedError as e:
                print("locked:", e)
        anyio.run(main)
    """
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT):
        shared = run_python(probe, str(tmp_path)).stdout
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT,
                            exclusive=True):
        refused = run_python(probe, str(tmp_path)).stdout
    assert shared.strip() == "opened"  # a store is shared by default
    # an exclusive owner is named by its pid
    assert refused.startswith("locked:") and f"pid {os.getpid()}" in refused


@pytest.mark.parametrize("bad", [b"short", "a" * 16, 12345, bytes(17), None])
async def test_bad_keys_are_refused_before_any_io(tmp_path: Path, bad: object) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        with pytest.raises(kvstore.InvalidKeyError):
            await store.put_many([keys(1)[0], bad], [torch.ones(1), torch.ones(1)])  # type: ignore[list-item]
        with pytest.raises(kvstore.InvalidKeyError):
            await store.get_many([bad])  # type: ignore[list-item]
        with pytest.raises(kvstore.InvalidKeyError):
            await store.match_prefix([bad])  # type: ignore[list-item]
        assert store.stats().blocks == 0  # the valid key of the failed batch was not stored


async def test_a_single_key_instead_of_a_list_is_refused(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        with pytest.raises(kvstore.InvalidKeyError, match="sequence"):
            await store.get_many(keys(1)[0])  # type: ignore[arg-type]


@pytest.mark.parametrize("value, match", [
    ([1.0, 2.0], "torch.Tensor"),
    (torch.zeros(3, dtype=torch.complex64), "complex64"),
    (torch.empty(3, device="meta"), "meta"),
    (torch.zeros(3, 3).to_sparse(), "sparse"),
    (torch.zeros([1] * 9), "dimensions"),
])
async def test_unsupported_values_are_refused(tmp_path: Path, value: object, match: str) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        with pytest.raises(kvstore.UnsupportedTensorError, match=match):
            await store.put_many(keys(2), [torch.ones(2), value])  # type: ignore[list-item]
        assert store.stats().blocks == 0


async def test_mismatched_lengths_are_refused(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        with pytest.raises(ValueError, match="2 keys but 1 values"):
            await store.put_many(keys(2), [torch.ones(1)])
        with pytest.raises(ValueError, match="parents"):
            await store.put_many(keys(2), [torch.ones(1)] * 2, parents=[None])


async def test_block_larger_than_the_arena_is_refused(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT, staging_bytes=1 << 20) as store:
        with pytest.raises(kvstore.BlockTooLargeError, match="staging_bytes"):
            await store.put(keys(1)[0], torch.zeros(2 << 20, dtype=torch.uint8))
        await store.put(keys(1)[0], torch.ones(10))
        assert store.stats().blocks == 1 and not store.read_only


async def test_other_namespace_is_refused_unless_asked(tmp_path: Path) -> None:
    other = kvstore.Namespace(model="other-model", dtype="bf16", block_size=16)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT):
        pass
    with pytest.raises(kvstore.NamespaceMismatchError, match="allow_new_namespace"):
        async with kvstore.open(tmp_path, namespace=other, extent_bytes=SMALL_EXTENT):
            pass
    async with kvstore.open(tmp_path, namespace=other, extent_bytes=SMALL_EXTENT, allow_new_namespace=True) as store:
        assert len(store.stats().namespaces) == 2
    async with kvstore.open(tmp_path, namespace=other, extent_bytes=SMALL_EXTENT):  # now recorded: no flag needed
        pass


async def test_unknown_format_version_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        await store.put(keys(1)[0], torch.arange(5))
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(META_FORMAT, struct.pack("<I", 99), db=meta)
    env.close()
    with pytest.raises(kvstore.FormatVersionError, match="version 99"):
        async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT):
            pass
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    meta = env.open_db(b"meta")  # not inside a write txn: open_db begins its own
    with env.begin(write=True) as txn:
        assert struct.unpack("<I", txn.get(META_FORMAT, db=meta))[0] == 99
        txn.put(META_FORMAT, struct.pack("<I", kvstore.FORMAT_VERSION), db=meta)
    env.close()
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:  # the data survived the refusal
        assert same(await store.get(keys(1)[0]), torch.arange(5))


async def test_open_without_create_on_a_missing_store(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no kvstore"):
        async with kvstore.open(tmp_path / "nope", create=False):
            pass


def test_full_disk_is_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    """A real EFBIG from the kernel (RLIMIT_FSIZE, per process, so it needs no mount) when a
    new extent cannot be allocated: the batch fails whole, everything acknowledged stays."""
    script = """
        import resource, signal, sys, json, anyio, torch, kvstore
        from tests.conformance import NS, keys, make_tensor
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        async def main():
            ks = keys(12)
            vals = [make_tensor(torch.uint8, (900_000,), i) for i in range(12)]
            out = {}
            async with kvstore.open(sys.argv[1], namespace=NS, extent_bytes=4 << 20) as s:
                await s.put_many(ks[:4], vals[:4])  # fills most of extent 1
                # From now on no file may grow to 4 MiB: the next extent cannot be made.
                limit = (4 << 20) - (64 << 10)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
                try:
                    await s.put_many(ks[4:], vals[4:])
                except kvstore.StoreFullError as e:
                    out["error"] = str(e)
                got = await s.get_many(ks)
                out["kept"] = [g is not None and torch.equal(g, v) for g, v in zip(got, vals)]
                out["read_only"] = s.read_only
                await s.delete_many(ks[:2])
                out["after_delete"] = (await s.put_many(ks[4:6], vals[4:6])).written
            print(json.dumps(out))
        anyio.run(main)
    """
    out = json.loads(run_python(script, str(tmp_path)).stdout)
    assert "no room for a new" in out["error"]
    assert out["kept"] == [True] * 4 + [False] * 8  # acknowledged blocks intact; failed batch absent
    assert out["read_only"] is False  # running out of space is not an I/O failure
    assert out["after_delete"] == 2  # space freed by deletes is used again


async def test_stats_report_engine_and_bytes(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        await store.put_many(keys(3), [make_tensor(torch.float16, (1000,), i) for i in range(3)])
        await store.get_many(keys(4))
        s = store.stats()
    assert s.engine in ("io_uring", "threads") and s.engine_reason
    assert (s.blocks, s.put_blocks, s.put_bytes, s.hits, s.misses) == (3, 3, 6000, 3, 1)
    assert s.stored_bytes == 3 * 4096 and s.disk_bytes == 4 << 20
    assert json.loads(json.dumps(s.as_dict()))["blocks"] == 3


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
async def test_a_block_large_enough_to_go_in_pieces_reads_back_and_fscks_clean(
        tmp_path: Path, engine: str) -> None:
    """Blocks of two pieces or more (kvstore/io/transfers.py) are staged and written a piece
    at a time: the slot on disk is the one fsck and every read verify."""
    from kvstore.io.transfers import PIECE_BYTES
    from kvstore.tools import fsck

    shapes = [(2 * PIECE_BYTES // 4 + 1,), (3 * PIECE_BYTES // 2 + 1023, 2)]  # float32
    values = [make_tensor(torch.float32, shape, i) for i, shape in enumerate(shapes)]
    ks = keys(len(values))
    async with kvstore.open(tmp_path, namespace=NS, engine=engine,
                            extent_bytes=128 << 20) as store:
        if store.stats().engine != engine:
            pytest.skip(f"{engine} is not usable here: {store.stats().engine_reason}")
        await store.put_many(ks, values, parents=kvstore.chain_parents(ks))
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=128 << 20) as store:
        got = await store.get_many(ks)
    assert all(same(g, v) for g, v in zip(got, values))
    assert fsck.check(str(tmp_path), deep=True).findings == []


@pytest.mark.parametrize("staging", [8 << 20, 64 << 10])  # the batch in one chunk / in three
async def test_a_slot_of_a_newer_format_is_refused_with_a_clear_error(
        tmp_path: Path, staging: int) -> None:
    """A slot written by a newer build (its header's version, valid CRC) makes the get
    raise FormatVersionError, not a miss and not an exception group, however the batch
    was split into chunks; nothing is quarantined."""
    ks = keys(3)
    values = [make_tensor(torch.uint8, (40_000,), i) for i in range(3)]
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        await store.put_many(ks, values)
        entry = parts(store).index.get_entries([ks[1]])[0]
    assert entry is not None
    with open(extent_path(str(tmp_path), entry.extent), "r+b") as f:
        f.seek(entry.offset)
        header = bytearray(f.read(SLOT_HEADER_BYTES))
        struct.pack_into("<H", header, 4, SLOT_VERSION + 1)
        struct.pack_into("<I", header, SLOT_HEADER_BYTES - 4, crc32c(bytes(header[:-4])))
        f.seek(entry.offset)
        f.write(header)
    async with kvstore.open(tmp_path, namespace=NS, staging_bytes=staging) as store:
        with pytest.raises(kvstore.FormatVersionError, match="format version"):
            await store.get_many(ks)
        assert store.stats().quarantined == 0
        assert same(await store.get(ks[0]), values[0])
