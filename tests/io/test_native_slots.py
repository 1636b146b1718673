"""The compiled slot kernels (kvstore/_native/slots.c via kvstore.io.native_slots) against
the Python path of kvstore.io.slots, which is their specification.

Staging must give the same bytes on disk, byte for byte (header, payload, zeroed padding)
and the same payload CRC; verification the same result for every slot: the same tensor,
or the same kind of error (and, but for one case, the same message), for each way a slot
can be damaged.  The CRC32C must equal the ``crc32c`` package's bit for bit on both its
hardware and its table path.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import crc32c as crc32c_pkg
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore.codecs.pipeline import CodecSpec
from kvstore.codecs.tensors import CODE_DTYPES, DTYPE_CODES
from kvstore.disk.format import SLOT_HEADER_BYTES, IndexEntry, crc32c
from kvstore.errors import CorruptionError, FormatVersionError
from kvstore.io import native_slots, slots
from kvstore.io.arena import Arena, ArenaRun
from kvstore.io.slots import PutItem

pytestmark = pytest.mark.skipif(not native_slots.available(),
                                reason=f"no compiled slot kernels: {native_slots.reason()}")

KEY = bytes(range(16))
PARENT = bytes(range(100, 116))
GARBAGE = 0xA5


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(64 << 20)
    yield a
    a.close()


def _fill(run: ArenaRun) -> None:
    run.array[:] = GARBAGE  # staging must overwrite or zero every byte of the slot


def _item(data: torch.Tensor, *, parent: bytes | None = PARENT, seq: int = 7,
          key: bytes = KEY, spec: CodecSpec | None = None) -> PutItem:
    flat = data.contiguous().reshape(-1).view(torch.uint8)
    item = PutItem(key, parent, flat, DTYPE_CODES[data.dtype], tuple(data.shape))
    item.seq = seq
    if spec is not None:
        item.encode(spec)
    return item


def _stage_both(arena: Arena, make: Callable[[], PutItem]
                ) -> tuple[PutItem, ArenaRun, PutItem, ArenaRun]:
    """Stage one block twice, by the Python path and by the kernels, in two runs."""
    py_item, nat_item = make(), make()
    py_run = arena.try_acquire(py_item.slot_len)
    nat_run = arena.try_acquire(nat_item.slot_len)
    assert py_run is not None and nat_run is not None
    _fill(py_run)
    _fill(nat_run)
    slots.stage_all([(py_item, py_run)], native=False)
    slots.stage_all([(nat_item, nat_run)], native=True)
    return py_item, py_run, nat_item, nat_run


def _entry(item: PutItem, offset: int = 4096) -> IndexEntry:
    return IndexEntry(extent=1, offset=offset, slot_len=item.slot_len,
                      payload_len=item.payload_len, raw_len=item.raw_len, codec=item.codec,
                      dtype=item.dtype, payload_crc=item.crc, seq=item.seq, last_use=0,
                      parent=item.parent)


# ------------------------------------------------------------------ CRC32C


PATHS = native_slots.crc_paths() if native_slots.available() else []
ROOT = Path(__file__).resolve().parents[2]


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@given(data=st.binary(max_size=70_000), skip=st.integers(0, 15), value=st.integers(0, 2**32 - 1))
def test_crc32c_equals_the_crc32c_package(data: bytes, skip: int, value: int) -> None:
    # Every length around the three-stream blocks (3 x 8 KiB, 3 x 256 B) and every
    # start alignment (the kernels align to 8 or 16 bytes before their main loops).
    view = memoryview(data)[min(skip, len(data)):]
    want = crc32c_pkg.crc32c(bytes(view), value)
    assert native_slots.crc32c(view, value) == want
    for path in PATHS:
        assert native_slots.crc32c(view, value, path=path) == want, path


@pytest.mark.parametrize("path", PATHS)
def test_every_path_agrees_at_every_short_length_and_offset(path: str) -> None:
    # 0..1100 bytes: below, at and above the folding path's 128-byte minimum, its 16- and
    # 64-byte strides and the crc32 path's 768-byte streams; a random start in 0..63.
    buf = _random(1100 + 64, 1)
    offsets = np.random.default_rng(2).integers(0, 64, 1101)
    for n in range(1101):
        data = buf[offsets[n]:offsets[n] + n]
        value = (n * 2654435761) & 0xFFFFFFFF
        assert native_slots.crc32c(data, value, path=path) == \
            crc32c_pkg.crc32c(data.tobytes(), value), (n, offsets[n])


@pytest.mark.parametrize("n", [64 << 10, (1 << 20) + 13, 2 << 20])
@pytest.mark.parametrize("path", PATHS)
def test_every_path_agrees_on_large_buffers(path: str, n: int) -> None:
    buf = _random(n + 64, n)
    for offset in (0, 13, 63):
        data = buf[offset:offset + n]
        assert native_slots.crc32c(data, 7, path=path) == crc32c_pkg.crc32c(data.tobytes(), 7)


@pytest.mark.parametrize("path", PATHS)
def test_every_path_continues_a_crc(path: str) -> None:
    # crc(b, crc(a)) == crc(a + b), and so across paths: a started by another path.
    data = _random(300_000, 3)
    want = crc32c_pkg.crc32c(data.tobytes())
    for cut in (0, 1, 255, 256, 1000, 65_536 + 5, 299_999, 300_000):
        for first in PATHS:
            head = native_slots.crc32c(data[:cut], path=first)
            assert native_slots.crc32c(data[cut:], head, path=path) == want, (cut, first)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 255, 256, 767, 768, 24_575, 24_576, 24_577,
                               3 * 24_576 + 5, 1 << 20, (2 << 20) + 13])
@pytest.mark.parametrize("path", PATHS)
def test_crc32c_copy_is_a_copy_and_the_same_crc(n: int, path: str) -> None:
    # Source and destination at different alignments; guard bytes either side of the copy.
    data = _random(n + 3, n)[3:]
    guarded = np.zeros(n + 5 + 16, dtype=np.uint8)
    dst = guarded[5:5 + n]
    got = native_slots.crc32c(data, 99, path=path, copy_to=dst)
    assert got == crc32c_pkg.crc32c(data.tobytes(), 99)
    assert dst.tobytes() == data.tobytes()
    assert not guarded[:5].any() and not guarded[5 + n:].any()


def test_reason_names_the_crc_path() -> None:
    words = {"pclmul": "CRC32C by PCLMULQDQ", "crc32": "CRC32C by SSE4.2 crc32",
             "table": "CRC32C by slicing-by-8"}
    assert words[native_slots.crc_path()] in native_slots.reason()
    assert native_slots.hardware_crc() == (native_slots.crc_path() != "table")
    # Unless forced, the choice among hardware paths was timed; the table path is the
    # choice only where the CPU has no other.
    if "KVSTORE_CRC32C" not in os.environ:
        assert native_slots.crc_path() == PATHS[-1] or "timed faster" in native_slots.reason()


def _forced(value: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVSTORE_CRC32C": value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("path", ["pclmul", "crc32", "table"])
def test_kvstore_crc32c_forces_the_path(path: str) -> None:
    if path not in PATHS:
        pytest.skip(f"this CPU cannot run the {path} CRC32C path (it runs {PATHS})")
    # A fresh process: the path is chosen when the library loads.  The kernels' own
    # staging uses it: a slot staged there carries the package's CRC.
    done = _forced(path, (
        "import crc32c, torch\n"
        "from kvstore.io import native_slots, slots\n"
        "from kvstore.io.arena import Arena\n"
        "from kvstore.codecs.tensors import DTYPE_CODES\n"
        "print(native_slots.crc_path(), '|', native_slots.reason())\n"
        "data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)\n"
        "item = slots.PutItem(bytes(16), None, data, DTYPE_CODES[torch.uint8], (100_000,))\n"
        "item.seq = 1\n"
        "arena = Arena(1 << 20)\n"
        "run = arena.try_acquire(item.slot_len)\n"
        "slots.stage_all([(item, run)], native=True)\n"
        "assert item.crc == crc32c.crc32c(data.numpy().tobytes()), item.crc\n"))
    assert done.returncode == 0, done.stderr
    got, reason = done.stdout.strip().split(" | ")
    assert got == path
    assert "forced by KVSTORE_CRC32C" in reason


def test_kvstore_crc32c_refuses_an_unknown_path() -> None:
    done = _forced("fast", "import kvstore.io.native_slots")
    assert done.returncode != 0
    assert "KVSTORE_CRC32C='fast' is not a CRC32C path: use auto, table, crc32, pclmul" \
        in done.stderr


def test_crc_path_refuses_a_path_the_cpu_lacks() -> None:
    with pytest.raises(ValueError, match="not one this CPU runs"):
        native_slots.crc32c(b"abc", path="sse9")


def test_folding_constants_are_the_derived_ones() -> None:
    # kvstore/_native/crc32c_constants.py derives them (and checks the folding method on
    # random messages); slots.c must hold what it prints.
    script = ROOT / "kvstore" / "_native" / "crc32c_constants.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, check=True)
    source = (ROOT / "kvstore" / "_native" / "slots.c").read_text()
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        name = line.split(":")[0].removeprefix("/* ").upper()     # FOLD_512
        high, low = (w.strip() for w in line.split("*/")[1].split(","))
        assert f"#define {name}_H {high}u" in source
        assert f"#define {name}_L {low}u" in source


# ------------------------------------------------------------------ staging

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int64]


@given(dtype=st.sampled_from(_DTYPES), numel=st.integers(0, 40_000), lead=st.integers(0, 9),
       parent=st.sampled_from([None, PARENT]), seq=st.integers(0, 2**64 - 1),
       ndim=st.integers(1, 8))
def test_staged_slot_is_byte_identical(arena: Arena, dtype: torch.dtype, numel: int, lead: int,
                                       parent: bytes | None, seq: int, ndim: int) -> None:
    # ``lead`` elements before the block's data: sources at every alignment.
    base = torch.arange(lead + numel, dtype=torch.float64).to(dtype)[lead:]
    shape = (numel,) + (1,) * (ndim - 1)
    py_item, py_run, nat_item, nat_run = _stage_both(
        arena, lambda: _item(base.reshape(shape), parent=parent, seq=seq))
    try:
        assert bytes(nat_run.view) == bytes(py_run.view)
        assert nat_item.crc == py_item.crc == crc32c(base.contiguous().view(torch.uint8).numpy())
        # Read back by the Python decoder: the slot names the block.
        assert slots.verify_copy(nat_run, KEY, _entry(nat_item), None, native=False).equal(
            base.reshape(shape))
    finally:
        arena.release(py_run)
        arena.release(nat_run)


def test_kernels_write_the_format_md_worked_example(arena: Arena) -> None:
    """FORMAT.md, test vector (e): block k1 of the worked example, staged by the kernels."""
    k0 = bytes.fromhex("782b070a2ad4030b8762ceac8ce20f2d")
    k1 = bytes.fromhex("924cc38c6017b641e4da25a5e4381a17")
    item = _item(torch.arange(6, 12, dtype=torch.float16).reshape(2, 3), parent=k0, seq=2,
                 key=k1)
    run = arena.try_acquire(item.slot_len)
    assert run is not None
    _fill(run)
    slots.stage_all([(item, run)], native=True)
    assert item.crc == 0x71A75621
    assert bytes(run.view[:SLOT_HEADER_BYTES]) == bytes.fromhex(
        "4b56534201000001924cc38c6017b641e4da25a5e4381a17782b070a2ad4030b"
        "8762ceac8ce20f2d010001022156a7710c000000000000000c00000000000000"
        "0200000000000000020000000000000003000000000000000000000000000000"
        + "00" * 132 + "00000000000000000000000000000000000000000000000083d007d6")
    assert bytes(run.view[SLOT_HEADER_BYTES + 12:]) == bytes(4096 - SLOT_HEADER_BYTES - 12)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("zstd", [False, True])
def test_encoded_slot_is_byte_identical(arena: Arena, fp8: str, zstd: bool) -> None:
    g = torch.Generator().manual_seed(3)
    value = torch.randn(2, 4, 16, 2, 64, generator=g).to(torch.bfloat16)
    py_item, py_run, nat_item, nat_run = _stage_both(
        arena, lambda: _item(value, spec=CodecSpec(fp8=fp8, zstd=zstd)))  # type: ignore[arg-type]
    assert py_item.codec != 0 and py_item.payload_len < py_item.raw_len
    assert bytes(nat_run.view) == bytes(py_run.view)
    assert nat_item.crc == py_item.crc
    assert nat_item.encoded is None  # the reference to the caller's tensor is dropped


def test_a_chunk_of_slots_is_staged_in_one_call(arena: Arena) -> None:
    sizes = [0, 1, 4096 - SLOT_HEADER_BYTES, 4097, 64 << 10, (2 << 20) + 3]
    make = [lambda n=n: _item(torch.full((n,), n % 251, dtype=torch.uint8), seq=n)
            for n in sizes]
    chunks = []
    for native in (False, True):
        items = [m() for m in make]
        whole = arena.try_acquire(sum(i.slot_len for i in items))
        assert whole is not None
        _fill(whole)
        runs = arena.split(whole, [i.slot_len for i in items])
        slots.stage_all(list(zip(items, runs)), native=native)
        chunks.append((bytes(whole.view), [i.crc for i in items]))
    assert chunks[0] == chunks[1]


def test_staging_refuses_a_payload_larger_than_its_run(arena: Arena) -> None:
    item = _item(torch.zeros(8192, dtype=torch.uint8))
    run = arena.try_acquire(4096)
    assert run is not None
    with pytest.raises(ValueError, match="does not fit"):
        native_slots.stage([(item, run)])


# ------------------------------------------------------------------ verification


def _rewrite_header(run: ArenaRun, at: int, fmt: str, value: int) -> None:
    """Change one header field and fix the header CRC (a well-formed but different slot)."""
    struct.pack_into(fmt, run.view, at, value)
    struct.pack_into("<I", run.view, 252, crc32c(run.view[:252]))


def _damage(kind: str, run: ArenaRun, entry: IndexEntry) -> tuple[ArenaRun, bytes, IndexEntry]:
    key = KEY
    if kind == "bad magic":
        run.view[0] ^= 0x01
    elif kind == "bad header crc":
        run.view[0x40] ^= 0x10                       # seq, CRC not updated
    elif kind == "bad version":
        _rewrite_header(run, 0x04, "<H", 2)
    elif kind == "bad header_len":
        _rewrite_header(run, 0x06, "<H", 128)
    elif kind == "bad ndim":
        _rewrite_header(run, 0x2B, "<B", 9)
    elif kind == "unknown codec":
        _rewrite_header(run, 0x29, "<B", 0x0F)
    elif kind == "unknown dtype":
        _rewrite_header(run, 0x2A, "<B", 200)
    elif kind == "wrong key":
        key = bytes(16)
    elif kind == "wrong seq":
        entry = IndexEntry(**{**_fields(entry), "seq": entry.seq + 1})
    elif kind == "entry codec":
        entry = IndexEntry(**{**_fields(entry), "codec": 1})
    elif kind == "entry disagrees":
        entry = IndexEntry(**{**_fields(entry), "payload_crc": entry.payload_crc ^ 1})
    elif kind == "bad payload crc":
        run.view[SLOT_HEADER_BYTES + entry.payload_len // 2] ^= 0x80
    elif kind == "truncated header":
        run = ArenaRun(run.arena, run.offset, 100)
    elif kind == "truncated payload":
        run = ArenaRun(run.arena, run.offset, SLOT_HEADER_BYTES + entry.payload_len // 2)
    else:
        assert kind == "intact"
    return run, key, entry


def _fields(entry: IndexEntry) -> dict[str, object]:
    return {name: getattr(entry, name) for name in IndexEntry.__slots__}


KINDS = ["intact", "bad magic", "bad header crc", "bad version", "bad header_len", "bad ndim",
         "unknown codec", "unknown dtype", "wrong key", "wrong seq", "entry codec", "entry disagrees",
         "bad payload crc", "truncated header", "truncated payload"]


def _outs(kind: str, value: torch.Tensor) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "contiguous":
        return torch.full_like(value, 3)
    if kind == "reshaped":
        return torch.full((value.numel(),), 3, dtype=value.dtype)
    wide = torch.full((value.numel(), 2), 3, dtype=value.dtype)   # "strided"
    return wide[:, 0]


def _same(a: torch.Tensor | Exception, b: torch.Tensor | Exception, kind: str) -> None:
    if isinstance(a, Exception) or isinstance(b, Exception):
        assert type(a) is type(b), (a, b)
        if kind != "truncated payload":  # Python says only "payload checksum mismatch"
            assert str(a) == str(b)
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.equal(b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_kind", ["none", "contiguous", "reshaped", "strided"])
def test_verification_matches_the_python_path(arena: Arena, kind: str, out_kind: str) -> None:
    value = torch.arange(3 * 1000, dtype=torch.float32).reshape(3, 1000)
    results = []
    outs = []
    for native in (False, True):
        item = _item(value)
        run = arena.try_acquire(item.slot_len)
        assert run is not None
        slots.stage_all([(item, run)], native=False)
        out = _outs(out_kind, value)
        outs.append(out)
        run, key, entry = _damage(kind, run, _entry(item))
        results.append(slots.verify_copy_all([(run, key, entry, out)], native=native)[0])
    _same(results[0], results[1], kind)
    if kind == "intact":
        assert isinstance(results[1], torch.Tensor)
        assert results[1].reshape(value.shape).equal(value)
        if outs[1] is not None:
            assert results[1] is outs[1]
    else:
        assert isinstance(results[1], CorruptionError | FormatVersionError)
        # Never a wrong byte in the caller's buffer: it is untouched on failure.
        if outs[1] is not None:
            assert bool((outs[1] == 3).all())


def test_verification_errors_are_the_right_kinds(arena: Arena) -> None:
    value = torch.ones(64, dtype=torch.float16)
    got = {}
    for kind in KINDS[1:]:
        item = _item(value)
        run = arena.try_acquire(item.slot_len)
        assert run is not None
        slots.stage_all([(item, run)], native=True)
        run, key, entry = _damage(kind, run, _entry(item))
        got[kind] = slots.verify_copy_all([(run, key, entry, None)], native=True)[0]
    assert isinstance(got.pop("bad version"), FormatVersionError)
    assert all(type(e) is CorruptionError for e in got.values()), got
    assert "magic" in str(got["bad magic"]) and "checksum" in str(got["bad header crc"])
    assert "another block" in str(got["wrong key"]) and "truncated" in str(got["truncated header"])
    assert str(got["bad payload crc"]) == "payload checksum mismatch"


@given(picks=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 70_000),
                                st.sampled_from([torch.float16, torch.uint8, torch.float64])),
                      min_size=1, max_size=6))
def test_a_chunk_verifies_like_slot_by_slot(arena: Arena,
                                            picks: list[tuple[str, int, torch.dtype]]) -> None:
    """One kernel call over a chunk mixing good and damaged slots of any size."""
    batches, acquired = [], []
    for _ in range(2):
        batch = []
        for kind, nbytes, dtype in picks:
            n = max(nbytes // dtype.itemsize, 2)
            value = torch.arange(n, dtype=torch.float64).to(dtype).reshape(2, n // 2) \
                if n % 2 == 0 else torch.arange(n, dtype=torch.float64).to(dtype)
            item = _item(value)
            run = arena.try_acquire(item.slot_len)
            assert run is not None
            acquired.append(run)
            slots.stage_all([(item, run)], native=True)
            batch.append((*_damage(kind, run, _entry(item)), None))
        batches.append(batch)
    python = slots.verify_copy_all(batches[0], native=False)
    native = slots.verify_copy_all(batches[1], native=True)
    for run in acquired:
        arena.release(run)
    for (kind, _, _), a, b in zip(picks, python, native):
        _same(a, b, kind)


def test_encoded_slots_verify_and_decode_like_python(arena: Arena) -> None:
    value = torch.randn(2, 4, 16, 2, 64, generator=torch.Generator().manual_seed(5))
    results = []
    for native in (False, True):
        item = _item(value.to(torch.float16), spec=CodecSpec(fp8="e4m3"))
        run = arena.try_acquire(item.slot_len)
        assert run is not None
        slots.stage_all([(item, run)], native=native)
        results.append(slots.verify_copy(run, KEY, _entry(item), None, native=native))
    assert results[0].equal(results[1]) and results[0].shape == value.shape


# ------------------------------------------------------------------ without the kernels


def test_the_store_runs_without_the_kernels(tmp_path: object) -> None:
    """KVSTORE_NATIVE_SLOTS=0 (as if no compiler): the Python path, same round trip."""
    code = (
        "import torch, kvstore\n"
        "from kvstore.io import native_slots\n"
        "assert not native_slots.available(), native_slots.reason()\n"
        "ns = kvstore.Namespace(model='m', dtype='float16', block_size=4)\n"
        f"with kvstore.open_blocking({str(tmp_path)!r}, namespace=ns, extent_bytes=1 << 22) as s:\n"
        "    k = ns.chain_keys(list(range(4)))[0]\n"
        "    t = torch.arange(6, dtype=torch.float16)\n"
        "    s.put_many([k], [t])\n"
        "    assert s.get_many([k])[0].equal(t)\n"
        "print('python path ok')\n")
    env = {**os.environ, "KVSTORE_NATIVE_SLOTS": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python path ok" in done.stdout


def test_unknown_dtype_table_matches_the_python_one() -> None:
    assert set(CODE_DTYPES) == {i for i in range(256) if native_slots._known_dtype.raw[i]}
