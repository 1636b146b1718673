"""The name users import the remote tier's options by: ``from kvstore.remote import
RemoteConfig`` (and ``RemoteStats``).  The tier itself lives in
:mod:`kvstore.tiers.remote`; this package only re-exports its two plain values.
"""

from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.stats import RemoteStats

__all__ = ["RemoteConfig", "RemoteStats"]
