"""What is stored where, durably: the LMDB index (``index``: every transaction the store
and fsck run, by name), its meta records (``meta``) and fsck's repairs (``repairs``),
its writer thread with group commit (``writer``) and the journal of each transaction's
content changes for the event stream (``journal``), the environment's files opened
safely (``file``), the durable free map (``free_map``), the choice of eviction victims
(``eviction``), quarantined blocks (``quarantine``) and the totals persisted across
opens (``totals``).  It may import only :mod:`kvstore.disk`
(and :mod:`kvstore.errors`).
"""
