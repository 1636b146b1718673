"""The vLLM connector's key scope: everything about an engine that changes its KV bytes.

vLLM's block hashes cover the tokens, the LoRA adapter's name and path, multimodal
inputs and the cache salt -- not the weights, nor how the engine turns tokens into KV.
Two engines may share stored blocks only when all of that is equal, so the connector's
:class:`~kvstore.Namespace` (the seed of every key) holds, besides the KV tensor layout
and the layer names the worker adds:

``weights``          a fingerprint of the weight files the engine loaded
                     (:mod:`kvstore.integrations.common.fingerprint`), or the operator's
                     ``model_id`` for them;
``hf_config``        a digest of the model config as vLLM applied it: ``hf_overrides``,
                     RoPE parameters (``rope_theta``, scaling), quantisation config,
                     sliding windows, every architecture parameter;
``hf_overrides``     the overrides themselves (also where they are a function);
``model_dtype``, ``kv_cache_dtype`` (fp8_e4m3 and fp8_e5m2 are both uint8 tensors),
``kv_cache_dtype_skip_layers``, ``quantization``, ``model_impl``, ``load_format``,
``revision`` and vLLM's ``prefix_caching_hash_algo``;
``codec``            ``lossless`` for raw and zstd blocks (they read back bit-exact, so
                     they may be shared), else the lossy FP8 variant: an engine that
                     asked for exact KV never loads FP8-rounded KV.

KV scales: scales stored in the checkpoint are covered by the weights fingerprint;
scales computed from the first batch (``calculate_kv_scales``) differ between engine
lives, so an FP8 KV cache with computed scales is refused at start.

LoRA adapters: vLLM hashes the adapter's name and path, not its weights, so for a
request with an adapter the connector folds a fingerprint of the adapter's files into
every block hash (:func:`scoped_hash`); an adapter retrained at the same path is a
clean miss.  The fingerprint is taken once per adapter per engine life, as vLLM loads
an adapter once.

Imports no vLLM at module level: the configuration objects are read by attribute.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from kvstore.integrations.common.fingerprint import FingerprintError, fingerprint_weights
from kvstore.integrations.vllm.config import CODECS, ConnectorConfig
from kvstore.integrations.vllm.lookup_socket import SCOPE_BYTES

__all__ = ["FingerprintError", "LoraScopes", "model_scope", "scope_digest", "scoped_hash"]

Scope = tuple[tuple[str, str], ...]

# Keys of a config's to_dict() that name where it came from, not what it computes.
_VOLATILE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
             "_attn_implementation_autoset", "name_or_path")

def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _fingerprint(path: str, mode: str) -> str:
    # Taken afresh by every connector (milliseconds): an engine started later in the
    # same process may run other weights written to the same path.
    return fingerprint_weights(path, mode)  # type: ignore[arg-type]


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    return value


def _hf_config_digest(hf_config: Any) -> str:
    to_dict = getattr(hf_config, "to_dict", None)
    doc = to_dict() if callable(to_dict) else vars(hf_config)
    return _digest(_canonical(_strip(doc)))


def _weights_path(model_config: Any, load_config: Any) -> str:
    """The local directory (or file) vLLM loaded the weights from."""
    if getattr(model_config, "model_weights", ""):
        raise FingerprintError(f"the weights are streamed from {model_config.model_weights!r}")
    model = str(model_config.model)
    if os.path.exists(model):
        return model
    try:  # a hub id: the snapshot vLLM downloaded (a hub branch may have moved since)
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=model_config.revision,
                                     cache_dir=getattr(load_config, "download_dir", None),
                                     local_files_only=True))
    except Exception as e:  # not installed, not in the cache, ...
        raise FingerprintError(f"no local copy of {model!r} found ({type(e).__name__}: "
                               f"{e})") from e


def _weights(vllm_config: Any, config: ConnectorConfig) -> str:
    if config.model_id is not None:
        return "id:" + config.model_id
    try:
        path = _weights_path(vllm_config.model_config, vllm_config.load_config)
        return f"{config.weights_fingerprint}:" + _fingerprint(path,
                                                                config.weights_fingerprint)
    except FingerprintError as e:
        raise ValueError(
            f"kvstore connector: cannot fingerprint the model's weights: {e}. Stored KV "
            "is only valid for the exact weights that computed it; set "
            "kv_connector_extra_config['model_id'] to a name that changes whenever the "
            "weights do (a build id or commit).") from e


def _codec_scope(codec: str) -> str:
    spec = CODECS[codec]
    return "lossless" if spec is None or spec.fp8 is None else f"fp8_{spec.fp8}"


def model_scope(vllm_config: Any, config: ConnectorConfig) -> Scope:
    """The scope items the scheduler and the worker both derive from the engine's config.

    Raises ``ValueError`` (the engine then refuses to start) when no safe scope exists.
    """
    model, cache = vllm_config.model_config, vllm_config.cache_config
    cache_dtype = str(getattr(cache, "cache_dtype", "auto"))
    if cache_dtype.startswith("fp8") and getattr(cache, "calculate_kv_scales", False):
        raise ValueError(
            "kvstore connector: an FP8 KV cache with calculate_kv_scales=True takes its "
            "scales from each engine life's first batch, so stored KV would be read back "
            "with other scales; use scales from the checkpoint or another kv_cache_dtype")
    overrides = getattr(model, "hf_overrides", None)
    if callable(overrides):
        overrides = f"function {getattr(overrides, '__module__', '?')}." \
                    f"{getattr(overrides, '__qualname__', repr(overrides))}"
    items = {
        "weights": _weights(vllm_config, config),
        "hf_config": _hf_config_digest(model.hf_config),
        "hf_overrides": _canonical(overrides or {}),
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": cache_dtype,
        "kv_cache_dtype_skip_layers": ",".join(
            map(str, getattr(cache, "kv_cache_dtype_skip_layers", None) or ())),
        "quantization": str(model.quantization),
        "model_impl": str(getattr(model.model_impl, "value", model.model_impl)),
        "load_format": str(getattr(vllm_config.load_config, "load_format", "auto")),
        "revision": str(model.revision),
        "vllm_hash": str(cache.prefix_caching_hash_algo),
        "codec": _codec_scope(config.codec),
    }
    return tuple(sorted(items.items()))


def scope_digest(scope: Scope) -> bytes:
    """What the scheduler and its worker compare at the lookup handshake."""
    return hashlib.blake2b(_canonical(list(scope)).encode(), digest_size=SCOPE_BYTES).digest()


def scoped_hash(block_hash: bytes, adapter: str) -> bytes:
    """vLLM's block hash bound to an adapter fingerprint (same length, still chained:
    every block of the request is bound the same way)."""
    size = min(max(len(block_hash), 16), 64)
    return hashlib.blake2b(b"kvstore-lora\0" + adapter.encode() + b"\0" + block_hash,
                           digest_size=size).digest()


class LoraScopes:
    """Adapter fingerprints, one per adapter per engine life (vLLM loads it once)."""

    def __init__(self, mode: str) -> None:
        self._mode = mode
        self._known: dict[tuple[int, str], str | None] = {}

    def fingerprint(self, lora_request: Any) -> str | None:
        """The adapter's fingerprint, or None if its files cannot be read (the
        request is then not cached at all: never a load under a guessed scope)."""
        path = str(getattr(lora_request, "lora_path", "") or "")
        key = (int(getattr(lora_request, "lora_int_id", 0)), path)
        if key not in self._known:
            try:
                self._known[key] = _fingerprint(path, self._mode)
            except FingerprintError:
                self._known[key] = None
        return self._known[key]
