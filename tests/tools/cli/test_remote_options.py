"""``python -m kvstore remote check``'s options as a user gives them: ``--hmac-key-file F``
(and the vLLM connector's ``hmac_key_file``) reads at most 4 KiB of the file (a path to
/dev/zero or a disk image was read whole into memory before: a MemoryError for
/dev/zero; a pipe still works), and a remote option the configuration refuses is a
message with exit 2 (a ValueError traceback before)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.tiers.remote.config import HMAC_KEY_FILE_BYTES, read_hmac_key_file
from tests.tools.cli.conftest import Run


def test_an_endless_key_file_is_refused(tmp_path: Path, cli: Callable[..., Run]) -> None:
    (tmp_path / "index").mkdir()  # looks like a store: the key file is read first
    got = cli("remote", "check", str(tmp_path), "--bucket", "b", "--hmac-key-file", "/dev/zero")
    assert got.returncode == 2
    assert f"holds more than {HMAC_KEY_FILE_BYTES} bytes: not a key file" in got.stderr


def test_a_key_file_of_the_limit_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"k" * HMAC_KEY_FILE_BYTES)
    assert read_hmac_key_file(str(key)) == b"k" * HMAC_KEY_FILE_BYTES
    key.write_bytes(b"k" * (HMAC_KEY_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="not a key file"):
        read_hmac_key_file(str(key))


def test_a_key_from_a_pipe_is_read(tmp_path: Path) -> None:
    """What ``--hmac-key-file <(pass show kv)`` hands over: a pipe, read to its end."""
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(w, b"0123456789abcdef" * 2 + b"\n"),
                                              os.close(w)))
    writer.start()
    try:
        assert read_hmac_key_file(f"/proc/self/fd/{r}") == b"0123456789abcdef" * 2
    finally:
        writer.join()
        os.close(r)


def test_a_bad_remote_option_is_a_message_not_a_traceback(tmp_path: Path,
                                                          cli: Callable[..., Run]) -> None:
    (tmp_path / "index").mkdir()
    got = cli("remote", "check", str(tmp_path), "--bucket", "b", "--prefix", "")
    assert got.returncode == 2
    assert got.stderr.startswith("error: RemoteConfig.prefix must be non-empty")
