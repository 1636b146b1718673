"""Bytes on disk and their names: the on-disk format (``format``: FORMAT.md's
structures, CRC32C), every file and directory name of a store, once (``layout``), the
store's own files opened safely (``store_files``: no link followed), the extent files
(``extents``), the store's lock (``lock``) and file modes (``permissions``).  The bottom of the package: it imports nothing of kvstore but
:mod:`kvstore.errors`, and every folder above may import it.
"""
