"""The vLLM connector's worker side: the KV layout and the calls vLLM's worker makes
(``side``: ``WorkerSide``), the worker's part of the open store (``store``:
``WorkerStore``: load staging, the read-ahead of synchronous loads, saves in flight),
a step's loads (``loads``; in the background: ``background_loads``), the copy-out of a
step's new blocks (``copy_out``) and their puts in flight (``background_puts``), and the
data mover made from the options (``mover``).  It may import the vLLM level,
:mod:`kvstore.integrations.common`, the public API, :mod:`kvstore.codecs` and
:mod:`kvstore.cuda`.
"""
