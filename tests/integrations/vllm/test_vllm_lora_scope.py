"""LoRA adapters in the connector's key scope (vLLM hashes only their name and path)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kvstore.integrations.vllm.scope import LoraScopes, scoped_hash

HASHES = [bytes([i]) * 32 for i in range(3)]


def _adapter(path: Path, fill: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(bytes([fill]) * 4096)


def test_an_adapter_retrained_at_the_same_path_gets_other_keys(tmp_path: Path) -> None:
    _adapter(tmp_path / "lora", 1)
    # vLLM's LoRARequest carries these three; a plain record of them stands in for it.
    request = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "lora"))
    before = LoraScopes("sample").fingerprint(request)
    _adapter(tmp_path / "lora", 2)  # retrained, same name and path
    after = LoraScopes("sample").fingerprint(request)  # the next engine life
    assert before is not None and after is not None and before != after
    old = [scoped_hash(h, before) for h in HASHES]
    new = [scoped_hash(h, after) for h in HASHES]
    assert not set(old) & set(new)
    assert all(len(h) == 32 for h in old)  # the store sees hashes of vLLM's size


def test_one_fingerprint_per_adapter_per_engine_life(tmp_path: Path) -> None:
    """vLLM loads an adapter once per life: what it loaded is what the keys describe."""
    _adapter(tmp_path / "lora", 1)
    scopes = LoraScopes("sample")
    request = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "lora"))
    first = scopes.fingerprint(request)
    _adapter(tmp_path / "lora", 2)
    assert scopes.fingerprint(request) == first


def test_an_unreadable_adapter_is_not_cached(tmp_path: Path) -> None:
    request = SimpleNamespace(lora_name="a", lora_int_id=3, lora_path=str(tmp_path / "gone"))
    assert LoraScopes("sample").fingerprint(request) is None
