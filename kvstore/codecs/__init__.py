"""Payload encodings, per block: the codec pipeline (``pipeline``: ``CodecSpec``, FP8
with power-of-two scales, zstd over FP8 codes or byte planes, and decoding), the
compiled FP8 rows (``fp8_kernels``), the value checks and dtype codes every path shares
(``tensors``) and the recycled memory decoded results land in (``result_buffers``).
Pure functions of a tensor and a spec: it knows nothing of slots, extents or the index,
and imports only :mod:`kvstore.disk.format`, :mod:`kvstore._native` and
:mod:`kvstore.errors`.  ``CodecSpec`` and ``KVLayout`` are re-exported here: the API
guide has users choose a codec as ``kvstore.codecs.CodecSpec(...)``.
"""

from kvstore.codecs.pipeline import CodecSpec, KVLayout

__all__ = ["CodecSpec", "KVLayout"]
