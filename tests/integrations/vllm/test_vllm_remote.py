"""The vLLM connector's ``remote`` option on a real SeaweedFS cluster (the remote
tests' fixture): an engine on node A saves its prefixes, and they reach the bucket; an
engine on node B, with an empty local store, takes them from the bucket (verified,
promoted into B's store) instead of computing them, and its outputs equal A's."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.integrations.vllm.test_vllm import (
    BLOCK,
    SMALL_EXTENT,
    VLLM_PYTHON,
    life,
    prompt_blocks,
    started,
    tiny_model,
    tokens,
)
from tests.tiers.remote.cluster import BUCKET, SeaweedCluster
from tests.tiers.remote.conftest import seaweed

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")
__all__ = ["seaweed", "tiny_model"]  # fixtures shared with test_vllm and tests/tiers/remote


def test_an_empty_node_is_warmed_from_the_cluster(tmp_path: Path, tiny_model: Path,
                                                  seaweed: SeaweedCluster) -> None:
    remote = {"bucket": BUCKET, "endpoint": seaweed.endpoint,
              "prefix": f"vllm-{uuid.uuid4().hex[:12]}"}
    extra = {"extent_bytes": SMALL_EXTENT, "remote": remote}
    # credentials the standard AWS way, from the environment (never in the config)
    a = started(life(tmp_path, "RA", tiny_model, tmp_path / "node-a", env_extra=seaweed.env,
                     extra=extra), "RA")
    ca = a["connector"]
    assert ca["saved_blocks"] == 5 + 3 + 1  # LONG, SP_A, SP_B's own third block
    # the connector_stats of the life wait for the saves; the uploads ran behind them
    # and the store's close drained them (RemoteConfig.close_drain_s)
    # B's scheduler never waits for a lookup (lookup_wait_ms 0): each is answered "ask
    # again later" first (vLLM's None), vLLM schedules on, and takes the hit a step later
    b = started(life(tmp_path, "RB", tiny_model, tmp_path / "node-b", env_extra=seaweed.env,
                     extra={**extra, "lookup_wait_ms": 0}), "RB")
    assert tokens(b) == tokens(a)
    # every full prompt block came from the bucket: B's local store started empty
    assert [o["num_cached_tokens"] for o in b["outputs"]] == \
        [prompt_blocks(o) * BLOCK for o in b["outputs"]] == [5 * BLOCK, 3 * BLOCK, 3 * BLOCK]
    cb = b["connector"]
    assert cb["lookups_deferred"] >= 3, cb  # every prompt's first lookup at least
    warnings = [ln for ln in b["stderr"].splitlines() if "kvstore connector" in ln]
    assert cb["loaded_blocks"] == 11 and cb["load_failed_blocks"] == 0, warnings
    rb = cb["store"]["remote"]
    assert rb["state"] == "ok" and rb["bad_objects"] == 0
    assert rb["hits"] == 5 + 3 + 1  # SP_B's system prompt blocks: SP_A's, promoted
    assert cb["saved_blocks"] == 0  # nothing computed, nothing to save
    # promoted into B's store behind the loads (landed, or still landing)
    assert rb["promoted_blocks"] + rb["promoting_blocks"] == 5 + 3 + 1
    assert rb["promotion_dropped"] == 0


def test_refused_credentials_stop_the_engine_saying_why(tmp_path: Path, tiny_model: Path,
                                                        seaweed: SeaweedCluster) -> None:
    env = {**seaweed.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    result = life(tmp_path, "RX", tiny_model, tmp_path / "node-x", env_extra=env,
                  extra={"extent_bytes": SMALL_EXTENT,
                         "remote": {"bucket": BUCKET, "endpoint": seaweed.endpoint}})
    assert "refused the credentials" in result.get("error", "") + result["stderr"]
