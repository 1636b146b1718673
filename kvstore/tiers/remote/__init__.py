"""The shared remote tier on an S3-compatible cluster (``open(remote=RemoteConfig(...))``):
the options (``config``), object names and bytes (``objects``, ``blocks``: FORMAT.md,
"Remote objects"), the obstore wrapper (``client``), the circuit breaker (``breaker``),
requests in flight (``request_slots``), the upload queue (``uploads``), verified fetches
(``fetch``), the tier itself (``tier``), the store's side of it through the tier port
(``adapter``: the call paths reach it through
:class:`kvstore.core.tier_ports.RemotePort`), fetched blocks stored locally
(``promotion``), ``python -m kvstore remote check`` (``check``) and ``RemoteStats``
(``stats``).  ``config`` and ``stats`` import without the ``remote`` extra.  It may
import the tier port, :mod:`kvstore.core`, :mod:`kvstore.index`, :mod:`kvstore.io`,
:mod:`kvstore.codecs` and :mod:`kvstore.disk`.
"""
