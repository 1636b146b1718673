"""What every engine integration reads alike: the store's options in an engine's JSON
extra config (``extra_config``) and a cheap fingerprint of the weights an engine loaded
(``fingerprint``).  It may import the public API, :mod:`kvstore.codecs` and the remote
tier's options.
"""
