"""Weight fingerprints for the vLLM connector's key scope, on real files."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from kvstore.integrations.common.fingerprint import (
    FingerprintError,
    fingerprint_files,
    fingerprint_weights,
    weight_files,
)


def _write_model(path: Path, seed: int, size: int = 3 << 20) -> None:
    """A safetensors-like file: an 8-byte header length, a JSON header, random data."""
    path.mkdir(parents=True, exist_ok=True)
    header = b'{"w":{"dtype":"F32","shape":[%d],"data_offsets":[0,%d]}}' % (size // 4, size)
    data = np.random.default_rng(seed).standard_normal(size // 4).astype(np.float32)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                             + data.tobytes())
    (path / "config.json").write_text('{"hidden_size": 128}')
    (path / "tokenizer.json").write_text('{"vocab": {}}')


def test_same_weights_same_fingerprint_wherever_they_are(tmp_path: Path) -> None:
    _write_model(tmp_path / "a", seed=0)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    os.utime(tmp_path / "b" / "model.safetensors", (0, 0))  # times are not hashed
    assert fingerprint_weights(tmp_path / "a") == fingerprint_weights(tmp_path / "b")


def test_retrained_weights_at_the_same_path_change_it(tmp_path: Path) -> None:
    """Same names, sizes and header; every parameter differs (what training does)."""
    _write_model(tmp_path / "m", seed=0)
    before = fingerprint_weights(tmp_path / "m")
    _write_model(tmp_path / "m", seed=1)
    assert fingerprint_weights(tmp_path / "m") != before


@pytest.mark.parametrize("where", [0, 10, "middle", -1])
def test_sampled_ranges_cover_header_edges_and_body(tmp_path: Path, where: object) -> None:
    _write_model(tmp_path / "m", seed=0)
    f = tmp_path / "m" / "model.safetensors"
    before = fingerprint_weights(tmp_path / "m")
    data = bytearray(f.read_bytes())
    # The header, the first bytes, a sampled block in the middle (the first of the 32
    # samples after the leading 64 KiB), the last byte.
    pos = {0: 0, 10: 10, "middle": 64 << 10, -1: len(data) - 1}[where]  # type: ignore[index]
    data[pos] ^= 0xFF
    f.write_bytes(bytes(data))
    assert fingerprint_weights(tmp_path / "m") != before


def test_a_byte_between_samples_needs_full_mode(tmp_path: Path) -> None:
    """What sampling does not see (a hand edit between samples), full mode does."""
    _write_model(tmp_path / "m", seed=0)
    f = tmp_path / "m" / "model.safetensors"
    sampled, full = (fingerprint_weights(tmp_path / "m", mode) for mode in ("sample", "full"))
    data = bytearray(f.read_bytes())
    data[(64 << 10) + 4096 + 100] ^= 0xFF  # just after the first sampled block
    f.write_bytes(bytes(data))
    assert fingerprint_weights(tmp_path / "m", "sample") == sampled
    assert fingerprint_weights(tmp_path / "m", "full") != full


def test_only_weights_and_their_configs_are_hashed(tmp_path: Path) -> None:
    _write_model(tmp_path / "m", seed=0)
    names = [os.path.basename(p) for p in weight_files(tmp_path / "m")]
    assert names == ["config.json", "model.safetensors"]  # not the tokenizer
    before = fingerprint_weights(tmp_path / "m")
    (tmp_path / "m" / "README.md").write_text("notes")
    assert fingerprint_weights(tmp_path / "m") == before


def test_a_single_weight_file_model(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(100))
    assert weight_files(tmp_path / "model.gguf") == [str(tmp_path / "model.gguf")]
    assert len(fingerprint_weights(tmp_path / "model.gguf")) == 32


def test_no_weights_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FingerprintError, match="no model weights"):
        fingerprint_weights(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FingerprintError, match="no weight files"):
        fingerprint_weights(tmp_path / "empty")
    with pytest.raises(ValueError, match="mode"):
        fingerprint_files([], "fast")  # type: ignore[arg-type]
