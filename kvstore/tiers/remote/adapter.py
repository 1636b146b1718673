"""Where the remote tier meets the local store: :class:`RemoteAdapter`, which the
store's get, match_prefix and prefetch paths call, and which reaches the store only
through the :class:`~kvstore.tiers.host.TierHost` it was given.

* ``fill_misses`` (get_many), ``extend_prefix`` (match_prefix), ``fetch_missing``
  (prefetch): fetch what the local store lacks, decode it like a local slot, and
  promote it (:mod:`kvstore.tiers.remote.promotion`: a local durable put, which also
  fills the memory tier), so the next get is local.  A get or match_prefix does not
  wait for that put: it runs in the store's background task group (bounded by
  ``backlog_bytes``, dropped and counted beyond it), and a get meanwhile is served from
  the fetched copy (``remote.promoting``).  A prefetch waits for it (it is in the
  background already).  Promotion is best effort (a read-only or full store still
  answers from the remote).
* ``enqueue`` (after a put committed): the blocks are uploaded in the background.
* An upload reads its block back through ``TierHost.read_slot`` (a verified slot, in
  the upload worker's own reused buffer: :meth:`kvstore.core.reads.VerifiedReads.read_slot`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import torch

from kvstore.codecs.tensors import CODE_DTYPES, check_out
from kvstore.core.deletes import DeleteWatch
from kvstore.disk.format import IndexEntry
from kvstore.errors import CorruptionError
from kvstore.tiers.remote import objects
from kvstore.tiers.remote.blocks import RemoteBlock
from kvstore.tiers.remote.promotion import Promotions
from kvstore.tiers.remote.tier import InFlight

if TYPE_CHECKING:
    from kvstore.tiers.host import TierHost
    from kvstore.tiers.remote.tier import RemoteTier

__all__ = ["Held", "RemoteAdapter"]

def _decode(block: RemoteBlock, out: torch.Tensor | None, *, check: bool = False
            ) -> torch.Tensor:
    if out is not None:
        dtype = CODE_DTYPES[block.header.dtype]
        check_out(out, block.header.dtype, (block.header.raw_len // dtype.itemsize,))
    return objects.decode(block.data, block.header, out, check=check)


class Held:
    """What get_many took in the step of its index lookup (:meth:`RemoteAdapter.
    held_blocks`): the blocks of its misses this tier holds or is fetching already, and a
    watch of deletes of its keys from that step on (its promotion skips what they
    deleted: the get started before them)."""

    __slots__ = ("blocks", "watch")

    def __init__(self, blocks: dict[bytes, RemoteBlock | InFlight], watch: DeleteWatch
                 ) -> None:
        self.blocks = blocks
        self.watch = watch


def _decode_all(blocks: Sequence[tuple[int, RemoteBlock]], outs: Sequence[torch.Tensor | None],
                values: list[torch.Tensor | None]) -> None:
    """On a worker thread: blocks fetched already (by another read, or being promoted)
    decoded again from the verified object, as a fetch delivers them (a raw block is a
    copy; the promotion keeps its own tensor)."""
    for i, block in blocks:
        values[i] = _decode(block, outs[i])


class RemoteAdapter:
    """The remote tier of one open store (see the module docstring)."""

    def __init__(self, tier: RemoteTier, host: TierHost) -> None:
        self.tier = tier
        self._host = host
        self._promotions = Promotions(tier, host)

    def enqueue(self, keys: Sequence[bytes]) -> None:
        """Blocks a put just made durable: queued for upload (never waits)."""
        self.tier.enqueue(keys)

    def watch_deletes(self, keys: Sequence[bytes]) -> DeleteWatch:
        """A prefetch, when it is asked for: deletes of ``keys`` from now on are not
        undone by its promotion (pass the watch to :meth:`fetch_missing`)."""
        return self._host.watch_deletes(keys)

    def unwatch_deletes(self, watch: DeleteWatch) -> None:
        self._host.unwatch_deletes(watch)

    async def _fetch_own(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor | None],
                         inflights: Sequence[InFlight], *, chain: bool, promote_now: bool,
                         since: DeleteWatch | None) -> list[torch.Tensor | None]:
        """GET ``keys`` (registered as ``inflights`` by :func:`_read`), decode them into
        ``outs`` and promote them; each fetched block is handed to the reads waiting on its
        ``InFlight`` before the promotion starts."""
        # Registered before the fetch begins (and ``since``: the calling get's or
        # prefetch's, taken when it started): a delete of these keys from then on is
        # not undone by their promotion (it skips them).
        watch = self._host.watch_deletes(keys, since)
        try:
            values, handed = await self._fetch_and_promote(keys, outs, inflights, watch,
                                                      chain=chain, promote_now=promote_now)
        except BaseException:
            self._host.unwatch_deletes(watch)
            raise
        if not handed:
            self._host.unwatch_deletes(watch)
        return values

    async def _fetch_and_promote(self, keys: Sequence[bytes],
                                 outs: Sequence[torch.Tensor | None],
                                 inflights: Sequence[InFlight], watch: DeleteWatch, *,
                                 chain: bool, promote_now: bool
                                 ) -> tuple[list[torch.Tensor | None], bool]:
        """:func:`_fetch_own`'s work; also whether a background promotion took ``watch``."""
        remote = self.tier
        values: list[torch.Tensor | None] = [None] * len(keys)
        own: list[torch.Tensor | None] = [None] * len(keys)
        errors: list[Exception] = []
        # A GET abandoned at the read deadline finishes on its thread after fetch returned:
        # it must not decode into the caller's ``out`` then (the caller reuses it).  Decodes
        # run in parallel; the end waits for those already started.
        cond, state = threading.Condition(), {"over": False, "decoding": 0}

        def decode(i: int, block: RemoteBlock) -> None:
            """On the GET's worker thread, as soon as the block is verified."""
            with cond:
                if state["over"]:
                    return
                state["decoding"] += 1
            try:
                # the fetch left the payload CRC32C to this decode: a CorruptionError goes
                # back to it (a bad object, a miss)
                values[i] = value = _decode(block, outs[i], check=True)
                # The promotion keeps a tensor of its own (the caller may change theirs
                # before the background put stages it): a raw payload is a view of the
                # object's bytes, which nothing else holds; a decoded one a copy.
                payload = objects.raw_payload(block.data, block.header)
                own[i] = value.clone() if payload is None else payload.view(block.header.shape)
            except CorruptionError:
                raise
            except Exception as e:  # noqa: BLE001 - a bad ``out``: raised to the caller
                errors.append(e)
            finally:
                with cond:
                    state["decoding"] -= 1
                    cond.notify_all()

        def decodes_done() -> None:
            with cond:
                cond.wait_for(lambda: not state["decoding"])

        try:
            blocks = await remote.fetch(keys, chain=chain, then=decode)
        finally:
            with cond:
                state["over"] = True
                busy = state["decoding"] > 0
            if busy:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(decodes_done)
        # Verified blocks (and misses) go to the waiters at once (not after this read's
        # promotion: a lookup waiting on a prefetch's fetch does not wait for its local put),
        # even if this caller's ``out`` was bad.  A chain walk took nothing after its first
        # miss: those keys were never asked for, and their waiters ask themselves.
        answered = len(keys)
        if chain:
            answered = next((i + 1 for i, b in enumerate(blocks) if b is None), len(keys))
        for i, (inflight, block) in enumerate(zip(inflights, blocks)):
            if i < answered:
                inflight.finish(block)
            else:
                inflight.give_up()
        if errors:
            raise errors[0]
        promote: list[tuple[RemoteBlock, torch.Tensor]] = []
        for i, block in enumerate(blocks):
            value = own[i]
            if block is None:  # a miss, or past the first miss of a chain
                values[i] = None
            elif value is not None:
                promote.append((block, value))
        if promote_now:
            await self._promotions.promote(promote, background=False, watch=watch)
            return values, False
        return values, self._promotions.promote_soon(promote, watch)

    def held_blocks(self, keys: Sequence[bytes], entries: Sequence[IndexEntry | None]
                    ) -> Held:
        """For get_many, in the same step as its index lookup: the keys it did not find
        that the tier has already (being promoted) or is fetching for another read.  Taken
        then, because a promotion may land (and leave ``promoting``) while the local read
        runs; the get would otherwise fetch the block again.  With them, a watch of
        deletes of ``keys`` (:meth:`fill_misses` ends it; so does dropping it)."""
        remote = self.tier
        blocks: dict[bytes, RemoteBlock | InFlight] = {}
        for key, entry in zip(keys, entries):
            if entry is None and (block := remote.held(key)) is not None:
                blocks[key] = block
        return Held(blocks, self._host.watch_deletes(keys))

    async def _read(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor | None],
                    values: list[torch.Tensor | None] | None, *, chain: bool,
                    promote_now: bool = False, held: Held | None = None,
                    since: DeleteWatch | None = None) -> list[bool]:
        """Which of ``keys`` the remote tier has; with ``values``, their tensors too
        (decoded into ``outs``).  A key being promoted is served from its fetched block; a
        key another read is fetching waits for that read (its request is not sent twice);
        the rest is fetched here (:func:`_fetch_own`).  A key whose fetching read gave it
        up unanswered (cancelled, or past its chain walk's first miss) is fetched here
        after all.  ``held``: get_many's snapshot (:func:`held_blocks`); ``since``: the
        watch of deletes the calling get or prefetch took when it started.  ``chain``:
        only the leading run of found keys counts."""
        remote = self.tier
        found = [False] * len(keys)
        if held is not None:
            since = held.watch
        blocks = dict(held.blocks) if held is not None else {}
        todo = list(range(len(keys)))
        while todo:
            own: list[int] = []
            inflights: list[InFlight] = []
            joined: list[tuple[int, RemoteBlock | InFlight]] = []
            mine: set[int] = set()
            # No await from here to the fetch: a key is registered as ours in the same step
            # another read could have seen it missing.
            for i in todo:
                key = keys[i]
                block = blocks.get(key) or remote.held(key)
                if block is None:
                    block = remote.start_fetching(key)
                    own.append(i)
                    inflights.append(block)
                    mine.add(id(block))
                else:  # (a key twice in this read finds its own fetch registered)
                    joined.append((i, block))
                    if id(block) not in mine:  # not a duplicate key of this read's own fetch
                        remote.count_joined()
            try:
                got = await self._fetch_own([keys[i] for i in own], [outs[i] for i in own],
                                            inflights, chain=chain, promote_now=promote_now,
                                            since=since) if own else []
            finally:
                for i, inflight in zip(own, inflights):
                    remote.end_fetching(keys[i], inflight)
            for i, value in zip(own, got):
                found[i] = value is not None
                if values is not None:
                    values[i] = value
            todo, ready = [], []
            for i, block in joined:
                if isinstance(block, InFlight):
                    await block.done.wait()
                    if block.abandoned:  # its read gave the key up: ask ourselves
                        blocks.pop(keys[i], None)  # (the snapshot's, if it came from there)
                        todo.append(i)
                        continue
                    block = block.block
                if block is not None:
                    found[i] = True
                    ready.append((i, block))
            if values is not None and ready:
                await anyio.to_thread.run_sync(_decode_all, ready, outs, values)
        if chain:  # only the prefix counts
            n = next((i for i, f in enumerate(found) if not f), len(found))
            found[n:] = [False] * (len(found) - n)
            if values is not None:
                values[n:] = [None] * (len(values) - n)
        return found

    async def fill_misses(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor | None],
                          results: list[torch.Tensor | None], held: Held) -> None:
        """get_many: blocks the local store did not answer, from blocks being promoted or
        fetched (``held``: :func:`held_blocks`, taken with the index lookup), then from the
        remote."""
        try:
            miss = [i for i, r in enumerate(results) if r is None]
            if not miss:
                return
            values: list[torch.Tensor | None] = [None] * len(miss)
            await self._read([keys[i] for i in miss], [outs[i] for i in miss], values,
                             chain=False, held=held)
            for i, value in zip(miss, values):
                results[i] = value
        finally:
            self._host.unwatch_deletes(held.watch)

    async def extend_prefix(self, keys: Sequence[bytes]) -> int:
        """match_prefix: how many of ``keys`` (the chain after the local prefix) the remote
        has, in order (blocks being promoted or fetched count); they are fetched and
        promoted."""
        # Watched from the call's start: a key fetched only later (after a read it
        # joined gave it up) is not promoted over a delete made meanwhile.
        watch = self._host.watch_deletes(keys)
        try:
            found = await self._read(keys, [None] * len(keys), None, chain=True,
                                     since=watch)
        finally:
            self._host.unwatch_deletes(watch)
        return next((i for i, f in enumerate(found) if not f), len(found))

    async def fetch_missing(self, keys: Sequence[bytes], since: DeleteWatch) -> None:
        """prefetch: blocks absent locally are fetched and promoted first, and the prefetch
        waits for that (it then brings them into memory like any stored block).  Blocks
        already being promoted or fetched by another read are not fetched again.
        ``since``: the prefetch's watch, taken when it was asked for
        (:meth:`watch_deletes`)."""
        entries = self._host.lookup(keys)
        missing = [k for k, e in zip(keys, entries) if e is None]
        if missing:
            await self._read(missing, [None] * len(missing), None, chain=False,
                             promote_now=True, since=since)
