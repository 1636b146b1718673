"""One slot's bytes: stage a block into its arena run (header, payload, CRC32C) and verify
a slot read back against its index entry before a byte reaches the caller (G2).

Slot layout: FORMAT.md, "Slots".  The store stages and verifies through this module only.
The per-byte work runs in the compiled kernels of ``kvstore/_native/slots.c`` (through
``kvstore.io.native_slots``: one call per chunk, GIL released) when they are built; the
Python code here is the reference they are tested against and the fallback without them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstore.codecs import pipeline as codecs
from kvstore.codecs import result_buffers
from kvstore.codecs.pipeline import CODEC_RAW, CodecSpec
from kvstore.codecs.tensors import CODE_DTYPES, encoded_payload
from kvstore.disk.format import SLOT_HEADER_BYTES, IndexEntry, SlotHeader, crc32c, round_up
from kvstore.errors import CorruptionError, FormatVersionError, UnsupportedTensorError
from kvstore.io import native_slots
from kvstore.io.arena import ArenaRun


class ToDevice(Protocol):
    """Fills contiguous CUDA outputs by enqueued work, waited for by its owner before the
    arena runs are reused (``kvstore.cuda.copies.DeviceCopies``, handed in by
    ``kvstore.io.transfers``; this module stays below the GPU path and never imports it)."""

    def copy(self, out: torch.Tensor, address: int, nbytes: int, keep: object) -> None:
        """Enqueue ``nbytes`` from host ``address`` into ``out`` (``keep``: alive until
        the copy completes)."""

    def decode(self, out: torch.Tensor, codec: int, payload: npt.NDArray[np.uint8],
               dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """Enqueue the payload's copy in and its decoding on the GPU into ``out``;
        False where it cannot (the caller decodes on the host and copies)."""


class PutItem:
    """One block of a put in flight (and, for the allocator, the slot it goes to)."""

    __slots__ = ("key", "parent", "data", "dtype", "shape", "slot_len", "extent", "offset",
                 "crc", "seq", "codec", "raw_len", "payload_len", "encoded", "planned")

    def __init__(self, key: bytes, parent: bytes | None, data: torch.Tensor, dtype: int,
                 shape: tuple[int, ...]) -> None:
        self.key, self.parent, self.data, self.dtype, self.shape = key, parent, data, dtype, shape
        self.slot_len = round_up(SLOT_HEADER_BYTES + data.numel())
        self.extent = self.offset = self.crc = self.seq = 0
        self.codec, self.raw_len = CODEC_RAW, data.numel()
        self.payload_len = self.raw_len
        self.encoded: codecs.Encoded | None = None
        self.planned: CodecSpec | None = None  # sized by ``plan``, encoded when staged

    def encode(self, spec: CodecSpec) -> None:
        """Choose the codec (it may fall back to raw) and size the slot; the payload
        bytes themselves are produced when the slot is staged (``_stage``)."""
        self._take(self._prepare(spec))

    def _prepare(self, spec: CodecSpec) -> codecs.Encoded | None:
        """The block's encoding under ``spec``, or None where it stays raw."""
        pre = encoded_payload(self.data)
        if pre is not None:   # encoded already (on the GPU): its payload, if it fits
            codec, payload = pre
            if codec & 0x0F != codecs.codec_id(spec) & 0x0F:
                raise UnsupportedTensorError(
                    f"block {self.key.hex()[:16]} is encoded with codec {codec:#x}; this "
                    f"put's codec is {codecs.codec_id(spec):#x}")
            assert isinstance(payload, np.ndarray)
            return codecs.Encoded(codec, payload)
        value = self.data.view(CODE_DTYPES[self.dtype]).reshape(self.shape)
        encoded = codecs.prepare(value, spec)
        return None if encoded.codec == CODEC_RAW else encoded

    def _take(self, encoded: codecs.Encoded | None) -> None:
        self.planned, self.encoded = None, encoded
        self.codec, self.payload_len = (CODEC_RAW, self.raw_len) if encoded is None else \
            (encoded.codec, encoded.nbytes)
        self.slot_len = round_up(SLOT_HEADER_BYTES + self.payload_len)

    def plan(self, spec: CodecSpec) -> bool:
        """Size the slot for ``spec`` from the block's shape alone, the encoding itself
        left to staging (``encode_planned``), where it runs chunk by chunk overlapped with
        the writes of earlier chunks; False (nothing changed) where the size depends on
        the values (``codecs.planned_nbytes``)."""
        n = codecs.planned_nbytes(self.shape, CODE_DTYPES[self.dtype], spec)
        if n is None:
            return False
        self.codec, self.payload_len = codecs.codec_id(spec), n
        self.slot_len = round_up(SLOT_HEADER_BYTES + n)
        self.planned = spec
        return True


class PlanMismatch(Exception):
    """A planned block encoded to another size than its slot was planned for (its
    values made the codec fall back to the lossless payload): the put must encode every
    block first and place them again.  Nothing of the block was staged."""


def encode_planned(items: Iterable[PutItem]) -> None:
    """Encode the blocks that ``PutItem.plan`` sized, checking each fits its plan.  A
    block that does not keeps its planned sizes (its reservation is given back by them)."""
    for item in items:
        if item.planned is not None:
            encoded = item._prepare(item.planned)
            got = (CODEC_RAW, item.raw_len) if encoded is None else (encoded.codec,
                                                                      encoded.nbytes)
            if got != (item.codec, item.payload_len):
                raise PlanMismatch(f"block {item.key.hex()} encoded to codec {got[0]}, "
                                   f"{got[1]} bytes; planned {item.codec}, "
                                   f"{item.payload_len}")
            item._take(encoded)


def check_values_held(items: Iterable[PutItem]) -> None:
    """Refuse, before anything is staged, a block that would be stored raw but holds no
    values (an ``EncodedBlock`` put without its codec): never zeros on disk."""
    for item in items:
        if item.encoded is None and item.planned is None and \
                encoded_payload(item.data) is not None:
            raise UnsupportedTensorError(
                f"block {item.key.hex()[:16]} is encoded already (codec "
                f"{item.data.codec_id:#x}); put it with that codec, not raw")  # type: ignore[attr-defined]


def stage(run: ArenaRun, item: PutItem) -> None:
    """Copy (or encode) one block into its arena run and write its header; CRC over the
    staged bytes, so a caller changing the tensor meanwhile cannot make header and
    payload disagree.

    Copies go through NumPy (one memcpy on this thread) rather than torch, whose
    intra-op thread pool adds millisecond wake-up stalls to small copies.  Encoded
    blocks are quantised straight into the arena: no intermediate payload buffer, and
    this runs per chunk, overlapped with the device writing the previous chunk.
    """
    n = item.payload_len
    body = run.array[SLOT_HEADER_BYTES:]
    if item.encoded is not None:
        item.encoded.write_into(body[:n])
        item.encoded = None            # drop the reference to the caller's tensor
    else:
        body[:n] = item.data.numpy()
    body[n:] = 0
    stage_header(run, item, crc32c(run.view[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + n]))


def stage_header(run: ArenaRun, item: PutItem, crc: int) -> None:
    """Write the slot header of ``item``, whose staged payload has CRC32C ``crc``."""
    item.crc = crc
    header = SlotHeader(key=item.key, parent=item.parent, codec=item.codec, dtype=item.dtype,
                        shape=item.shape, payload_len=item.payload_len, raw_len=item.raw_len,
                        payload_crc=crc, seq=item.seq)
    run.view[:SLOT_HEADER_BYTES] = header.encode()


def stage_slot_range(run: ArenaRun, item: PutItem, start: int, end: int, crc: int, *,
                     native: bool | None = None) -> int:
    """Stage bytes ``start..end`` of a raw block's slot, header excepted (the payload
    they hold copied, the padding after the payload zeroed), continuing the payload's
    running CRC32C ``crc``; the CRC so far.  Ranges go in order from the slot's start;
    ``stage_header`` finishes the slot.  This lets a large block be written a piece at
    a time, each piece as soon as it is staged (``Transfers.write``).  ``native`` forces
    the compiled CRC32C + copy kernel on or off, as for ``stage_all``."""
    n = item.payload_len
    lo = min(max(start - SLOT_HEADER_BYTES, 0), n)
    hi = min(max(end - SLOT_HEADER_BYTES, 0), n)
    if hi > lo:
        src = item.data.numpy()[lo:hi]
        dst = run.array[SLOT_HEADER_BYTES + lo:SLOT_HEADER_BYTES + hi]
        if native_slots.available() if native is None else native:
            crc = native_slots.crc32c(src, crc, copy_to=dst)
        else:
            dst[:] = src
            crc = crc32c(run.view[SLOT_HEADER_BYTES + lo:SLOT_HEADER_BYTES + hi], crc)
    pad = max(start, SLOT_HEADER_BYTES + n)
    if end > pad:
        run.array[pad:end] = 0
    return crc


def encode_all(items: list[PutItem], spec: CodecSpec) -> None:
    for item in items:
        item.encode(spec)


def stage_all(chunk: list[tuple[PutItem, ArenaRun]], *, native: bool | None = None) -> None:
    """Stage a chunk: one call into the compiled kernels (``kvstore.io.native_slots``, GIL
    released) when they are built, else ``stage`` per slot.  Same bytes either way;
    ``native`` forces a path (tests and benchmarks compare them).  Planned blocks are
    encoded first, here (``PlanMismatch`` if one does not fit its plan)."""
    encode_planned(item for item, _ in chunk)
    if native_slots.available() if native is None else native:
        native_slots.stage(chunk)
        return
    for item, run in chunk:
        stage(run, item)


def verify_copy(run: ArenaRun, key: bytes, entry: IndexEntry, out: torch.Tensor | None,
                *, native: bool | None = None, to_device: ToDevice | None = None
                ) -> torch.Tensor:
    """Check a slot read into the arena against its index entry and decode it."""
    result = verify_copy_all([(run, key, entry, out)], native=native, to_device=to_device)[0]
    if isinstance(result, Exception):
        raise result
    return result


def verify_copy_all(batch: list[tuple[ArenaRun, bytes, IndexEntry, torch.Tensor | None]], *,
                    native: bool | None = None, to_device: ToDevice | None = None
                    ) -> list[torch.Tensor | CorruptionError | FormatVersionError]:
    """``verify_copy`` for a chunk of slots: one call into the compiled kernels when they
    are built (header checks, CRC32C and raw copies, GIL released), the Python checks
    otherwise; each slot's tensor, or the error it failed with.  ``to_device``: CUDA
    outputs are filled by copies it enqueues (the caller awaits them before the runs are
    reused), not by a copy this thread waits for."""
    if not (native_slots.available() if native is None else native):
        results: list[torch.Tensor | CorruptionError | FormatVersionError] = []
        for run, key, entry, out in batch:
            try:
                header = check_slot(run.view, key, entry)
                check_payload(run.view, header)
            except (CorruptionError, FormatVersionError) as e:
                results.append(e)
                continue
            results.append(deliver(run, header.codec, header.dtype, header.shape,
                                    header.payload_len, out, to_device))
        return results
    requests, fresh = [], []
    for run, key, entry, out in batch:
        dst, dst_len, new = _destination(entry, out)
        requests.append((run, key, entry, dst.data_ptr() if dst is not None else 0, dst_len,
                         new))
        fresh.append(dst if new else None)
    results = []
    for (run, _, _, out), checked, dst in zip(batch, native_slots.verify(requests), fresh):
        if isinstance(checked, Exception):
            results.append(checked)
        elif checked.copied and dst is not None and dst.numel() == _numel(checked.shape):
            results.append(dst.view(checked.shape))
        elif checked.copied and out is not None and dst is None:
            results.append(out)
        else:
            results.append(deliver(run, checked.codec, checked.dtype, checked.shape,
                                    checked.payload_len, out, to_device))
    return results


def _destination(entry: IndexEntry, out: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, int, bool]:
    """Where the kernel may copy a raw payload: (tensor, its bytes, freshly allocated).
    Encoded payloads, GPU and non-contiguous outputs go through ``deliver`` instead."""
    if entry.codec != CODEC_RAW:
        return None, 0, False
    if out is None:
        dtype = CODE_DTYPES.get(entry.dtype)
        if dtype is None or entry.raw_len % dtype.itemsize:
            return None, 0, False
        return (result_buffers.empty((entry.raw_len // dtype.itemsize,), dtype), entry.raw_len,
                True)
    if out.device.type == "cpu" and out.is_contiguous():
        return out, out.numel() * out.element_size(), False
    return None, 0, False


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_slot(raw: bytes | memoryview, key: bytes | None,
               entry: IndexEntry | None) -> SlotHeader:
    """Decode a slot header and check it against the key and index entry it should
    belong to: the one slot verifier the store's reads and fsck share."""
    header = SlotHeader.decode(raw)
    if not codecs.is_known(header.codec) or header.dtype not in CODE_DTYPES:
        raise CorruptionError(f"slot has unknown codec {header.codec} or dtype {header.dtype}")
    if key is not None and header.key != key:
        raise CorruptionError(f"slot holds another block (key {header.key.hex()}, seq {header.seq})")
    if entry is not None and (header.seq, header.payload_len, header.payload_crc, header.dtype,
                              header.codec) != (entry.seq, entry.payload_len, entry.payload_crc,
                                                entry.dtype, entry.codec):
        raise CorruptionError("slot header disagrees with its index entry")
    return header


def check_payload(raw: bytes | bytearray | memoryview, header: SlotHeader) -> None:
    """The payload CRC32C (``raw`` is the slot from its first byte), by the compiled
    kernels when built (their fastest path on this CPU), without copying the payload."""
    payload = memoryview(raw)[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + header.payload_len]
    crc = native_slots.crc32c(payload) if native_slots.available() else crc32c(payload)
    if crc != header.payload_crc:
        raise CorruptionError("payload checksum mismatch")


def deliver(run: ArenaRun, codec: int, dtype_code: int, shape: tuple[int, ...], n: int,
            out: torch.Tensor | None, to_device: ToDevice | None = None) -> torch.Tensor:
    """Decode or copy a verified payload out of the arena run.  A contiguous CUDA
    ``out`` with ``to_device``: one copy enqueued straight from the arena run (a DMA when
    the arena is page-locked), nothing waited for here; an FP8 payload is copied in the
    same way and dequantised on the GPU, other encoded payloads are decoded on the host
    and that copy enqueued from it."""
    dtype = CODE_DTYPES[dtype_code]
    src = run.array[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + n]
    if to_device is not None and out is not None and out.device.type == "cuda" \
            and out.is_contiguous():
        if codec == CODEC_RAW:
            to_device.copy(out, run.arena.address + run.offset + SLOT_HEADER_BYTES, n, None)
        elif not to_device.decode(out, codec, src, dtype, shape):
            host = codecs.decode(codec, src, dtype, shape)
            to_device.copy(out, host.data_ptr(), host.numel() * host.element_size(), host)
        return out
    if codec != CODEC_RAW:
        return codecs.decode(codec, src, dtype, shape, out)
    if out is not None and out.is_contiguous() and out.device.type == "cpu":
        out.reshape(-1).view(torch.uint8).numpy()[:] = src
        return out
    if out is not None and out.is_contiguous() and out.device.type == "cuda":
        # No copy collector (the store's reads and memory hits always hand one in:
        # kvstore's library's or torch's; the remote tier's decode, on a worker thread,
        # does not): torch's copy straight from the run, which returns once it is done
        # (the run is reused after this returns); it orders on the worker thread's
        # stream, never waits for the caller's.
        out.reshape(-1).view(torch.uint8).copy_(
            run.tensor[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + n])
        return out
    result = result_buffers.empty(shape, dtype)
    result.reshape(-1).view(torch.uint8).numpy()[:] = src
    if out is not None:
        out.copy_(result.reshape(out.shape))
        return out
    return result
