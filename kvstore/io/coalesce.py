"""Merge transfers that are adjacent both in a file and in the staging arena.

A batch of small blocks is allocated back to back in an extent and staged back to back
in the arena, so N slot writes of 68 KiB are really one sequential range.  Issuing it as
one large operation instead of N small ones moves the same bytes with a fraction of the
device operations (this disk: ~4,000 64 KiB writes/s but ~250 2 MiB writes/s, i.e.
~2x the bandwidth at the larger size) and a fraction of the per-op Python work.

Engines call :func:`coalesce` on the ops of one ``write``/``read`` call and
:func:`spread` to turn each merged op's result back into one result per original op, so
the engine protocol (one result per op, short reads reported per op) is unchanged.  A
merged write that fails fails every op in it; a short merged read is charged to the ops
at its end.  The simulated disk of the crash tests does not coalesce: it keeps tearing
and reordering per slot, which covers every state a torn merged write can leave.

A merged read's error is not a verdict on every block in it: :func:`reread_failed`
(which the store's reads call on every result) reads each op that failed again, alone,
a bounded number of times, so one bad or flaky block costs itself only, and a transient
error costs nothing but the retry.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio

from kvstore.io.protocol import IoOp

# Before each retry of a read that failed: none for the first (the merged read is split,
# each op goes alone: the error may belong to one neighbour), a short pause before the
# second (a path failover or a device reset clears in milliseconds).  Two retries bound
# what a dead sector costs a get (~5 ms); what a retry cannot read is quarantined as
# *unreadable* and read again later (kvstore/core/rechecks.py, the scrub, fsck).
READ_RETRY_DELAYS_S = (0.0, 0.005)

# Large enough to amortise a device op.  Bigger requests move more per second on the disks
# measured here (fio, 256 MiB O_DIRECT writes, 64 MiB in flight: 4 MiB requests 216-421
# ms, 16 MiB 209 ms; 32 MiB x 64 in flight 115-127 ms), and a call returns when all its
# ops are done, so merging within a call costs no overlap.  Writes while gets are served
# stay at the scheduler's busy bound (1 MiB) whatever this is.
MAX_MERGED_BYTES = 16 << 20


@dataclass(slots=True)
class Merged:
    """One transfer covering ``ops`` (adjacent in the file and in the arena)."""

    fd: int
    offset: int
    length: int
    ops: list[IoOp]
    view: memoryview


def coalesce(ops: Sequence[IoOp], max_bytes: int = MAX_MERGED_BYTES) -> list[Merged]:
    merged: list[Merged] = []
    for op in ops:
        run = op.run
        if merged:
            m = merged[-1]
            last = m.ops[-1].run
            if (op.fd == m.fd and m.offset + m.length == op.offset
                    and last.arena is run.arena and last.offset + last.length == run.offset
                    and m.length + run.length <= max_bytes):
                m.ops.append(op)
                m.length += run.length
                continue
        merged.append(Merged(op.fd, op.offset, run.length, [op], run.view))
    for m in merged:
        if len(m.ops) > 1:
            first = m.ops[0].run
            m.view = first.arena.view[first.offset:first.offset + m.length]
    return merged


def spread(merged: Sequence[Merged], results: Sequence[int | OSError]) -> list[int | OSError]:
    """Per-op results from per-merged-op results (bytes done, or the error)."""
    out: list[int | OSError] = []
    for m, res in zip(merged, results):
        if isinstance(res, OSError):
            out.extend(res for _ in m.ops)
            continue
        left = res
        for op in m.ops:
            done = min(op.run.length, max(left, 0))
            out.append(done)
            left -= done
    return out


def failed(op: IoOp, result: int | OSError) -> bool:
    """An op that did not read its whole run: an error, or a short read (a merged
    ``preadv`` that meets an error part-way returns what it read before it, so the ops
    after the error see a short read, not the error)."""
    return isinstance(result, OSError) or result != op.run.length


async def reread_failed(read: Callable[[Sequence[IoOp]], Awaitable[list[int | OSError]]],
                        ops: Sequence[IoOp], results: list[int | OSError],
                        delays: Sequence[float] = READ_RETRY_DELAYS_S) -> int:
    """Read every op of ``ops`` whose result in ``results`` failed again, each alone (one
    ``read`` call per op, so nothing merges it with a neighbour), after each of
    ``delays``, until it reads whole; ``results`` is updated in place.  Returns the
    op reads retried.  ``read`` is the engine's; it keeps its ops in the kernel's hands
    until they end, so a cancelled retry leaves no buffer in use."""
    retried = 0
    for delay in delays:
        again = [i for i, (op, res) in enumerate(zip(ops, results)) if failed(op, res)]
        if not again:
            break
        if delay:
            await anyio.sleep(delay)
        retried += len(again)

        async def one(i: int) -> None:
            (results[i],) = await read([ops[i]])

        if len(again) == 1:
            await one(again[0])
            continue
        async with anyio.create_task_group() as tg:
            for i in again:
                tg.start_soon(one, i)
    return retried
