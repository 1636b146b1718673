"""The SGLang backend's extra-config options and rank directories (imports no SGLang)."""

from __future__ import annotations

import os

import pytest

from kvstore.integrations.sglang.config import BackendConfig, rank_dir

BASE = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCache", "interface_v1": 1}


def test_minimal_config_and_sglang_keys_are_accepted() -> None:
    cfg = BackendConfig.from_extra({**BASE, "path": "/nvme/kv", "prefetch_threshold": 256})
    assert cfg.path == "/nvme/kv" and cfg.codec == "raw" and cfg.store.sync
    assert cfg.open_options()["allow_new_namespace"] is True


def test_every_option_parses() -> None:
    cfg = BackendConfig.from_extra({
        **BASE, "path": "/p", "capacity_bytes": 1 << 30, "codec": "fp8_e4m3", "sync": False,
        "extent_bytes": 1 << 26, "staging_bytes": 1 << 26, "io_engine": "threads",
        "memory_bytes": 1 << 20, "backlog_bytes": 1 << 20, "background_saves": True,
        "model": "llama-3-8b@abc", "cache_salt": "tenant-a", "file_mode": "0660",
        "remote": {"bucket": "kv", "endpoint": "http://127.0.0.1:1"}})
    assert cfg.codec_spec is not None and cfg.codec_spec.fp8 == "e4m3"
    assert cfg.store.file_mode == 0o660 and cfg.remote is not None and cfg.remote.bucket == "kv"


@pytest.mark.parametrize(("extra", "message"), [
    ({}, 'needs "path"'),
    ({"path": ""}, 'needs "path"'),
    ({"path": "/p", "capacity": 1}, "unknown extra config keys ['capacity']"),
    ({"path": "/p", "capacity_bytes": 0}, "capacity_bytes must be at least 4096"),
    ({"path": "/p", "capacity_bytes": True}, "capacity_bytes must be an int or null"),
    ({"path": "/p", "staging_bytes": "1G"}, "staging_bytes must be an int"),
    ({"path": "/p", "memory_bytes": -1}, "memory_bytes must be >= 0"),
    ({"path": "/p", "background_saves": 1}, "background_saves must be true or false"),
    ({"path": "/p", "allow_new_namespace": False}, "allow_new_namespace is not an option"),
    ({"path": "/p", "sync": "yes"}, "sync must be true or false"),
    ({"path": "/p", "codec": "fp4"}, "codec must be one of"),
    ({"path": "/p", "io_engine": "aio"}, "io_engine must be"),
    ({"path": "/p", "model": ""}, "model must be a non-empty string"),
    ({"path": "/p", "remote": "s3://kv"}, "remote must be an object"),
    ({"path": "/p", "remote": {"bucket": "kv", "secret_access_key": "x"}},
     "does not belong in the extra config"),
    ({"path": "/p", "remote": {"bucket": "kv", "buckett": 1}}, "unknown remote options"),
    ({"path": "/p", "file_mode": "rw"}, "file_mode"),
])
def test_bad_options_fail_with_a_clear_error(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="kvstore HiCache backend") as e:
        BackendConfig.from_extra({**BASE, **extra})
    assert message in str(e.value)


def test_extra_config_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        BackendConfig.from_extra(["path"])  # type: ignore[arg-type]


def _dir(**over: int | bool) -> str:
    args: dict[str, int | bool] = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
                                   "attn_cp_rank": 0, "attn_cp_size": 1,
                                   "replicated": False, **over}
    return rank_dir("/p", **args)  # type: ignore[arg-type]


def test_rank_directories() -> None:
    assert _dir() == "/p"
    assert _dir(tp_rank=1, tp_size=2) == os.path.join("/p", "tp1of2")
    assert _dir(tp_rank=1, tp_size=2, replicated=True) == "/p"
    assert _dir(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2) == \
        os.path.join("/p", "tp1of2-pp1of2")
    assert _dir(attn_cp_rank=1, attn_cp_size=4) == os.path.join("/p", "cp1of4")
