"""Print the connector's key scope for engine configurations, without starting engines.

Run with the vLLM venv's python (tests/integrations/vllm/test_vllm_scope.py does)::

    python tests/integrations/vllm/scope_probe.py VARIANTS.json RESULT.json

VARIANTS: ``{"NAME": {"model": DIR, "engine": {...EngineArgs...}, "extra": {...}}}``;
RESULT: per name ``{"digest": hex, "scope": {...}}`` or ``{"error": str}``.  vLLM builds
each ``VllmConfig`` exactly as an engine would (``EngineArgs.create_engine_config``),
which also works for settings this CPU cannot run (an FP8 KV cache needs AVX-512).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(variants_path: str, result_path: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from kvstore.integrations.vllm.config import ConnectorConfig
    from kvstore.integrations.vllm.scope import model_scope, scope_digest

    with open(variants_path) as f:
        variants: dict[str, Any] = json.load(f)
    result: dict[str, Any] = {}
    for name, v in variants.items():
        extra = {"path": "/nonexistent/kvstore-scope-probe", **v.get("extra", {})}
        try:
            config = EngineArgs(model=v["model"], dtype="float32", enforce_eager=True,
                                block_size=32, **v.get("engine", {})).create_engine_config()
            scope = model_scope(config, ConnectorConfig.from_extra(extra))
            result[name] = {"digest": scope_digest(scope).hex(), "scope": dict(scope)}
        except Exception as e:
            result[name] = {"error": f"{type(e).__name__}: {e}"}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
