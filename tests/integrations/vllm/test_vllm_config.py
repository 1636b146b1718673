"""The vLLM connector's options (``kv_connector_extra_config``), checked without vLLM."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kvstore.codecs.pipeline import CodecSpec
from kvstore.integrations.common.extra_config import INTEGRATION_SETS, STORE_KEYS
from kvstore.integrations.sglang.config import BackendConfig
from kvstore.integrations.vllm.config import CODECS, ConnectorConfig
from kvstore.io.scheduler import IoSchedule
from kvstore.options import StoreOptions
from kvstore.tiers.remote.config import RemoteConfig


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
    assert (default.store.memory_bytes, default.prefetch, default.background_saves,
            default.async_loads) == (0, True, True, True)


@pytest.mark.parametrize("extra, message", [
    (None, 'needs "path"'),
    ({}, 'needs "path"'),
    ({"path": ""}, 'needs "path"'),
    ({"path": 3}, 'needs "path"'),
    ({"path": "/x", "capacity": 10}, "unknown kv_connector_extra_config keys ['capacity']"),
    ({"path": "/x", "capacity_bytes": 0}, "capacity_bytes must be at least 4096"),
    ({"path": "/x", "extent_bytes": True}, "extent_bytes must be an int, got True"),
    ({"path": "/x", "staging_bytes": "1G"}, "staging_bytes must be an int, got '1G'"),
    ({"path": "/x", "staging_bytes": 0}, "staging_bytes must be > 0"),
    ({"path": "/x", "sync": "yes"}, "sync must be true or false"),
    ({"path": "/x", "codec": "fp8"}, "codec must be one of"),
    ({"path": "/x", "io_engine": "aio"}, "io_engine must be"),
    ({"path": "/x", "weights_fingerprint": "fast"}, "weights_fingerprint must be"),
    ({"path": "/x", "model_id": ""}, "model_id must be a non-empty string"),
    ({"path": "/x", "model_id": 7}, "model_id must be a non-empty string"),
    ({"path": "/x", "memory_bytes": -1}, "memory_bytes must be >= 0"),
    ({"path": "/x", "memory_bytes": 1.5}, "memory_bytes must be an int, got 1.5"),
    ({"path": "/x", "prefetch": 1}, "prefetch must be true or false"),
    ({"path": "/x", "background_saves": "no"}, "background_saves must be true or false"),
    ({"path": "/x", "async_loads": "false"}, "async_loads must be true or false"),
    ({"path": "/x", "backlog_bytes": 0}, "backlog_bytes must be > 0"),
    ({"path": "/x", "max_pending_save_bytes": 0}, "max_pending_save_bytes must be a positive int"),
    ({"path": "/x", "load_staging_bytes": 0}, "load_staging_bytes must be a positive int"),
    ({"path": "/x", "load_staging_bytes": True}, "load_staging_bytes must be a positive int"),
    ({"path": "/x", "load_staging_bytes": 1.5e9}, "load_staging_bytes must be a positive int"),
    ({"path": "/x", "device_loads": "yes"}, 'device_loads must be "auto", true or false'),
    ({"path": "/x", "device_loads": 1}, 'device_loads must be "auto", true or false'),
    ({"path": "/x", "max_save_bytes_per_s": 0}, "max_save_bytes_per_s must be a positive number"),
    ({"path": "/x", "max_save_bytes_per_s": "1G"}, "max_save_bytes_per_s must be a positive"),
    ({"path": "/x", "max_save_bytes_per_s": float("inf")}, "max_save_bytes_per_s must be"),
    ({"path": "/x", "max_save_bytes_per_step": -1}, "max_save_bytes_per_step must be a positive int"),
    ({"path": "/x", "max_save_bytes_per_step": False}, "max_save_bytes_per_step must be"),
    ({"path": "/x", "prefetch_share": 2}, "prefetch_share must be in (0, 1]"),
    ({"path": "/x", "page_lock_staging": "yes"}, "page_lock_staging must be true or false or null"),
    ({"path": "/x", "io_scheduling": {"write_byte": 1}}, "unknown io_scheduling options"),
    ({"path": "/x", "io_scheduling": 1}, "io_scheduling must be true or false or an object"),
    ({"path": "/x", "namespace": "m"}, "namespace is not an option of kv_connector_extra_config: the integration derives it"),
    ({"path": "/x", "engine": "threads"}, "unknown kv_connector_extra_config keys ['engine']"),
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


# A value other than the default for each store option, as an extra config spells it, and
# what the store gets.  A store option missing here is still checked with its default.
_SAMPLES: dict[str, tuple[object, object]] = {
    "engine": ("threads", "threads"), "sync": (False, False),
    "extent_bytes": (4 << 20, 4 << 20), "staging_bytes": (8 << 20, 8 << 20),
    "queue_depth": (8, 8), "index_map_bytes": (1 << 30, 1 << 30), "create": (False, False),
    "capacity_bytes": (1 << 30, 1 << 30), "codec": ("zstd", CodecSpec(zstd=True)),
    "page_lock_staging": (False, False), "file_mode": ("0660", 0o660),
    "strict_permissions": (True, True), "memory_bytes": (1 << 20, 1 << 20),
    "prefetch_share": (0.25, 0.25),
    "io_scheduling": ({"write_bytes": 1 << 20}, IoSchedule(write_bytes=1 << 20)),
    "backlog_bytes": (1 << 20, 1 << 20),
    "remote": ({"bucket": "kv", "endpoint": "http://127.0.0.1:1"},
               RemoteConfig(bucket="kv", endpoint="http://127.0.0.1:1")),
}


@pytest.mark.parametrize("config", [ConnectorConfig, BackendConfig])
@pytest.mark.parametrize("name", [f.name for f in fields(StoreOptions)])
def test_every_store_option_is_an_extra_config_key(config: Any, name: str) -> None:
    """A new store option reaches both engines' configs without being restated there
    (or is one the integrations set, with the reason)."""
    if name in INTEGRATION_SETS:
        assert name not in STORE_KEYS.values()
        return
    key = next(k for k, field in STORE_KEYS.items() if field == name)
    default = getattr(StoreOptions(), name)
    given, expected = _SAMPLES.get(name, (default, default))
    made = config.from_extra({"path": "/p", key: given})
    assert getattr(made.store, name) == expected
    assert getattr(config.from_extra({"path": "/p"}).store, name) == default  # its default
    if name not in ("remote", "namespace"):
        assert made.open_options()[name] == expected


def test_defaults_are_the_stores() -> None:
    for config in (ConnectorConfig, BackendConfig):
        made = config.from_extra({"path": "/p"})
        assert made.store == StoreOptions(allow_new_namespace=True)
        assert made.codec == "raw" and made.remote is None


def test_the_data_movers_options_and_their_defaults(tmp_path: Path) -> None:
    default = ConnectorConfig.from_extra({"path": str(tmp_path)})
    # Loads have their own, smaller page-locked staging (a rank pins 1.5 GiB, not 2).
    assert (default.max_pending_save_bytes, default.load_staging_bytes) == (1 << 30, 512 << 20)
    assert default.device_loads == "auto"
    assert default.max_save_bytes_per_s is None and default.max_save_bytes_per_step is None
    assert default.wants_device_loads(fp8=True) and not default.wants_device_loads(fp8=False)
    made = ConnectorConfig.from_extra({
        "path": str(tmp_path), "load_staging_bytes": 64 << 20, "device_loads": False,
        "max_save_bytes_per_s": 2e9, "max_save_bytes_per_step": 32 << 20})
    assert (made.load_staging_bytes, made.max_save_bytes_per_s,
            made.max_save_bytes_per_step) == (64 << 20, 2e9, 32 << 20)
    assert not made.wants_device_loads(fp8=True)
    forced = ConnectorConfig.from_extra({"path": str(tmp_path), "device_loads": True})
    assert forced.wants_device_loads(fp8=False)
