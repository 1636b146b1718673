"""The vLLM connector's worker side: the store it opens per rank and the KV layout
(``side``: ``WorkerSide``), the open store shared by a process's connectors
(``shared``: ``SharedStore``), background loads (``loads``), step saves (``saves``) and
their puts in flight (``background_saves``), and the data mover made from the options
(``mover``).  It may import the vLLM level, :mod:`kvstore.integrations.common`, the
public API, :mod:`kvstore.codecs` and :mod:`kvstore.cuda`.
"""
