"""The shared remote tier on an S3-compatible cluster (``open(remote=RemoteConfig(...))``).

Modules: ``config`` (the options), ``objects`` (object names and bytes: FORMAT.md,
"Remote objects"), ``client`` (the obstore wrapper), ``breaker`` (circuit breaker),
``slots`` (requests in flight, counted until each returns),
``tier`` (upload queue, verified reads under a deadline), ``local`` (the store's
hooks), ``check`` (``python -m kvstore remote check``), ``stats`` (``RemoteStats``).
``RemoteConfig`` and ``RemoteStats`` import without the ``remote`` extra installed.
"""

from kvstore.remote.config import RemoteConfig
from kvstore.remote.stats import RemoteStats

__all__ = ["RemoteConfig", "RemoteStats"]
