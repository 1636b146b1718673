"""The systems under test, behind one small interface.

Every system stores block ``i`` of a :class:`Dataset` under the same 16-byte key, times
its own store until the bytes are durable and its own reads, and can check what it read.

``KvstoreSystem``   kvstore as shipped (``sync=True``: fdatasync + LMDB commit before a put
                    returns; O_DIRECT), one engine and codec each; a fresh store per
                    measurement, one small untimed warm-up put creates the first extent.
                    Cold get: the store is closed and reopened (a restart), then the page
                    cache is emptied, then ``get_many(keys, out=...)`` into preallocated
                    tensors is timed (as an engine reads into its own buffers; LMCache
                    reads into its preallocated CPU pool, file-per-block ``readinto``s).
``FilePerBlock``    one file per block, written to ``KEY.tmp`` and renamed into place (what
                    vLLM's file-system offload tier and SGLang's HiCache file backend do),
                    by a pool of 4 threads (LMCache's default disk I/O thread count);
                    reads ``readinto`` preallocated tensors, same pool.
``TorchSave``       ``torch.save(block, KEY.pt)`` / ``torch.load(weights_only=True)``, in a loop.
``NumpyFiles``      ``np.save`` / ``np.load`` of the block's bytes, in a loop.
``LMCacheSystem``   LMCache's ``LocalDiskBackend`` in LMCache's own virtual environment
                    (:mod:`benchmarks.lmcache_driver`, driven over a pipe).

Peers do not fsync: each timed store ends with one ``syncfs`` of the scratch file system.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import torch

from benchmarks.common import MiB, files_under, syncfs
from benchmarks.data import LAYOUT_AXES, block_key, fingerprint, make_blocks

PEER_THREADS = 4  # LMCache's default disk_io_threads; the file-per-block pool uses the same


@dataclass
class Dataset:
    """``n`` blocks of ``block_bytes``; block ``i`` holds ``src[i % len(src)]`` (distinct
    keys, so a big run need not hold all its bytes in memory)."""

    block_bytes: int
    n: int
    seed: int
    distinct: int
    src: list[torch.Tensor] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    @classmethod
    def make(cls, block_bytes: int, n: int, seed: int = 0, max_distinct_bytes: int = 256 * MiB
             ) -> Dataset:
        distinct = max(1, min(n, max_distinct_bytes // block_bytes))
        ds = cls(block_bytes, n, seed, distinct)
        ds.src = make_blocks(block_bytes, distinct, seed)
        ds.keys = [block_key(seed, block_bytes, i) for i in range(n)]
        return ds

    def block(self, i: int) -> torch.Tensor:
        return self.src[i % self.distinct]

    def spec(self) -> dict[str, int]:
        return {"block_bytes": self.block_bytes, "n": self.n, "seed": self.seed,
                "distinct": self.distinct, "fingerprint": fingerprint(self.src)}


def same_block(got: torch.Tensor | None, want: torch.Tensor, lossy: bool) -> bool:
    """Equal (lossless), or within FP8 e4m3's relative error, 0.1 (lossy)."""
    if got is None or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not lossy:
        return torch.equal(got, want)
    w = want.float()
    return float((got.float() - w).norm() / w.norm().clamp_min(1e-12)) < 0.1


class System(ABC):
    name: str
    family: str  # "kvstore" or "peer"
    lossy = False

    def __init__(self) -> None:
        self.ds: Dataset | None = None
        self.dir = ""
        self._got: dict[int, torch.Tensor | None] = {}
        self._outs: list[torch.Tensor] = []

    async def open(self, root: str, ds: Dataset) -> None:
        self.ds = ds
        self.dir = os.path.join(root, self.slug())
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, mode=0o700)  # owner-only, as kvstore wants its stores
        self._got = {}

    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name)

    @abstractmethod
    async def put(self, lo: int, hi: int) -> float:
        """Store blocks ``lo..hi-1``; seconds until they are durable."""

    async def reopen(self) -> None:
        """Untimed, before a cold read (kvstore: close and reopen the store)."""
        await self.stop()
        await self.restart()

    async def stop(self) -> None:
        """First half of :meth:`reopen`.  Several systems restart together by stopping in
        reverse order and restarting in order (kvstore's task groups nest)."""
        return None

    async def restart(self) -> None:
        """Second half of :meth:`reopen`."""
        return None

    @abstractmethod
    async def get(self, lo: int, hi: int, keep: bool = True) -> float:
        """Read blocks ``lo..hi-1`` back; seconds.  ``keep``: hold them for verify()."""

    def files(self) -> list[str]:
        return files_under(self.dir) if self.dir else []

    def verify(self) -> int:
        """How many blocks of the last kept get are missing or different."""
        assert self.ds is not None
        ds = self.ds
        return sum(not same_block(t, ds.block(i), self.lossy) for i, t in self._got.items())

    def drop_results(self) -> None:
        self._got = {}

    def outputs(self, count: int) -> list[torch.Tensor]:
        """``count`` preallocated, already faulted-in block buffers, reused by every get
        of this measurement: an engine reads into its own (GPU or pinned) buffers; a
        fresh allocation per block would time the allocator's page faults instead."""
        assert self.ds is not None
        shape = self.ds.src[0].shape
        have = self._outs
        if have and have[0].shape != shape:
            have = []
        while len(have) < count:
            have.append(torch.zeros(shape, dtype=torch.bfloat16))
        self._outs = have
        return have[:count]

    async def close(self) -> None:
        self._got = {}
        self._outs = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def shutdown(self) -> None:
        """End of the whole run (subprocess peers exit)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family}


# --------------------------------------------------------------------------- kvstore


class KvstoreSystem(System):
    family = "kvstore"

    def __init__(self, engine: str, codec: str, *, extent_bytes: int = 1 << 30,
                 staging_bytes: int = 256 * MiB) -> None:
        super().__init__()
        if codec not in ("raw", "fp8"):
            raise ValueError(f"codec must be raw or fp8, not {codec!r}")
        self.engine, self.codec_name = engine, codec
        self.name = f"kvstore {engine} {codec}"
        self.lossy = codec == "fp8"
        self.extent_bytes, self.staging_bytes = extent_bytes, staging_bytes
        self._stack: AsyncExitStack | None = None
        self.store: Any = None
        self.info: dict[str, Any] = {}

    def _options(self) -> dict[str, Any]:
        from kvstore.codecs.pipeline import CodecSpec, KVLayout

        codec = None
        if self.codec_name == "fp8":
            kv, tok, head = LAYOUT_AXES
            codec = CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=kv, token_axis=tok,
                                                          head_axis=head))
        return {"engine": self.engine, "sync": True, "extent_bytes": self.extent_bytes,
                "staging_bytes": self.staging_bytes, "codec": codec}

    async def _enter(self, create: bool) -> None:
        import kvstore

        self._stack = AsyncExitStack()
        self.store = await self._stack.enter_async_context(
            kvstore.open(self.dir, create=create, **self._options()))

    async def _exit(self) -> None:
        if self._stack is not None:
            stack, self._stack, self.store = self._stack, None, None
            await stack.aclose()

    async def open(self, root: str, ds: Dataset) -> None:
        await super().open(root, ds)
        await self._enter(create=True)
        # creates (fallocates) the first extent outside the timing
        await self.store.put(block_key(ds.seed, 0, -1), torch.zeros(16, dtype=torch.uint8))
        st = self.store.stats()
        self.info = {"engine": st.engine, "o_direct": st.o_direct, "reason": st.engine_reason,
                     "durable": st.durable}

    async def put(self, lo: int, hi: int) -> float:
        import kvstore

        assert self.ds is not None
        keys = self.ds.keys[lo:hi]
        values = [self.ds.block(i) for i in range(lo, hi)]
        parents = kvstore.chain_parents(keys, first_parent=self.ds.keys[lo - 1] if lo else None)
        t0 = time.perf_counter()
        res = await self.store.put_many(keys, values, parents=parents)
        dt = time.perf_counter() - t0
        if res.written != hi - lo:
            raise RuntimeError(f"{self.name}: put wrote {res.written} of {hi - lo} blocks")
        return dt

    async def stop(self) -> None:
        await self._exit()

    async def restart(self) -> None:
        await self._enter(create=False)
        assert self.ds is not None
        await self.store.get(block_key(self.ds.seed, 0, -1))  # engine and index warm-up

    async def get(self, lo: int, hi: int, keep: bool = True) -> float:
        assert self.ds is not None
        keys = self.ds.keys[lo:hi]
        outs = self.outputs(hi - lo)
        t0 = time.perf_counter()
        got = await self.store.get_many(keys, out=outs)
        dt = time.perf_counter() - t0
        if keep:
            self._got.update(zip(range(lo, hi), got))
        return dt

    def files(self) -> list[str]:
        return []  # O_DIRECT: nothing of the payload is in the page cache

    async def close(self) -> None:
        await self._exit()
        await super().close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "engine": self.engine, "codec": self.codec_name,
                "sync": True, "extent_bytes": self.extent_bytes,
                "staging_bytes": self.staging_bytes, "probe": self.info}


# --------------------------------------------------------------------------- file peers


def _read_exact(f: IO[bytes], buf: np.ndarray) -> None:
    view = buf.data.cast("B")
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            raise OSError(f"short read: {done} of {len(view)} bytes")
        done += n


class FilePerBlock(System):
    family = "peer"
    name = "file-per-block"

    def __init__(self, threads: int = PEER_THREADS) -> None:
        super().__init__()
        self.threads = threads
        self.pool: ThreadPoolExecutor | None = None

    def _path(self, i: int) -> str:
        assert self.ds is not None
        return os.path.join(self.dir, self.ds.keys[i].hex() + ".bin")

    async def open(self, root: str, ds: Dataset) -> None:
        await super().open(root, ds)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="file-per-block")

    def _write(self, i: int) -> None:
        assert self.ds is not None
        path = self._path(i)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(self.ds.block(i).view(torch.uint8).numpy().data)
        os.replace(tmp, path)

    def _read(self, i: int, out: torch.Tensor) -> torch.Tensor:
        with open(self._path(i), "rb", buffering=0) as f:
            _read_exact(f, out.view(torch.uint8).numpy())
        return out

    async def put(self, lo: int, hi: int) -> float:
        assert self.pool is not None
        t0 = time.perf_counter()
        list(self.pool.map(self._write, range(lo, hi)))
        syncfs(self.dir)
        return time.perf_counter() - t0

    async def get(self, lo: int, hi: int, keep: bool = True) -> float:
        assert self.pool is not None
        outs = self.outputs(hi - lo)
        t0 = time.perf_counter()
        got = list(self.pool.map(self._read, range(lo, hi), outs))
        dt = time.perf_counter() - t0
        if keep:
            self._got.update(zip(range(lo, hi), got))
        return dt

    async def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "threads": self.threads,
                "write": "KEY.bin.tmp then os.replace; no fsync; one syncfs at the end"}


class TorchSave(System):
    family = "peer"
    name = "torch.save"

    def _path(self, i: int) -> str:
        assert self.ds is not None
        return os.path.join(self.dir, self.ds.keys[i].hex() + ".pt")

    async def put(self, lo: int, hi: int) -> float:
        assert self.ds is not None
        t0 = time.perf_counter()
        for i in range(lo, hi):
            torch.save(self.ds.block(i), self._path(i))
        syncfs(self.dir)
        return time.perf_counter() - t0

    async def get(self, lo: int, hi: int, keep: bool = True) -> float:
        t0 = time.perf_counter()
        got = [torch.load(self._path(i), weights_only=True) for i in range(lo, hi)]
        dt = time.perf_counter() - t0
        if keep:
            self._got.update(zip(range(lo, hi), got))
        return dt


class NumpyFiles(System):
    family = "peer"
    name = "numpy"

    def _path(self, i: int) -> str:
        assert self.ds is not None
        return os.path.join(self.dir, self.ds.keys[i].hex() + ".npy")

    async def put(self, lo: int, hi: int) -> float:
        assert self.ds is not None
        t0 = time.perf_counter()
        for i in range(lo, hi):
            np.save(self._path(i), self.ds.block(i).view(torch.uint8).numpy())
        syncfs(self.dir)
        return time.perf_counter() - t0

    async def get(self, lo: int, hi: int, keep: bool = True) -> float:
        assert self.ds is not None
        shape = self.ds.src[0].shape
        t0 = time.perf_counter()
        got = [torch.from_numpy(np.load(self._path(i))).view(torch.bfloat16).reshape(shape)
               for i in range(lo, hi)]
        dt = time.perf_counter() - t0
        if keep:
            self._got.update(zip(range(lo, hi), got))
        return dt


# --------------------------------------------------------------------------- LMCache


class PeerUnavailable(Exception):
    """A peer that is not installed here (the run goes on without it, with a note)."""


class LMCacheSystem(System):
    """LMCache's local disk backend, in a subprocess running LMCache's own interpreter."""

    family = "peer"
    name = "lmcache"

    def __init__(self, python: str, repo_root: str) -> None:
        super().__init__()
        self.python = python
        self.proc: subprocess.Popen[str] | None = None
        self.version = "unknown"
        env = dict(os.environ, PYTHONPATH=repo_root, PYTHONUNBUFFERED="1",
                   LMCACHE_LOG_LEVEL="WARNING")
        # LMCache logs to stderr; a file, not a pipe nobody drains (a full pipe blocks it)
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the peer
            "w+", prefix="kvstore-bench-lmcache-", suffix=".log")
        if not os.path.exists(python):
            raise PeerUnavailable(f"no interpreter at {python} (run with --install-peers)")
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "benchmarks.lmcache_driver"], cwd=repo_root, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                text=True, bufsize=1)
        except OSError as e:
            raise PeerUnavailable(f"cannot start {python}: {e}") from e
        hello = self._recv()
        if "error" in hello:
            raise PeerUnavailable(hello["error"])
        self.version = str(hello.get("lmcache", "unknown"))
        self.config: dict[str, Any] = hello.get("config", {})

    def _recv(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            err = self.log.read()
            raise PeerUnavailable(f"LMCache driver exited ({self.proc.returncode}): "
                                  f"{err.strip()[-2000:]}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def _call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        doc = self._recv()
        if "error" in doc:
            raise RuntimeError(f"LMCache driver: {doc['error']}")
        return doc

    async def open(self, root: str, ds: Dataset) -> None:
        await super().open(root, ds)
        reply = self._call(cmd="open", dir=self.dir, **{k: v for k, v in ds.spec().items()
                                                        if k != "fingerprint"})
        if reply["fingerprint"] != ds.spec()["fingerprint"]:
            raise RuntimeError("the LMCache driver generated different block data "
                               "(another torch version?); its numbers would not compare")

    async def put(self, lo: int, hi: int) -> float:
        return float(self._call(cmd="put", lo=lo, hi=hi)["seconds"])

    async def get(self, lo: int, hi: int, keep: bool = True) -> float:
        return float(self._call(cmd="get", lo=lo, hi=hi, keep=keep)["seconds"])

    def verify(self) -> int:
        return int(self._call(cmd="verify")["bad"])

    def drop_results(self) -> None:
        self._call(cmd="drop")

    async def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._call(cmd="close")
        await super().close()

    async def shutdown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with_stdin = self.proc.stdin
            if with_stdin is not None:
                with_stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                with_stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "lmcache": self.version, "python": self.python,
                "config": self.config}


def default_lmcache_python() -> str:
    """Where ``--install-peers`` puts LMCache's virtual environment."""
    base = os.environ.get("KVSTORE_BENCH_PEERS", os.path.join(
        os.path.expanduser("~"), ".cache", "kvstore", "bench-peers"))
    return os.path.join(base, "lmcache-venv", "bin", "python")


def python_of(venv_or_python: str) -> str:
    p = venv_or_python
    if os.path.isdir(p):
        p = os.path.join(p, "bin", "python")
    return p


__all__ = ["Dataset", "FilePerBlock", "KvstoreSystem", "LMCacheSystem", "NumpyFiles",
           "PeerUnavailable", "System", "TorchSave", "default_lmcache_python", "python_of"]
