"""End to end: a real vLLM engine (CPU) with the kvstore connector, across restarts.

Every engine life is a fresh process of the vLLM venv's python running
``engine_life.py`` (vLLM is not installed in the test venv).  The scenario, in order,
sharing one store:

* ``ref``   no connector: the reference greedy outputs.
* ``A``     fresh store: ``LONG`` is computed and saved; ``SP_A`` saves the shared
            system-prompt blocks, which ``SP_B`` then loads from kvstore (vLLM's own
            prefix cache is reset before every prompt).
* ``B``     restart: every full prompt block comes from kvstore.
* tamper    flip a payload byte of ``LONG``'s block 1; delete ``LONG``'s block 4 and
            ``SP_A``'s block 2.
* ``C``     restart: ``LONG``'s hit ends before block 4; block 1 fails its checksum, the
            connector loads only block 0 and reports the rest failed, vLLM recomputes.
            Loads are asynchronous: the failure is known before ``LONG`` runs, so no
            forward reads an unloaded block.  ``SP_A``'s hit ends before block 2.
            Outputs equal the reference.
* ``D``     restart: the recomputed blocks were saved again (and right: the outputs
            still equal the reference): full hits again.
* ``E``     restart with vLLM's multiprocess engine (its default; on CPU the worker is a
            process of its own): the scheduler asks the worker over the lookup socket;
            same hits, same outputs.
* ``bad``   a store path that is a regular file: the engine refuses to start, saying so.
* ``F``     ``LONG``'s block 1 corrupted again; ``LONG`` is submitted, stepped once (its
            load fails) and aborted before it recomputes, then sent again without a
            prefix-cache reset: a block that failed to load must not be a local cache hit.
* ``G``     restart: the outputs still equal the reference (nothing wrong was saved).
* ``X``     the store served by a multiprocess engine that stays up while ``Y1`` and
            ``Y2`` run, each in a mount namespace of its own where the same store path is
            another (empty) directory, as containers sharing the host's network namespace
            see it: ``Y1`` must find no hits (its lookups must not reach ``X``'s worker);
            ``Y2``, configured with ``X``'s engine id, must refuse to start.

Twelve engine lives of ~30-50 s each on two cores (about 8-10 minutes in all).  The vLLM venv comes from
``tests/integrations/install_vllm_env.sh``; its python is ``$KVSTORE_VLLM_PYTHON``
(default ``.venv-vllm/bin/python`` in the repository).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import anyio
import pytest

import kvstore
from kvstore.extents import extent_path
from kvstore.format import SLOT_HEADER_BYTES

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VLLM_PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
BLOCK = 32  # engine_life.BLOCK_SIZE
MAX_TOKENS = 16
SMALL_EXTENT = 4 << 20
READY = "KVSTORE-ENGINE-LIFE-READY"  # engine_life.py's line when a held life is up

SYSTEM = ("you are a helpful assistant . answer the question of the user in one short "
          "sentence . a store keeps blocks of attention keys and values on disk so that an "
          "engine restart does not throw every computed prefix away . ") * 2  # 82 tokens
SP_A = SYSTEM + "what is the capital of france ? paris is the capital of france . the quick brown"
SP_B = SYSTEM + "how many legs has a spider ? a spider has eight legs . the lazy dog jumps over"
LONG = ("tell me a story about a cat and a mouse who live in an old house by the river , and "
        "the winter when the river froze . ") * 6
PROMPTS = [LONG, SP_A, SP_B]

_MISSING = (f"no vLLM venv at {VLLM_PYTHON}: run tests/integrations/install_vllm_env.sh "
            "or set KVSTORE_VLLM_PYTHON")
if not VLLM_PYTHON.exists() and os.environ.get("KVSTORE_REQUIRE_VLLM"):
    raise RuntimeError(f"KVSTORE_REQUIRE_VLLM is set but there is {_MISSING}")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=_MISSING)


def _life_command(tmp: Path, name: str, model: Path, store: Path | None,
                  multiprocessing: bool, prefix: list[str], **spec_extra: Any
                  ) -> tuple[list[str], dict[str, str], Path]:
    spec = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "store": None if store is None else str(store),
            "extra": {"extent_bytes": SMALL_EXTENT}, **spec_extra}
    spec_path, result_path = tmp / f"{name}.spec.json", tmp / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
               PYTHONPATH=str(REPO))
    return ([*prefix, str(VLLM_PYTHON), str(HERE / "engine_life.py"), str(spec_path),
             str(result_path)], env, result_path)


def life(tmp: Path, name: str, model: Path, store: Path | None,
         multiprocessing: bool = False, prefix: Sequence[str] = (),
         **spec_extra: Any) -> dict[str, Any]:
    """Run one engine life in a new process (after ``prefix``, e.g. ``unshare``) and
    return its JSON result, with the tail of its stderr as ``stderr``."""
    cmd, env, result_path = _life_command(tmp, name, model, store, multiprocessing,
                                          list(prefix), **spec_extra)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and result_path.exists(), \
        f"engine life {name} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["stderr"] = proc.stderr[-20000:]
    return result


@contextmanager
def held_life(tmp: Path, name: str, model: Path, store: Path, **spec_extra: Any
              ) -> Iterator[dict[str, Any]]:
    """An engine life that stays up (multiprocess) until the block ends."""
    cmd, env, result_path = _life_command(tmp, name, model, store, True, [], hold=True,
                                          **spec_extra)
    ready = threading.Event()

    def drain(stream: IO[str]) -> None:
        # vLLM logs to stdout too: watch for the marker and keep reading to the end, so
        # the engine never blocks on a full pipe while it is held.
        for line in stream:
            if line.strip() == READY:
                ready.set()
        ready.set()  # ended (early, if the marker never came)

    with subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        reader = threading.Thread(target=drain, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            assert ready.wait(900) and proc.poll() is None, \
                f"held engine life {name} ended early (rc {proc.poll()})"
            yield json.loads(result_path.read_text())
        finally:
            proc.stdin.close()
            proc.wait(timeout=300)
            reader.join(timeout=60)


def in_own_mount_namespace(store: Path, other_dir: Path) -> list[str]:
    """A command prefix running the rest with ``other_dir`` mounted over ``store``:
    the same path, another directory (as in a container)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind "{other_dir}" "{store}" && exec "$@"', "sh"]


async def _tamper(store_path: Path, corrupt: bytes, delete: list[bytes]) -> None:
    async with kvstore.open(store_path) as store:
        (entry,) = store.index.get_entries([corrupt])
        assert entry is not None, "the block to corrupt is not stored"
        assert await store.delete_many(delete) == len(delete)
    with open(extent_path(str(store_path), entry.extent), "r+b") as f:
        f.seek(entry.offset + SLOT_HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


async def _present(store_path: Path, keys: list[bytes]) -> list[bool]:
    async with kvstore.open(store_path) as store:
        return await store.contains_many(keys)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "tiny-llama"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_llama.py"), str(model)], env=env,
                   check=True, capture_output=True, timeout=300)
    store = tmp / "store"
    lives: dict[str, Any] = {"store": store}
    lives["ref"] = life(tmp, "ref", model, None)
    lives["A"] = life(tmp, "A", model, store)
    lives["B"] = life(tmp, "B", model, store)
    keys = [[bytes.fromhex(k) for k in out["keys"]] for out in lives["B"]["outputs"]]
    lives["keys"] = keys
    lives["present_after_B"] = anyio.run(_present, store, [k for ks in keys for k in ks])
    anyio.run(_tamper, store, keys[0][1], [keys[0][4], keys[1][2]])
    lives["C"] = life(tmp, "C", model, store)
    lives["D"] = life(tmp, "D", model, store)
    lives["E"] = life(tmp, "E", model, store, multiprocessing=True)
    bad = tmp / "not-a-directory"
    bad.write_text("a file where the store directory should be")
    lives["bad"] = life(tmp, "bad", model, bad)
    # A failed load, then an abort before the recompute, then the same prompt again.
    anyio.run(_tamper, store, keys[0][1], [])
    lives["F"] = life(tmp, "F", model, store, abort_first={"0": 1})
    lives["G"] = life(tmp, "G", model, store)
    # Another engine whose store path is another directory (its own mount namespace).
    with held_life(tmp, "X", model, store, engine_id="kvstore-test-engine-x") as x:
        lives["X"] = x
        for name, extra in (("Y1", {}), ("Y2", {"engine_id": "kvstore-test-engine-x"})):
            other = tmp / f"store-{name}"
            other.mkdir()
            lives[name] = life(tmp, name, model, store, multiprocessing=True,
                               prefix=in_own_mount_namespace(store, other), **extra)
    return lives


def prompt_blocks(out: dict[str, Any]) -> int:
    """Full blocks vLLM may take from a cache: one prompt token is always computed."""
    return (len(out["prompt_token_ids"]) - 1) // BLOCK


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [out["tokens"] for out in result["outputs"]]


def test_prompts_span_several_blocks(scenario: dict[str, Any]) -> None:
    lengths = [len(out["prompt_token_ids"]) for out in scenario["ref"]["outputs"]]
    assert [n // BLOCK for n in lengths] == [5, 3, 3], lengths  # LONG, SP_A, SP_B
    # the system prompt fills two blocks; the third differs between SP_A and SP_B
    a, b = (scenario["ref"]["outputs"][i]["prompt_token_ids"] for i in (1, 2))
    assert a[:2 * BLOCK] == b[:2 * BLOCK] and a[2 * BLOCK:3 * BLOCK] != b[2 * BLOCK:3 * BLOCK]


def test_first_life_computes_saves_and_matches_reference(scenario: dict[str, Any]) -> None:
    a = scenario["A"]
    assert tokens(a) == tokens(scenario["ref"])
    long, sp_a, sp_b = a["outputs"]
    assert long["num_cached_tokens"] == 0 and sp_a["num_cached_tokens"] == 0
    c = a["connector"]
    assert c["load_failed_blocks"] == 0 and c["save_failed_blocks"] == 0
    # LONG 5 + SP_A 3 + SP_B's own third block (its two system-prompt blocks were
    # loaded, not computed); the outputs fill no further block.
    assert c["saved_blocks"] == 5 + 3 + 1
    assert c["store"]["blocks"] == c["saved_blocks"]
    # The keys derived independently from vLLM's hash function name stored blocks.
    assert all(scenario["present_after_B"][:prompt_blocks(long)])


def test_shared_system_prompt_blocks_come_from_kvstore(scenario: dict[str, Any]) -> None:
    """SP_B, in the same life as SP_A and with vLLM's own prefix cache reset, takes the
    two system-prompt blocks SP_A stored; its output equals the run without connector."""
    a = scenario["A"]
    sp_b = a["outputs"][2]
    assert sp_b["num_cached_tokens"] == 2 * BLOCK
    assert a["connector"]["loaded_blocks"] == 2
    assert a["metrics"]["vllm:prompt_tokens_by_source[external_kv_transfer]"] == 2 * BLOCK
    assert a["metrics"]["vllm:prompt_tokens_cached_by_source[disk]"] == 2 * BLOCK
    assert tokens(a)[2] == tokens(scenario["ref"])[2]


def test_restart_serves_prompts_from_kvstore(scenario: dict[str, Any]) -> None:
    a, b = scenario["A"], scenario["B"]
    assert tokens(b) == tokens(scenario["ref"]) == tokens(a)
    want = [prompt_blocks(out) * BLOCK for out in b["outputs"]]
    assert [out["num_cached_tokens"] for out in b["outputs"]] == want
    total = sum(len(out["prompt_token_ids"]) for out in b["outputs"])
    by_source = {k: v for k, v in b["metrics"].items() if "prompt_tokens_by_source" in k}
    assert by_source == {
        "vllm:prompt_tokens_by_source[local_compute]": total - sum(want),
        "vllm:prompt_tokens_by_source[local_cache_hit]": 0,
        "vllm:prompt_tokens_by_source[external_kv_transfer]": sum(want)}
    assert sum(want) > 0.8 * total  # most prompt tokens were not computed
    assert b["metrics"]["vllm:prompt_tokens_cached_by_source[disk]"] == sum(want)
    c = b["connector"]
    assert c["loaded_blocks"] == c["lookup_hit_blocks"] == sum(want) // BLOCK
    assert c["load_failed_blocks"] == 0 and c["saved_blocks"] == 0


def test_corrupt_and_missing_blocks_are_recomputed(scenario: dict[str, Any]) -> None:
    b, c = scenario["B"], scenario["C"]
    assert tokens(c) == tokens(scenario["ref"])
    long, sp_a, sp_b = c["outputs"]
    assert prompt_blocks(long) == 5
    conn = c["connector"]
    # LONG's hit stops before the deleted block 4: vLLM schedules 4 blocks from kvstore.
    # Block 1 fails its checksum: only block 0 is loaded, blocks 1..3 are reported failed
    # and recomputed.  (vLLM's counters still include them: it counts hits when it
    # schedules, before the load; connector_stats counts what was loaded.)
    assert long["num_cached_tokens"] == 4 * BLOCK
    assert conn["load_failed_blocks"] == 3
    assert conn["store"]["corrupt_blocks"] == 1 and conn["store"]["quarantined"] == 1
    # SP_A's block 2 is gone: its hit stops before it.
    assert sp_a["num_cached_tokens"] == 2 * BLOCK
    assert sp_b["num_cached_tokens"] == prompt_blocks(sp_b) * BLOCK
    external = "vllm:prompt_tokens_by_source[external_kv_transfer]"
    assert c["metrics"][external] == b["metrics"][external] - 2 * BLOCK
    # Fewer blocks were loaded than after a clean restart: LONG 1 instead of 5, SP_A 2
    # instead of 3.
    assert conn["loaded_blocks"] == b["connector"]["loaded_blocks"] - 4 - 1
    # Loads finish before their request runs: no forward read the failed blocks, so no
    # save was dropped.  LONG's blocks 1 and 4 and SP_A's block 2 were saved again.
    assert conn["save_dropped_blocks"] == 0
    assert conn["saved_blocks"] == 3


def test_store_heals_after_recompute(scenario: dict[str, Any]) -> None:
    b, d = scenario["B"], scenario["D"]
    assert tokens(d) == tokens(scenario["ref"])
    assert [o["num_cached_tokens"] for o in d["outputs"]] == \
        [o["num_cached_tokens"] for o in b["outputs"]]
    assert d["connector"]["loaded_blocks"] == b["connector"]["loaded_blocks"]
    assert d["connector"]["load_failed_blocks"] == 0


def test_multiprocess_engine_finds_blocks_through_the_worker(scenario: dict[str, Any]) -> None:
    b, e = scenario["B"], scenario["E"]
    assert e["connector"] is None  # the store is open in the worker process, not here
    assert tokens(e) == tokens(scenario["ref"])
    assert [o["num_cached_tokens"] for o in e["outputs"]] == \
        [o["num_cached_tokens"] for o in b["outputs"]]
    for source in ("vllm:prompt_tokens_by_source[external_kv_transfer]",
                   "vllm:prompt_tokens_cached_by_source[disk]"):
        assert e["metrics"][source] == b["metrics"][source] > 0


def test_unopenable_store_fails_at_start_with_a_clear_error(scenario: dict[str, Any]) -> None:
    error = scenario["bad"].get("error", "")
    assert "kvstore connector: cannot open the store at" in error, error
    assert "not-a-directory" in error


def test_a_failed_load_is_never_a_prefix_cache_hit(scenario: dict[str, Any]) -> None:
    """LONG's load fails (block 1 corrupt) and the request is aborted before it
    recomputes; sent again, it must not take the unloaded blocks from vLLM's own prefix
    cache, and nothing computed from them may reach the store (life G)."""
    f, g = scenario["F"], scenario["G"]
    assert tokens(f) == tokens(scenario["ref"])
    assert tokens(g) == tokens(scenario["ref"])
    assert f["connector"]["load_failed_blocks"] >= 3  # the corruption was met
    assert f["connector"]["store"]["corrupt_blocks"] == 1


def test_a_second_engine_on_the_same_path_never_sees_the_first_ones_blocks(
        scenario: dict[str, Any]) -> None:
    """Y1's store starts empty, as A's did: it must see exactly A's hits (SP_B's
    system-prompt blocks, saved by SP_A in the same life); any more came from X."""
    y1, a = scenario["Y1"], scenario["A"]
    assert tokens(y1) == tokens(scenario["ref"])
    assert [o["num_cached_tokens"] for o in y1["outputs"]] == \
        [o["num_cached_tokens"] for o in a["outputs"]] == [0, 0, 2 * BLOCK]
    external = "vllm:prompt_tokens_by_source[external_kv_transfer]"
    assert y1["metrics"][external] == a["metrics"][external] == 2 * BLOCK
    assert tokens(scenario["X"]) == tokens(scenario["ref"])


def test_an_engine_that_cannot_serve_its_lookups_refuses_to_start(
        scenario: dict[str, Any]) -> None:
    """Y2 has X's engine id: its worker cannot own the lookup socket, so it refuses."""
    y2 = scenario["Y2"]
    assert "outputs" not in y2, "the engine started although its lookups go elsewhere"
    assert "kvstore connector: cannot serve lookups" in y2.get("error", "") + y2["stderr"]
