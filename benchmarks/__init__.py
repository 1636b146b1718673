"""kvstore benchmarks: ``python -m kvstore bench`` (see :mod:`benchmarks.bench`).

One run measures, interleaved, on one file system and the same data: the physical limit
(fio), kvstore (both I/O engines, raw and FP8), and the peers (LMCache's local disk
backend, one file per block with tmp + rename, ``torch.save`` per block, raw numpy
files); then per-batch latency and how ``open()`` / ``match_prefix`` scale with the
number of stored blocks.  Modules, one job each:

``common``   units, statistics, machine description, page-cache control, sync
``data``     the block tensors every system stores (deterministic, shared with peers)
``fio``      fio runs (io_uring, O_DIRECT) at the same block size and queue depth
``systems``  the systems under test behind one small interface (kvstore and peers)
``lmcache_driver``  runs inside LMCache's own virtual environment, driven over a pipe
``sweep``    throughput sweep, the beyond-dirty-limit store run, batch latency
``scale``    open() / match_prefix / memory vs store size (1k .. 1M blocks)
``report``   markdown table with ratios and targets, JSON, PNG plot
``bench``    the command line (``--smoke``, ``--install-peers``, ``--out``)

Nothing in here imports kvstore at module level except ``systems``, ``scale`` and
``bench``: ``data`` and ``lmcache_driver`` also run in the peer's interpreter.
"""
