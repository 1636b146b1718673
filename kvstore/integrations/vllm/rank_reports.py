"""What a worker (one rank) tells the scheduler side about its store's content, for
vLLM's KV events: a list of reports, carried from every rank to the scheduler by
vLLM's ``kv_cache_events`` of the step's output (pickled between processes: plain
tuples of ints and bytes).

A report is ``(rank, epoch, kind, body)``: ``epoch`` the key scope's epoch the worker
was in (a report of an older scope is ignored), ``kind`` one of

* ``STORED``: the rank's store holds the block (a put committed it, a quarantined copy
  was restored, or the start-up replay listed it); ``body`` is its tag's body
  (:mod:`kvstore.integrations.vllm.block_tags`);
* ``REMOVED``: the block left the rank's store (evicted, deleted, quarantined);
* ``BUSY`` / ``SETTLED``: the rank has saves in flight or a replay unfinished (its
  events are still to come) / no longer (body empty);
* ``RESYNC``: the rank lost events (its subscription overflowed) and replays its
  store again: forget what it held (body empty).

Kept apart from :mod:`kvstore.integrations.vllm` so that it imports without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUSY", "REMOVED", "RESYNC", "SETTLED", "STORED", "Report", "events_enabled"]

STORED, REMOVED, BUSY, SETTLED, RESYNC = range(5)

Report = tuple[int, int, int, bytes]


def events_enabled(vllm_config: Any) -> bool:
    """Whether the engine publishes KV events (``--kv-events-config`` with
    ``enable_kv_cache_events``): only then does the connector follow its stores."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)
