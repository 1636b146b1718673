"""One rule for the stores of an engine's ranks (kvstore.integrations.common.ranks),
whichever engine: the engine's capacity and memory tier split between its ranks."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstore.integrations.common.ranks import FREE_SHARE, rank_options
from kvstore.integrations.sglang.config import BackendConfig, rank_store
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.ranks import rank_config
from kvstore.options import StoreOptions


def sglang_ranks(extra: dict[str, object], tp_size: int, *, mla: bool = False
                 ) -> list[tuple[str, StoreOptions]]:
    config = BackendConfig.from_extra(extra)
    return [rank_store(config, SimpleNamespace(
        tp_rank=r, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        dp_rank=0), replicated=mla) for r in range(tp_size)]


def test_sglang_tp2_shares_the_free_space_as_vllm_does(tmp_path: Path) -> None:
    """Without capacity_bytes, SGLang's TP ranks together claim no more of the free
    space than vLLM's ranks do (each used to claim 90% of it)."""
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    sglang = [o.capacity_bytes for _, o in sglang_ranks({"path": str(tmp_path / "g")}, 2)]
    vllm_config = ConnectorConfig.from_extra({"path": str(tmp_path / "v")})
    vllm = [rank_config(vllm_config, r, 2).store.capacity_bytes for r in range(2)]
    assert None not in sglang and None not in vllm
    # (the test's own files may change free space a little between the calls)
    slack = 0.01 * free
    assert sum(sglang) <= sum(vllm) + slack  # type: ignore[arg-type]
    assert abs(sum(sglang) - FREE_SHARE * free) < slack  # type: ignore[arg-type]


def test_sglang_splits_a_given_capacity_and_memory_as_vllm_does(tmp_path: Path) -> None:
    extra = {"capacity_bytes": 1 << 30, "memory_bytes": 64 << 20}
    sglang = sglang_ranks({"path": str(tmp_path / "g"), **extra}, 2)
    assert [p for p, _ in sglang] == [str(tmp_path / "g" / "tp0of2"),
                                      str(tmp_path / "g" / "tp1of2")]
    vllm_config = ConnectorConfig.from_extra({"path": str(tmp_path / "v"), **extra})
    vllm = [rank_config(vllm_config, r, 2).store for r in range(2)]
    assert {(o.capacity_bytes, o.memory_bytes) for _, o in sglang} == \
        {(o.capacity_bytes, o.memory_bytes) for o in vllm} == {(1 << 29, 32 << 20)}


def test_one_rank_keeps_the_options(tmp_path: Path) -> None:
    (path, options), = sglang_ranks({"path": str(tmp_path), "capacity_bytes": 1 << 30}, 1)
    assert path == str(tmp_path) and options.capacity_bytes == 1 << 30
    # MLA: every TP rank holds the same KV in one directory, nothing is split
    options = StoreOptions(capacity_bytes=1 << 30)
    assert rank_options(options, str(tmp_path), 1, "who") is options


def test_a_split_below_a_page_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^who: capacity_bytes=8192 split between 4 ranks"):
        rank_options(StoreOptions(capacity_bytes=8192), str(tmp_path / "r"), 4, "who")
