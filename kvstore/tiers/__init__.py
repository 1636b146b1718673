"""What sits beside the local store: the port a tier is handed (``host``:
:class:`~kvstore.tiers.host.TierHost`; the remote tier works through it, the memory
tier's room is still handed the store's index, reads and counters one by one), host
memory in front of the store (:mod:`kvstore.tiers.memory`) and the shared remote behind
it (:mod:`kvstore.tiers.remote`).  A tier may import the port, :mod:`kvstore.core`,
:mod:`kvstore.index`, :mod:`kvstore.io`, :mod:`kvstore.codecs` and
:mod:`kvstore.disk`; the store's call paths import no tier: they reach one through
the Protocols of :mod:`kvstore.core.tier_ports`, and ``kvstore.store`` builds the
tiers and attaches them there.
"""
