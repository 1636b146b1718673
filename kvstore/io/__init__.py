"""The only road to a store's bytes: the I/O engines behind one protocol (``protocol``;
``uring``, ``threads``, ``simulated``, chosen by ``probe``), the page-aligned staging
arena (``arena``, ``aligned``), read-first scheduling (``scheduler``), merged and
retried requests (``coalesce``), slots staged into and verified out of arena runs
(``slots``, ``native_slots``), chunked transfers between blocks and extent files
(``transfers``), new extent files made through the engine (``extent_files``), the
shared fdatasync (``group_sync``), and what it asks of a device: copies
(``device_copies``) and page-locking the arena for DMA (``page_locking``).  It may
import :mod:`kvstore.disk`, :mod:`kvstore.codecs` and :mod:`kvstore._native`; the
optional GPU path (:mod:`kvstore.cuda`) it never imports: the store hands it the
implementations.
"""
