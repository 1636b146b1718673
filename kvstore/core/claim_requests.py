"""Other owners' idle claims back when a put needs them (issue 43; docs/multiprocess.md,
"Capacity and claims").

Claims count as used (kvstore/core/claiming.py): an owner that put a little and went
quiet holds up to two quanta that no other owner can place a slot in.  When a reserve
finds no room, nothing left to evict and nothing of its own coming back, and other
owners hold claims, :meth:`ClaimRequests.make_room`

1. recovers the dead owners among them (:meth:`~kvstore.core.owners.Owner.recover_dead`:
   their claims go back to the pool at once);
2. writes a new random value into the claim requests word of ``owners/marks``
   (:mod:`kvstore.io.marks`) and polls the counters, backing off from 1 ms to
   :data:`LISTEN_S`, until the other owners' claims shrink, its own allocator changes,
   or :data:`ANSWER_WAIT_S` passed (in all, however many looks the reserve takes).

Every owner listens (:meth:`ClaimRequests.listen`, a background task of the open store):
every :data:`LISTEN_S` it reads the word, and when it changed it gives every unreserved
claimed run back to the pool in one transaction
(:meth:`~kvstore.core.claiming.OwnClaims.give_back_all`).  A read of one mapped word, no
transaction, so listening costs nothing measurable.

Claims go back on request, not after an idle time: an owner able to return them on a
timer answers a request within :data:`LISTEN_S` too, and one that cannot answer (a stopped
process) would not run its timer either; so a timer would only add transactions.  An
owner that does not answer in time (stopped, or its event loop blocked) leaves the put to
fail with :class:`~kvstore.errors.CapacityError`, which names the bytes it holds.
Waits across processes are polls, outside any transaction (docs/multiprocess.md, "Lock
order").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from kvstore.index.space_counters import CLAIMED

if TYPE_CHECKING:
    from kvstore.core.claiming import OwnClaims
    from kvstore.io.marks import MarksFile

__all__ = ["ANSWER_WAIT_S", "LISTEN_S", "ClaimRequests"]

logger = logging.getLogger("kvstore.store")

LISTEN_S = 0.05
"""How often an owner looks at the claim requests word."""

ANSWER_WAIT_S = 5.0
"""How long a put waits for other owners to give claims back before it is refused."""


class ClaimRequests:
    """This owner's side of the claim requests (the module docstring): it asks
    (:meth:`make_room`) and answers (:meth:`listen`).  ``file``: the store's marks file
    (None: no native helper, this owner is alone and nobody can be asked);
    ``recover``: the owner's live recovery of dead owners."""

    def __init__(self, *, claims: OwnClaims, file: MarksFile | None,
                 recover: Callable[[], Awaitable[int]]) -> None:
        self._claims, self._file, self._recover = claims, file, recover
        self._seen = file.claim_requests() if file is not None else 0
        self._mine = 0  # the value of this owner's last request (its listener skips it)
        self.answer_wait_s = ANSWER_WAIT_S  # (tests shorten it)
        self.asked = 0  # requests this owner made
        self.answered = 0  # requests of others this owner answered by giving claims back
        self.unanswered = 0  # other owners' claimed bytes its last request left unreturned
        # (ticket, deadline): the reserve asking now (reserves ask one at a time: the
        # others wait in line behind it) waits this long in all, however many looks
        self._asking = (-1, 0.0)
        # what the last unanswered request saw (others' claims, used): while nothing
        # changed, the next reserve asks again but does not wait
        self._stuck: tuple[int, int] | None = None

    async def recover_dead(self) -> int:
        """Recover the dead owners (their claims back in the pool, their marks cleared:
        the space a dead owner's frozen mark held ripens); how many there were.  A
        failure (a lock file it may not open, a full disk at the commit) is logged and
        counts as none: the put that asked goes on as if no owner were dead."""
        try:
            return await self._recover()
        except Exception as e:  # noqa: BLE001 - a probe's failure must not fail a put
            logger.warning("kvstore %s: recovering dead owners failed: %r",
                           self._claims.index.path, e)
            return 0

    def others_claimed(self) -> int:
        """Bytes claimed by other owners (the counter less this owner's rows), one read
        transaction."""
        index, owner = self._claims.index, self._claims.owner
        with index.begin() as txn:
            total = index.space.read(txn)[CLAIMED] or 0
            mine = sum(length for _, _, length in index.space.claims_of(txn, owner))
        return total - mine

    async def make_room(self, ticket: int, used: int, changed: Callable[[], bool]) -> bool:
        """Reserve ``ticket`` found no room and nothing else to wait for: True when
        other owners' claims may have made some (look again), False when none can
        (refuse).  ``used``: the store's used bytes at the reserve's look (other owners
        may have given claims back since: look again); ``changed``: whether this
        owner's allocator changed meanwhile (look again too).  One reserve waits
        :attr:`answer_wait_s` in all, however many looks it takes."""
        self.unanswered = 0
        if self._asking[0] != ticket:
            self._asking = (ticket, anyio.current_time() + self.answer_wait_s)
        deadline = self._asking[1]
        if anyio.current_time() < deadline and self._claims.used() != used:
            return True  # (e.g. claims given back since its look)
        others = self.others_claimed()
        if not others:
            return False
        if await self.recover_dead():  # (dead owners' claims are back in the pool)
            return True
        if self._file is None:
            return False
        self._mine = self._file.request_claims()
        self.asked += 1
        if self._stuck == (others, used):
            deadline = 0.0  # (asked, so that an owner that runs again answers; no wait)
        delay = 0.001
        while anyio.current_time() < deadline:
            await anyio.sleep(delay)
            delay = min(2 * delay, LISTEN_S)
            if changed() or self.others_claimed() < others:
                self._stuck = None
                return True
        self.unanswered = others
        self._stuck = (others, self._claims.used())
        return False

    def unanswered_note(self) -> str:
        """What a refused put's error adds when its request went unanswered."""
        if not self.unanswered:
            return ""
        return (f", and {self.unanswered} bytes are claimed by other owners of the store "
                f"that did not give them back within {self.answer_wait_s:g} s (a stopped "
                "process, or one whose event loop is blocked)")

    async def listen(self, closed: Callable[[], bool]) -> None:
        """Answer other owners' requests until ``closed()`` (the store is closing: its
        claims go back with its row); a background task of the open store."""
        file = self._file
        while file is not None and not closed():
            await anyio.sleep(LISTEN_S)
            if closed():  # (its marks file may be closed by now)
                return
            now = file.claim_requests()
            if now in (self._seen, self._mine):
                continue
            self._seen = now
            try:
                if await self._claims.give_back_all():
                    self.answered += 1
            except Exception as e:  # noqa: BLE001 - (the claims stay this owner's)
                logger.warning("kvstore %s: could not give claims back to a request: %r",
                               self._claims.index.path, e)
