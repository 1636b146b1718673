"""Fuzz targets for every decoder of bytes kvstore reads back from disk.

The decoders in :mod:`kvstore.disk.format` (and the namespace meta record parser in
:mod:`kvstore.keys`) are the store's only defence against torn writes, bit rot and
stores written by other builds.  Their contract is narrow: turn any input into a
correct value or into one of kvstore's own errors
(:class:`kvstore.errors.KVStoreError`), because ``get_many``/``open``/fsck only know
how to handle those.  ``fuzz.targets.TARGETS`` holds one plain ``bytes -> None``
function per decoder, usable from atheris (``fuzz/run_atheris.py``) and Hypothesis
(``tests/test_fuzz.py``) alike.  See ``fuzz/README.md``.
"""
