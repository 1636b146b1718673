"""The vLLM connector and the SGLang backend turn on the store's background scrub with a
rate (``scrub_bytes_per_s`` in their extra config), checked without either engine: the
options they open their store with scrub it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore
from kvstore.integrations.sglang.config import BackendConfig
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.testing import scrub_passes

KEYS = [bytes([0x31 + i]) * 16 for i in range(6)]


@pytest.mark.parametrize("config", [ConnectorConfig, BackendConfig])
def test_an_engine_config_turns_on_the_background_scrub(config: Any, tmp_path: Path) -> None:
    assert config.from_extra({"path": str(tmp_path)}).open_options()["scrub_bytes_per_s"] == 0
    made = config.from_extra({"path": str(tmp_path), "scrub_bytes_per_s": 32 << 20})
    options = {**made.open_options(), "extent_bytes": 4 << 20, "staging_bytes": 8 << 20}
    assert options["scrub_bytes_per_s"] == 32 << 20
    with kvstore.open_blocking(tmp_path, **{**options, "scrub_bytes_per_s": 0}) as store:
        store.put_many(KEYS, [torch.full((1024,), float(i)) for i in range(6)])
    with kvstore.open_blocking(tmp_path, **options) as store:  # as the integration opens it
        store.call(lambda: scrub_passes(store.store, 1))
        stats = store.stats()
        assert (stats.scrubbed_blocks, stats.scrub_failed_blocks) == (6, 0)
        assert stats.scrub_last_complete is not None


@pytest.mark.parametrize("config", [ConnectorConfig, BackendConfig])
@pytest.mark.parametrize("bad", [-1, 1.5, "64M", True])
def test_a_bad_scrub_rate_is_refused_naming_the_key(config: Any, bad: object) -> None:
    with pytest.raises(ValueError, match="scrub_bytes_per_s"):
        config.from_extra({"path": "/p", "scrub_bytes_per_s": bad})
