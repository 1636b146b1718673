"""Which stored block the first page of an SGLang backup batch follows: its parent in
kvstore's chains, which eviction keeps free of holes (it takes a chain's tail first).

SGLang's controller backs up one operation (a radix-tree node's pages) in batches of
:data:`STORAGE_BATCH_SIZE` pages, one ``batch_set*`` call each, in order, on its backup
thread (``HiCacheController._page_backup``).

* With ``hicache_storage_pass_prefix_keys`` on, every call carries the hashes of all the
  pages before it (``extra_info.prefix_keys``: the node's ancestors, then the earlier
  batches): the first page follows the last of them.  Exact, across batches and nodes.
* With it off (SGLang's default) no call says what came before it.  The batches of one
  operation are still chained: a call that comes, on the same thread, right after a
  full batch (exactly :data:`STORAGE_BATCH_SIZE` pages) written without prefix keys
  continues it, because SGLang cuts only an operation's last batch short.  Before,
  each batch began a chain of its own, and eviction took one batch's tail while the
  next batch stayed stored behind the hole, never hit again.  One ambiguity is left: an
  operation of an exact multiple of :data:`STORAGE_BATCH_SIZE` pages followed by an
  unrelated one links the second's first page to the first's last page.  A link too
  many only keeps a block from eviction while its (supposed) child is stored, so it
  never makes a hole.  What nothing can chain without prefix keys: a node backed up
  after its parent node (a later turn, a split) starts a chain of its own, and eviction
  may take the parent node's pages first; the backend warns once (docs/sglang.md).
"""

from __future__ import annotations

import logging
import threading

__all__ = ["STORAGE_BATCH_SIZE", "BatchChains"]

# sglang.srt.managers.cache_controller.STORAGE_BATCH_SIZE (0.5.23): the pages of one
# backup batch (tests/integrations/sglang checks it against the installed package).
STORAGE_BATCH_SIZE = 128

logger = logging.getLogger("kvstore.integrations.sglang")


class BatchChains:
    """Per calling thread, the last block of a full batch written without prefix keys,
    which the thread's next batch continues (see the module doc)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._warned = False

    def first_parent(self, prefix_tail: bytes | None, has_prefix: bool) -> bytes | None:
        """The parent of a batch's first block: the last block of the prefix SGLang
        passed (``has_prefix``), else the block this thread's previous full batch
        ended with."""
        if has_prefix:
            return prefix_tail
        return getattr(self._local, "tail", None)

    def written(self, pages: int, last_block: bytes | None, ok: bool, has_prefix: bool) -> None:
        """A batch of ``pages`` pages ending with ``last_block`` was put (``ok``)."""
        full = ok and not has_prefix and pages == STORAGE_BATCH_SIZE
        self._local.tail = last_block if full else None

    def new_operation(self) -> None:
        """The thread starts another operation (a hybrid one begins with its sidecars)."""
        self._local.tail = None

    def warn_without_prefix_keys(self) -> None:
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "kvstore HiCache backend: SGLang passes no prefix keys "
            "(hicache_storage_pass_prefix_keys is off): the batches of one backup are "
            "chained, but a radix node backed up after its parent node starts a chain of "
            "its own, so eviction may take the parent's pages first and leave the node's "
            "pages unreachable; add \"hicache_storage_pass_prefix_keys\": true to "
            "--hicache-storage-backend-extra-config (docs/sglang.md)")
