"""The vLLM connector's options (``kv_connector_extra_config``), checked without vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.codecs import CodecSpec
from kvstore.integrations.vllm_config import CODECS, ConnectorConfig


def test_only_path_is_required(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({"path": tmp_path})
    assert config.path == str(tmp_path)
    options = config.open_options()
    assert options["codec"] is None and options["sync"] is True
    assert options["allow_new_namespace"] is True  # keys are namespaced anyway


def test_options_reach_the_store(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({
        "path": str(tmp_path), "capacity_bytes": 1 << 30, "codec": "fp8_e4m3+zstd",
        "sync": False, "extent_bytes": 4 << 20, "io_engine": "threads"})
    options = config.open_options()
    assert options["codec"] == CodecSpec(fp8="e4m3", zstd=True)
    assert (options["capacity_bytes"], options["sync"], options["extent_bytes"],
            options["engine"]) == (1 << 30, False, 4 << 20, "threads")


def test_tier_and_backpressure_options_reach_the_store(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({
        "path": str(tmp_path), "memory_bytes": 64 << 20, "backlog_bytes": 8 << 20,
        "prefetch": False, "background_saves": False, "async_loads": False})
    options = config.open_options()
    assert (options["memory_bytes"], options["backlog_bytes"]) == (64 << 20, 8 << 20)
    assert config.prefetch is False and config.background_saves is False
    assert config.async_loads is False
    default = ConnectorConfig.from_extra({"path": str(tmp_path)})
    assert (default.memory_bytes, default.prefetch, default.background_saves,
            default.async_loads) == (0, True, True, True)


@pytest.mark.parametrize("extra, message", [
    (None, 'needs "path"'),
    ({}, 'needs "path"'),
    ({"path": ""}, 'needs "path"'),
    ({"path": 3}, 'needs "path"'),
    ({"path": "/x", "capacity": 10}, "unknown kv_connector_extra_config keys ['capacity']"),
    ({"path": "/x", "capacity_bytes": 0}, "capacity_bytes must be a positive int"),
    ({"path": "/x", "extent_bytes": True}, "extent_bytes must be a positive int"),
    ({"path": "/x", "staging_bytes": "1G"}, "staging_bytes must be a positive int"),
    ({"path": "/x", "sync": "yes"}, "sync must be true or false"),
    ({"path": "/x", "codec": "fp8"}, "codec must be one of"),
    ({"path": "/x", "io_engine": "aio"}, "io_engine must be"),
    ({"path": "/x", "weights_fingerprint": "fast"}, "weights_fingerprint must be"),
    ({"path": "/x", "model_id": ""}, "model_id must be a non-empty string"),
    ({"path": "/x", "model_id": 7}, "model_id must be a non-empty string"),
    ({"path": "/x", "memory_bytes": -1}, "memory_bytes must be an int >= 0"),
    ({"path": "/x", "memory_bytes": 1.5}, "memory_bytes must be an int >= 0"),
    ({"path": "/x", "prefetch": 1}, "prefetch must be true or false"),
    ({"path": "/x", "background_saves": "no"}, "background_saves must be true or false"),
    ({"path": "/x", "async_loads": "false"}, "async_loads must be true or false"),
    ({"path": "/x", "backlog_bytes": 0}, "backlog_bytes must be a positive int"),
    ({"path": "/x", "remote": "s3://kv"}, "remote must be an object of remote-tier options"),
    ({"path": "/x", "remote": {"bucket": "kv", "secret_access_key": "s"}},
     "remote.secret_access_key does not belong in kv_connector_extra_config"),
    ({"path": "/x", "remote": {"bucket": "kv", "hmac_key": "k" * 32}},
     "the HMAC key from remote.hmac_key_file"),
    ({"path": "/x", "remote": {"bucket": "kv", "endpiont": "http://h"}},
     "unknown remote options ['endpiont']"),
    ({"path": "/x", "remote": {"endpoint": "http://h"}}, "remote: "),
    ({"path": "/x", "remote": {"bucket": "kv", "concurrency": 0}},
     "RemoteConfig.concurrency must be >= 1"),
    ({"path": "/x", "remote": {"bucket": "kv", "hmac_key_file": "/nonexistent/key"}},
     "cannot read the HMAC key file '/nonexistent/key'"),
])
def test_bad_options_say_what_is_wrong(extra: dict[str, object] | None, message: str) -> None:
    with pytest.raises(ValueError, match="kvstore connector: ") as info:
        ConnectorConfig.from_extra(extra)
    assert message in str(info.value)


def test_the_remote_option_becomes_a_remote_config(tmp_path: Path) -> None:
    key_file = tmp_path / "hmac.key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    config = ConnectorConfig.from_extra({"path": str(tmp_path), "remote": {
        "bucket": "kv", "endpoint": "http://127.0.0.1:8333", "prefix": "fleet",
        "hmac_key_file": str(key_file), "read_deadline_s": 0.5}})
    remote = config.remote
    assert remote is not None
    assert (remote.bucket, remote.endpoint, remote.prefix, remote.read_deadline_s) == (
        "kv", "http://127.0.0.1:8333", "fleet", 0.5)
    assert remote.hmac_key == b"0123456789abcdef0123456789abcdef"  # whitespace stripped
    assert "remote" not in config.open_options()  # attached once the namespace is known
    assert ConnectorConfig.from_extra({"path": str(tmp_path)}).remote is None


def test_every_codec_name_is_a_valid_spec() -> None:
    assert CODECS["raw"] is None
    assert all(isinstance(spec, CodecSpec) for name, spec in CODECS.items() if name != "raw")
