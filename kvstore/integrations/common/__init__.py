"""What every engine integration reads alike: the store's options in an engine's JSON
extra config (``extra_config``), a cheap fingerprint of the weights an engine loaded
(``fingerprint``) and the store options of one rank of an engine whose ranks keep a
store each (``ranks``).  It may import the public API, :mod:`kvstore.codecs` and the remote
tier's options.
"""
