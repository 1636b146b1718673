"""The host-memory tier in front of the local store: its bounded cache in an arena
region (``tier``: ``MemoryTier``), the store's use of it for hits, fills and prefetch
(``room``: ``MemoryRoom``) and the prefetch handle (``prefetch``).  It may import the
tier port (:mod:`kvstore.tiers.host`), :mod:`kvstore.core`, :mod:`kvstore.index`,
:mod:`kvstore.io`, :mod:`kvstore.codecs` and :mod:`kvstore.disk`.
"""
