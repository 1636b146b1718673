"""Cheap, content-based fingerprints of model weights, for the connector's key scope.

KV blocks are only reusable by an engine running the very weights that computed them.
A model path or hub id says nothing about that: a retrained checkpoint is written to the
same directory, a hub branch moves.  So the connector's namespace includes a fingerprint
of the files the engine loaded, computed here in a few milliseconds, never by hashing
100 GB of weights at every start.

What is hashed (``mode="sample"``, the default), per weight file at the top level of the
model directory (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, ``*.npz``
and their index/config JSON files), in name order:

1. the file name and its size;
2. the first 64 KiB (a safetensors or GGUF header: every tensor's name, dtype, shape and
   offset) and the last 64 KiB;
3. ``SAMPLES`` blocks of 4 KiB at evenly spaced offsets in between.

Why that is enough: training changes (essentially) every parameter, so a retrained or
fine-tuned checkpoint of the same architecture -- same names, sizes and headers --
differs in every sampled block; a different model, quantisation or export differs in
its headers and sizes.  What sampling cannot see is a hand edit of a few bytes that
falls between the samples; ``mode="full"`` hashes every byte (3.3 s per GiB measured
on the development machine, so minutes for a 70B model; sampling took 25 ms for 1 GiB in
four files, cold), and an operator can instead name the weights explicitly
(``model_id`` in the connector's config: a build id, a commit).  File times are left
out on purpose: a copy of the same weights (a container pulling the model at start)
must keep hitting the same blocks.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Literal

__all__ = ["SAMPLES", "WEIGHT_SUFFIXES", "FingerprintError", "fingerprint_files",
           "fingerprint_weights", "weight_files"]

Mode = Literal["sample", "full"]

SAMPLES = 32
_SAMPLE = 4096
_EDGE = 64 << 10
_FULL_CHUNK = 8 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".ckpt")
# Files that change how the weights are read (sharding index, quantisation, Mistral's
# params.json).  The effective model config is scoped separately, as vLLM applies it.
_CONFIG_FILES = ("config.json", "params.json", "quantize_config.json", "hf_quant_config.json",
                 "quant_config.json", "adapter_config.json")


class FingerprintError(ValueError):
    """The weights cannot be located or read, so no safe key scope can be built."""


def weight_files(path: str | os.PathLike[str]) -> list[str]:
    """The files of a model (a directory, or one file such as a GGUF) that are hashed."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FingerprintError(f"no model weights at {path!r} (not a file or directory)")
    names = sorted(n for n in os.listdir(path)
                   if (n.endswith(WEIGHT_SUFFIXES) or n in _CONFIG_FILES
                       or n.endswith(".index.json"))
                   and os.path.isfile(os.path.join(path, n)))
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        raise FingerprintError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path!r}")
    return [os.path.join(path, n) for n in names]


def _offsets(size: int) -> Iterable[tuple[int, int]]:
    """(offset, length) of the sampled ranges of a file of ``size`` bytes."""
    if size <= 2 * _EDGE + SAMPLES * _SAMPLE:
        yield 0, size
        return
    yield 0, _EDGE
    span = size - 2 * _EDGE - _SAMPLE
    for i in range(SAMPLES):
        yield _EDGE + span * i // max(SAMPLES - 1, 1), _SAMPLE
    yield size - _EDGE, _EDGE


def _hash_file(h: hashlib.blake2b, path: str, mode: Mode) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h.update(f"{os.path.basename(path)}\0{size}\0".encode())
        ranges = [(o, min(_FULL_CHUNK, size - o)) for o in range(0, size, _FULL_CHUNK)] \
            if mode == "full" else list(_offsets(size))
        for offset, length in ranges:
            data = os.pread(fd, length, offset)
            if len(data) != length:
                raise FingerprintError(f"{path!r} shrank while it was fingerprinted")
            h.update(data)
    finally:
        os.close(fd)


def fingerprint_files(files: Iterable[str], mode: Mode = "sample") -> str:
    """Hex BLAKE2b-128 over ``files`` (in the given order) as described above."""
    if mode not in ("sample", "full"):
        raise ValueError(f"fingerprint mode must be 'sample' or 'full', got {mode!r}")
    h = hashlib.blake2b(f"kvstore-weights-v1;{mode}".encode(), digest_size=16)
    try:
        for path in files:
            _hash_file(h, path, mode)
    except OSError as e:
        raise FingerprintError(f"cannot read model weights: {e}") from e
    return h.hexdigest()


def fingerprint_weights(path: str | os.PathLike[str], mode: Mode = "sample") -> str:
    """Fingerprint of the model at ``path`` (a directory or a single weight file)."""
    return fingerprint_files(weight_files(path), mode)
