"""Whether vLLM's own prefix cache may still hold KV of the weights before a weight
update (part of the vLLM connector's scheduler side, :mod:`kvstore.integrations.vllm.scheduler.side`).

``reset_prefix_cache(reset_connector=True)`` clears two caches: vLLM's prefix cache (its
KV cache manager) and the connector's store (``reset_cache``: a move to a new key
scope).  vLLM 0.32 refuses its own reset while any request holds KV blocks (a request
running, or waiting for a load), and calls the connector's ``reset_cache`` anyway.  Its
prefix cache then keeps serving the old weights' KV as local hits, and every request
that hits it computes the rest of its KV on the new weights on top of old KV: saved
under the new scope, such blocks would be loaded later by an engine on the new weights
(wrong tokens).  KV computed after the reset by a request that ran across it is mixed
the same way and lands in vLLM's prefix cache too, as does KV of any request that hit
mixed blocks.

So the connector needs to know whether vLLM's cache was cleared, and, while it was not,
which requests reuse anything from it.

*Cleared or not.*  vLLM binds its block pool to the connector
(``bind_gpu_block_pool``).  ``reset_cache`` runs right after vLLM's own reset, on the
same thread: vLLM's cache is clear exactly when no block is held by a request and no
block has a hash any more, which is what a reset vLLM accepted leaves (and what a cache
that never held anything looks like).  Without the pool the connector cannot know, and
treats the cache as stale from then on.

*Which requests.*  While the cache is stale, every local prefix hit may be old KV, KV a
request running at the reset computed on top of it, or KV of a request that hit either:
telling them apart would need the history of every block id.  The connector takes the
one test that needs none: a request with a local hit -- the block-aligned hit vLLM hands
``get_num_new_matched_tokens``, or, when it is first scheduled (new, or resumed after a
preemption, which looks up again), the tokens it had computed beyond what the connector
loaded, which includes a sub-block tail the lookup never saw -- is *stale*: nothing is
loaded into it and nothing of it is saved.  A request with no local hit computes all of
its KV after the reset, on the new weights, from blocks it loaded from the new scope
(saved only by such requests, or by engines on the new weights): it is saved as usual.
Requests that were known at the reset are never saved anyway (``_RequestState.frozen``).
The cache stays stale until a later reset vLLM accepts; until then the cost is that
requests sharing a prefix with an earlier one are computed but not stored.

vLLM's pool is read through its public members only (``blocks``, and per block
``is_null``, ``ref_cnt``, ``block_hash``); another vLLM without them counts as "cannot
know".
"""

from __future__ import annotations

from typing import Any

__all__ = ["StaleCache"]


class StaleCache:
    """``active`` while vLLM's prefix cache may hold KV from before the connector's
    last key-scope move (see the module docstring); ``pool`` is vLLM's block pool, once
    vLLM bound it."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.active = False

    def reset(self) -> bool | None:
        """The connector's key scope moves now, right after vLLM's own reset: True if
        vLLM's prefix cache is clear, False if not, None if the pool cannot be read.
        ``active`` from now on unless it is clear."""
        cleared = self._cleared()
        self.active = cleared is not True
        return cleared

    def _cleared(self) -> bool | None:
        pool = self.pool
        if pool is None:
            return None
        try:
            # (The null block's reference count is not kept.)
            return not any(not b.is_null and (b.ref_cnt > 0 or b.block_hash is not None)
                           for b in pool.blocks)
        except (AttributeError, TypeError):
            return None
