"""Another process on a concurrent state machine's store (issue 43: processes as actors
in DESIGN 17.4; tests/test_concurrent_stateful.py).

:class:`PeerReader` runs ``python -m tests.peer_reader PATH ENGINE SEED``: a second owner
of the machine's store (shared, no memory tier, so every hit is a disk read) that reads
for as long as it lives, beside every round's puts, deletes, evictions, cancellations,
closes, forks, scrubs and checks: ``get_many`` of 1-6 random blocks of the machine's
pool (each checked bit-exact against the value every put of that key writes) and
``match_prefix`` of a chain, a few milliseconds apart (a pace, not a synchronisation).
Its reads publish read marks, so the machine's freed space waits for them before it is
reused; a round may SIGKILL it mid-read (its mark then stays until a waiting reserve or
the next open recovers it).  On a line ``report`` on its stdin it prints what it saw as
JSON; on ``stop`` it closes its store and prints it once more.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACE_S = 0.003  # between two reads: the machine's rounds keep most of the cores


class PeerReader:
    """The process (see the module docstring); started open, or the constructor fails."""

    def __init__(self, path: Path, engine: str, seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.peer_reader", str(path), engine, str(seed)],
            cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        line = self._out.readline()
        if line != "ready\n":
            self.kill()
            raise AssertionError(f"a peer process could not open the store: {line!r}")
        self.killed = False

    def ask(self, what: str) -> dict[str, Any]:
        """``report`` or ``stop``: what it saw so far (see the module docstring)."""
        self._in.write(what + "\n")
        self._in.flush()
        line = self._out.readline()
        assert line, f"the peer process ended (exit status {self.proc.wait()})"
        return json.loads(line)  # type: ignore[no-any-return]

    def stop(self) -> dict[str, Any]:
        report = self.ask("stop")
        assert self.proc.wait(timeout=60) == 0
        self._close()
        return report

    def kill(self) -> None:
        """SIGKILL it, wherever it is (mid-read, most likely)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.killed = True
        self._close()

    def _close(self) -> None:
        self._in.close()
        self._out.close()


def main(path: str, engine: str, seed: int) -> None:
    import anyio

    import kvstore
    from tests.conformance import same
    from tests.test_concurrent_stateful import CHAINS, OPTIONS, POOL, VALUES

    asked: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [asked.put(line.strip()) for line in sys.stdin],
                     daemon=True).start()
    rng = random.Random(seed)
    seen: dict[str, Any] = {"reads": 0, "hits": 0, "matches": 0, "wrong": [], "errors": []}

    async def run() -> None:
        async with kvstore.open(path, engine=engine, memory_bytes=0, **OPTIONS) as store:
            print("ready", flush=True)
            while True:
                while not asked.empty():
                    if asked.get() == "stop":
                        return
                    print(json.dumps(seen), flush=True)
                try:
                    if rng.random() < 0.8:
                        keys = rng.sample(POOL, rng.randint(1, 6))
                        got = await store.get_many(keys)
                        seen["reads"] += 1
                        seen["hits"] += sum(g is not None for g in got)
                        seen["wrong"] += [POOL.index(k) for k, g in zip(keys, got)
                                          if g is not None and not same(g, VALUES[k])]
                    else:
                        await store.match_prefix(rng.choice(CHAINS))
                        seen["matches"] += 1
                except kvstore.KVStoreError as e:
                    seen["errors"].append(repr(e))
                await anyio.sleep(PACE_S)

    anyio.run(run)
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
