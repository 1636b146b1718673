"""What a hybrid model's hit needs per KV cache group (kvstore.integrations.vllm.groups):
the plan read from vLLM's KV cache config, the longest hit every group can serve, the
parts a load takes, and the group structure in the key scope."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.integrations.vllm.groups import GroupPlan, Part, group_hash, longest_hit


# Stand-ins for vLLM's spec classes: the plan reads them by class name and attribute
# (vLLM is not installed in the test venv).
@dataclass
class FullAttentionSpec:
    block_size: int = 32
    num_kv_heads: int = 2
    head_size: int = 32
    dtype: str = "float32"


@dataclass
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 64


@dataclass
class MambaSpec:
    block_size: int = 32
    shapes: tuple[tuple[int, ...], ...] = ((3, 288), (8, 32, 16))
    dtypes: tuple[str, ...] = ("float32", "float32")
    mamba_type: str = "mamba2"
    page_size_padded: int = 32768


@dataclass
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    attention_chunk_size: int = 64


@dataclass
class _Groups:
    specs: list[Any]
    names: list[list[str]] = field(default_factory=list)

    def config(self) -> Any:
        names = self.names or [[f"layer.{i}"] for i in range(len(self.specs))]
        return SimpleNamespace(kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=s, layer_names=n) for s, n in zip(self.specs, names)])


def plan(*specs: Any, block_size: int = 32) -> GroupPlan:
    return GroupPlan.of(_Groups(list(specs)).config(), block_size)


HASHES = [bytes([i]) * 32 for i in range(12)]


def stored(names: set[tuple[int, int]]) -> Any:
    """``present`` for longest_hit: which (group, position) parts are stored."""
    by_hash = {group_hash(HASHES[p], g): True for g, p in names}
    return lambda hashes: [by_hash.get(h, False) for h in hashes]


def test_plan_reads_kinds_windows_and_layers() -> None:
    p = GroupPlan.of(_Groups([SlidingWindowSpec(sliding_window=64), FullAttentionSpec()],
                             [["l0", "l2"], ["l1", "l3"]]).config(), 32)
    assert [(g.kind, g.window_blocks, g.layers) for g in p.groups] == [
        ("sliding", 2, ("l0", "l2")), ("full", 0, ("l1", "l3"))]
    assert p.layer_group == {"l0": (0, 0), "l2": (0, 1), "l1": (1, 0), "l3": (1, 1)}
    assert p.hybrid and not p.has_state
    # vLLM's rule: cdiv(window - 1, block size) blocks before the hit's end
    assert plan(SlidingWindowSpec(sliding_window=65), FullAttentionSpec()).groups[0] \
        .window_blocks == 2
    assert plan(SlidingWindowSpec(sliding_window=96), FullAttentionSpec()).groups[0] \
        .window_blocks == 3


def test_unsupported_groups_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        plan(ChunkedLocalAttentionSpec(), FullAttentionSpec())
    with pytest.raises(ValueError, match="block size 64"):
        plan(MambaSpec(block_size=64), FullAttentionSpec())


def test_the_scope_covers_window_state_shapes_dtypes_and_layers() -> None:
    base = plan(SlidingWindowSpec(), FullAttentionSpec(), MambaSpec()).describe()
    assert base == plan(SlidingWindowSpec(), FullAttentionSpec(), MambaSpec()).describe()
    others = [
        plan(SlidingWindowSpec(sliding_window=96), FullAttentionSpec(), MambaSpec()),
        plan(SlidingWindowSpec(), FullAttentionSpec(),
             MambaSpec(dtypes=("float32", "float16"))),
        plan(SlidingWindowSpec(), FullAttentionSpec(), MambaSpec(shapes=((3, 160), (4, 32, 16)))),
        plan(SlidingWindowSpec(), FullAttentionSpec(dtype="bfloat16"), MambaSpec()),
        plan(FullAttentionSpec(), SlidingWindowSpec(), MambaSpec()),  # another order
        GroupPlan.of(_Groups([SlidingWindowSpec(), FullAttentionSpec(), MambaSpec()],
                             [["a"], ["b"], ["x"]]).config(), 32),
    ]
    assert len({base, *(o.describe() for o in others)}) == len(others) + 1


def test_sliding_window_hit_needs_only_the_window_before_its_end() -> None:
    p = plan(SlidingWindowSpec(sliding_window=64), FullAttentionSpec())  # window: 2 blocks
    full = {(1, i) for i in range(6)}
    # Window blocks 0..1 gone (evicted): a hit at 6 needs only 4 and 5.
    assert longest_hit(p, HASHES[:6], stored(full | {(0, i) for i in range(2, 6)})) == 6
    # Block 5 of the window gone: 5 needs 3 and 4 (stored), so the hit is 5.
    assert longest_hit(p, HASHES[:6], stored(full | {(0, i) for i in range(5)})) == 5
    # Blocks 3 and 5 gone: hits at 6, 5 and 4 need one of them; 3 needs 1 and 2.
    assert longest_hit(p, HASHES[:6], stored(full | {(0, i) for i in (0, 1, 2, 4)})) == 3
    # Full attention bounds it: block 2 gone -> at most 2.
    assert longest_hit(p, HASHES[:6], stored({(1, 0), (1, 1), (1, 3)} |
                                             {(0, i) for i in range(6)})) == 2


def test_state_hit_needs_the_state_at_its_end() -> None:
    p = plan(MambaSpec(), FullAttentionSpec())
    full = {(1, i) for i in range(8)}
    assert longest_hit(p, HASHES[:8], stored(full | {(0, 3), (0, 5)})) == 6
    assert longest_hit(p, HASHES[:5], stored(full | {(0, 3), (0, 5)})) == 4
    assert longest_hit(p, HASHES[:8], stored(full)) == 0
    assert longest_hit(p, HASHES[:8], stored({(1, 0), (1, 1), (0, 5)})) == 0
    assert longest_hit(p, [], stored(full)) == 0


@given(st.sets(st.tuples(st.integers(0, 2), st.integers(0, 9))), st.integers(0, 10),
       st.integers(33, 128))
def test_the_hit_is_the_longest_every_group_can_serve(parts: set[tuple[int, int]], n: int,
                                                     window: int) -> None:
    """Against the rules written out: full attention on [0, N), the window's
    cdiv(w - 1, bs) blocks before N, the state at N - 1."""
    p = plan(SlidingWindowSpec(sliding_window=window), FullAttentionSpec(), MambaSpec())
    w = -(-(window - 1) // 32)

    def serves(k: int) -> bool:
        return all((1, i) in parts for i in range(k)) and \
            all((0, i) in parts for i in range(max(0, k - w), k)) and (2, k - 1) in parts

    want = max((k for k in range(1, n + 1) if serves(k)), default=0)
    assert longest_hit(p, HASHES[:n], stored(parts)) == want


def test_load_parts_are_every_groups_allocated_blocks_of_the_hit() -> None:
    p = plan(SlidingWindowSpec(sliding_window=64), FullAttentionSpec(), MambaSpec())
    # vLLM's tables after allocating a hit of 3 blocks after 1 local one: the sliding
    # window's blocks outside the window and every state but the last are null (0).
    ids = ([0, 0, 10, 5], [11, 17, 18, 19], [0, 0, 0, 7])
    parts = p.load_parts(ids, HASHES, first=1, n=3)
    assert parts == [Part(0, 2, 10, group_hash(HASHES[2], 0)),
                     Part(0, 3, 5, group_hash(HASHES[3], 0)),
                     Part(1, 1, 17, group_hash(HASHES[1], 1)),
                     Part(1, 2, 18, group_hash(HASHES[2], 1)),
                     Part(1, 3, 19, group_hash(HASHES[3], 1)),
                     Part(2, 3, 7, group_hash(HASHES[3], 2))]


def test_group_hashes_differ_per_group() -> None:
    assert group_hash(HASHES[0], 0) != group_hash(HASHES[0], 1)
    assert group_hash(HASHES[0], 1).startswith(HASHES[0])
