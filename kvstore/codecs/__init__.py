"""Payload encodings, per block: the codec pipeline (``pipeline``: ``prepare``/``encode``
and ``decode``), the codec ids and ``CodecSpec`` (``spec``), FP8 with power-of-two
scales (``fp8``; its payload parsed and decoded by ``fp8_payload``), the zstd stage and
lossless byte planes (``planes``), the compiled FP8 rows (``fp8_kernels``), the value
checks and dtype codes every path shares (``tensors``) and the recycled memory decoded
results land in (``result_buffers``).  Pure functions of a tensor and a spec: it knows
nothing of slots, extents or the index, and imports only :mod:`kvstore.disk.format`,
:mod:`kvstore._native` and :mod:`kvstore.errors`.  ``CodecSpec`` and ``KVLayout`` are
re-exported here (the API guide has users choose a codec as
``kvstore.codecs.CodecSpec(...)``), and so is what the GPU path (:mod:`kvstore.cuda`)
needs to produce and parse the same FP8 payloads: the payload header, the scale plans,
the zstd stage.
"""

from kvstore.codecs.fp8 import (
    FP8_HEADER,
    fp8_smaller,
    norm_axes,
    part_plan,
    row_scale_index,
    scale_count,
)
from kvstore.codecs.pipeline import (
    CODEC_RAW,
    FP8_E4M3,
    FP8_E5M2,
    GRANULARITIES,
    ZSTD,
    CodecSpec,
    Encoded,
    Fp8Payload,
    KVLayout,
    Payload,
    codec_id,
    decode,
    encode,
    is_known,
    is_lossless,
    parse_fp8_payload,
    planned_nbytes,
    prepare,
)
from kvstore.codecs.planes import zstd_stage
from kvstore.codecs.spec import NO_AXIS

__all__ = ["CODEC_RAW", "FP8_E4M3", "FP8_E5M2", "FP8_HEADER", "GRANULARITIES", "NO_AXIS",
           "ZSTD", "CodecSpec", "Encoded", "Fp8Payload", "KVLayout", "Payload", "codec_id",
           "decode", "encode", "fp8_smaller", "is_known", "is_lossless", "norm_axes",
           "parse_fp8_payload", "part_plan", "planned_nbytes", "prepare", "row_scale_index",
           "scale_count", "zstd_stage"]
