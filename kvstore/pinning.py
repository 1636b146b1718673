"""Deprecated: renamed :mod:`kvstore.io.page_locking` ("pin" now means only never-evict,
``Store.pin``).  These aliases stay for one release.

``ArenaPin`` is :class:`~kvstore.io.page_locking.ArenaPageLock`, ``ArenaPinner``
:data:`~kvstore.io.page_locking.PageLocker`, ``default_pinner``
:func:`~kvstore.io.page_locking.default_page_locker` and ``set_default_pinner``
:func:`~kvstore.io.page_locking.set_default_page_locker`.
"""

from __future__ import annotations

import warnings

from kvstore.io.page_locking import ArenaPageLock as ArenaPin
from kvstore.io.page_locking import PageLocker as ArenaPinner
from kvstore.io.page_locking import default_page_locker as default_pinner
from kvstore.io.page_locking import set_default_page_locker as set_default_pinner

warnings.warn("kvstore.pinning is renamed kvstore.io.page_locking (\"pin\" now means only "
              "never-evict, Store.pin); the old names go in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["ArenaPin", "ArenaPinner", "default_pinner", "set_default_pinner"]
