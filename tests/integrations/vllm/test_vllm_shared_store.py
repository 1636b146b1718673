"""Two vLLM engine processes on one store directory (issue 43).

In order, on one path:

* ``A``: an engine that serves the prompts and stays up (held);
* ``B``: a second engine, started while A is up: its first request hits the prefix A
  computed and saved, its outputs are those of a run without the connector;
* ``C``: a third engine that SIGKILLs itself inside the index commit of its first save
  (its slots written and synced, not indexed), while A is still up;
* ``D``: a fourth engine after C's death, while A is still up: it recovers C (an owner
  that did not close), hits what A saved and serves the same outputs;
* then A ends normally (it went on beside all of it) and fsck finds no damage.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstore.tools import fsck
from tests.integrations.vllm.test_vllm import (  # noqa: F401 - tiny_model: a fixture
    BLOCK,
    LONG,
    SP_A,
    SP_B,
    VLLM_PYTHON,
    _life_command,
    held_life,
    life,
    started,
    tiny_model,
    tokens,
)

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")

PROMPTS = [SP_A, SP_B]


def killed_life(tmp: Path, name: str, model: Path, store: Path) -> int:
    """An engine life that SIGKILLs itself mid-save (of a prompt no other engine served:
    its blocks are new); its return code."""
    cmd, env, _ = _life_command(tmp, name, model, store, False, [], None,
                                prompts=[LONG], kill_at_commit=1)
    return subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode


@pytest.fixture(scope="module")
def lives(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path  # noqa: F811
          ) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-shared")
    store = tmp / "store"
    out: dict[str, Any] = {"ref": life(tmp, "ref", tiny_model, None, prompts=PROMPTS)}
    with held_life(tmp, "A", tiny_model, store, prompts=PROMPTS) as a:
        out["A"] = a
        out["B"] = started(life(tmp, "B", tiny_model, store, prompts=PROMPTS), "B")
        out["C_rc"] = killed_life(tmp, "C", tiny_model, store)
        out["D"] = started(life(tmp, "D", tiny_model, store, prompts=PROMPTS), "D")
    out["report"] = fsck.check(str(store))
    return out


def test_a_second_engine_hits_the_prefix_the_first_one_computed(lives: dict[str, Any]
                                                                ) -> None:
    b, ref = lives["B"], lives["ref"]
    assert tokens(b) == tokens(ref)
    # every full prompt block of B's first request came from A's saves (vLLM's own
    # prefix cache starts empty in B: it is another process)
    first = b["outputs"][0]
    assert first["num_cached_tokens"] == (len(first["prompt_token_ids"]) - 1) // BLOCK * BLOCK
    assert first["num_cached_tokens"] > 0
    assert b["connector"]["load_failed_blocks"] == 0


def test_an_engine_killed_mid_save_leaves_the_others_going(lives: dict[str, Any]) -> None:
    assert lives["C_rc"] == -signal.SIGKILL, "C did not die in its save"
    d, ref = lives["D"], lives["ref"]
    assert tokens(d) == tokens(ref)
    assert d["outputs"][0]["num_cached_tokens"] > 0
    assert d["connector"]["load_failed_blocks"] == 0
    report = lives["report"]
    assert not report.damage, [f.detail for f in report.damage]
    # C's owner was recovered by the next open (D's), not left for fsck
    assert "dead-owner" not in {f.kind for f in report.findings}


def test_the_first_engine_served_beside_them(lives: dict[str, Any]) -> None:
    assert tokens(lives["A"]) == tokens(lives["ref"])
