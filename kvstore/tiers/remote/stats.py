"""``RemoteStats``: what the remote tier did, from ``store.remote.stats()``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class RemoteStats:
    """Counters since the store was opened.  ``state``: ``"ok"``, ``"unreachable"`` (the
    circuit breaker is open: remote calls are fast misses until ``retry_in_s``),
    ``"probing"`` (one request is testing the cluster) or ``"disabled"`` (refused
    credentials with ``on_auth_error="disable"``; ``reason`` says why)."""

    state: str = "ok"
    reason: str = ""
    retry_in_s: float = 0.0
    breaker_trips: int = 0  # times the breaker opened
    fast_misses: int = 0  # blocks answered as misses without a request (breaker open)
    requests: int = 0  # S3 requests sent
    request_errors: int = 0  # requests that got no answer (counted by the breaker)
    # requests in flight now, abandoned ones (past their read deadline, still waiting
    # for the cluster) included: never above RemoteConfig.concurrency
    requests_in_flight: int = 0
    gets: int = 0  # blocks looked up in the remote
    hits: int = 0  # blocks fetched and verified
    joined: int = 0  # blocks a read took from another read's fetch (not requested twice)
    misses: int = 0  # blocks not in the remote (or not fetched by the deadline)
    deadline_misses: int = 0  # blocks given up on at the read deadline (unanswered
    # requests then are breaker failures when the read got no answer at all)
    bad_objects: int = 0  # objects that failed verification (CRC, key, HMAC): misses
    # requests the cluster refused with a client error about that object (a 4xx such as
    # EntityTooLarge): a miss, or an upload given up at once; not breaker failures
    refused_objects: int = 0
    read_bytes: int = 0  # object bytes fetched
    promoted_blocks: int = 0  # fetched blocks stored locally (in the background)
    promotion_dropped: int = 0  # fetched blocks not stored locally: backpressure, full disk
    promoting_blocks: int = 0  # fetched blocks whose local put is in flight now
    uploads_queued: int = 0
    uploaded_blocks: int = 0
    uploaded_bytes: int = 0
    upload_existing: int = 0  # objects already in the bucket: not uploaded again
    upload_dropped: int = 0  # not uploaded: queue full, or still queued at close
    upload_failed: int = 0  # given up after failed attempts
    upload_vanished: int = 0  # evicted or deleted locally before their upload
    upload_queue_blocks: int = 0  # waiting now

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
