"""The store's call paths, below the coordinator ``kvstore.store.Store``: its parts opened
and closed in order (``opening``), space (``allocator``), puts (``puts``, with
``backlog`` and ``key_order``), gets (``gets``) over verified reads (``reads``),
deletes' watches (``deletes``), calls in flight and health (``operations``), reads
retried and restored (``rechecks``), the background scrub (``scrub``), call
latencies (``latency``), the event stream's subscriptions (``events``) and the paged
listing of what is stored (``snapshot``).  It may import :mod:`kvstore.index`, :mod:`kvstore.io`,
:mod:`kvstore.disk`, :mod:`kvstore.codecs` and the public values it works with
(``kvstore.keys``, ``kvstore.options``, ``kvstore.stats``, ``kvstore.errors``).  It
reaches the memory and remote tiers only through the Protocols of ``tier_ports``.
"""
