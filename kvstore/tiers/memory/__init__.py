"""The host-memory tier in front of the local store: the tier (``tier``:
``MemoryTier``: hits, fills, forgetting, prefetch, behind the call paths' port
:class:`kvstore.core.tier_ports.MemoryPort`), its bounded cache in one region of host
RAM (``cache``: ``MemoryCache``) and the prefetch handle (``prefetch``).  It may import the
tier port (:mod:`kvstore.tiers.host`), :mod:`kvstore.core`, :mod:`kvstore.index`,
:mod:`kvstore.io`, :mod:`kvstore.codecs` and :mod:`kvstore.disk`.
"""
