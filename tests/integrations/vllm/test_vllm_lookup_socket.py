"""The scheduler-to-worker lookup socket of the vLLM connector, against a real store."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.integrations.vllm.lookup_socket import (
    MAX_HASHES,
    LookupClient,
    LookupMismatchError,
    LookupServer,
    RankLookups,
    encode_request,
    socket_name,
)

NS = kvstore.Namespace(model="m", dtype="float32", block_size=16)
HASHES = [bytes([i]) * 32 for i in range(6)]  # vLLM's sha256 block hashes are 32 bytes
ENGINE = "engine-1"
SCOPE = bytes(range(16))


def client_of(server: LookupServer, timeout: float = 10.0) -> LookupClient:
    return LookupClient(server.name, ENGINE, SCOPE, timeout=timeout)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LookupServer]:
    """A server answering from a store holding the first four blocks of HASHES."""
    with kvstore.open_blocking(tmp_path / "store", namespace=NS, extent_bytes=4 << 20) as store:
        keys = NS.engine_keys(HASHES[:4])
        store.put_many(keys, [torch.full((64,), float(i)) for i in range(4)],
                       parents=kvstore.chain_parents(keys))
        srv = LookupServer(socket_name(tmp_path / "store", ENGINE),
                           lambda hashes: store.match_prefix(NS.engine_keys(hashes)),
                           ENGINE, SCOPE)
        try:
            yield srv
        finally:
            srv.close()


def test_client_gets_the_stored_prefix_length(server: LookupServer) -> None:
    client = client_of(server)
    try:
        assert client.match(HASHES) == 4
        assert client.match(HASHES[:2]) == 2
        assert client.match(HASHES[4:]) == 0
        assert client.match([]) == 0
        assert client.match([HASHES[0], HASHES[5], HASHES[1]]) == 1  # a prefix, not a count
    finally:
        client.close()


def test_socket_name_follows_the_real_path_and_the_engine(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "store")
    assert socket_name(tmp_path / "link", ENGINE) == socket_name(tmp_path / "store", ENGINE)
    assert socket_name(tmp_path / "store", ENGINE) != socket_name(tmp_path / "other", ENGINE)
    # Two engines on the same path (another mount namespace) never share a name.
    assert socket_name(tmp_path / "store", ENGINE) != socket_name(tmp_path / "store", "e2")
    assert socket_name(tmp_path, ENGINE).startswith("\0")  # abstract: no file to clean up


@pytest.mark.parametrize("engine,scope,what", [("engine-2", SCOPE, "another engine"),
                                               (ENGINE, bytes(16), "another key scope")])
def test_a_server_of_another_engine_or_scope_never_answers(
        server: LookupServer, engine: str, scope: bytes, what: str) -> None:
    """A scheduler reaching a worker that is not its own (a name collision) is refused
    at the handshake instead of being told about blocks its own worker cannot load."""
    with pytest.raises(LookupMismatchError, match=what) as info:
        LookupClient(server.name, engine, scope)
    assert ENGINE in str(info.value)  # names who answered
    client_of(server).close()  # the server still serves its own scheduler


def test_a_client_without_the_handshake_is_hung_up_on(server: LookupServer) -> None:
    """An old-protocol client (a lookup request straight away) gets no answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(server.name)
        raw.sendall(encode_request(HASHES))
        try:
            reply = raw.recv(4)
        except ConnectionResetError:  # hung up with our bytes unread
            reply = b""
        assert reply == b""


def test_no_server_is_a_connection_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        LookupClient(socket_name(tmp_path / "nobody-serves-this", ENGINE), ENGINE, SCOPE)


@pytest.mark.skipif(os.geteuid() != 0, reason="a server of another user needs root")
def test_a_server_of_another_user_is_not_talked_to(tmp_path: Path) -> None:
    """Another user binding the store's socket name first sees no lookups."""
    name = socket_name(tmp_path / "store", ENGINE)
    squatter = subprocess.Popen([sys.executable, "-c", (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind({name!r}); s.listen(1)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "ready\n"
        with pytest.raises(PermissionError, match="served by uid 65534"):
            LookupClient(name, ENGINE, SCOPE)
    finally:
        squatter.kill()
        squatter.wait()


def test_a_second_server_for_the_same_store_is_refused(server: LookupServer) -> None:
    with pytest.raises(OSError):
        LookupServer(server.name, lambda hashes: 0, ENGINE, SCOPE)


def test_oversized_requests_are_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="at most"):
        encode_request([b"x"] * (MAX_HASHES + 1))
    with pytest.raises(ValueError, match="too long"):
        encode_request([b"x" * 70000])


def test_malformed_request_closes_the_connection(server: LookupServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(server.name)
        raw.sendall(b"KVSL" + struct.pack("<HH", 3, len(ENGINE)) + ENGINE.encode() + SCOPE)
        assert raw.recv(1) == b"\0"   # welcome: status ok
        raw.recv(2 + len(ENGINE) + 16)
        raw.sendall(struct.pack("<II", 0, MAX_HASHES + 1))  # epoch 0, too many hashes
        assert raw.recv(4) == b""  # the server hung up instead of reading on
    client = client_of(server)  # and still serves others
    try:
        assert client.match(HASHES) == 4
    finally:
        client.close()


def test_a_stuck_worker_times_out_and_the_next_lookup_reconnects(tmp_path: Path) -> None:
    release = threading.Event()
    calls: list[int] = []

    def match(hashes: list[bytes]) -> int:
        calls.append(len(hashes))
        if len(calls) == 1:
            release.wait(30)        # the worker's event loop is stuck
        return len(hashes)

    srv = LookupServer(socket_name(tmp_path / "stuck", ENGINE), match, ENGINE, SCOPE)
    client = LookupClient(srv.name, ENGINE, SCOPE, timeout=0.2)
    try:
        with pytest.raises(OSError):
            client.match(HASHES[:1])
        release.set()
        # A fresh connection: the late reply to the first lookup cannot answer this one.
        assert client.match(HASHES[:3]) == 3
        assert calls == [1, 3]
    finally:
        release.set()
        client.close()
        srv.close()


def _rank_server(store: Path, name: str, stored: int) -> subprocess.Popen[str]:
    """A worker process of its own serving ``store`` (holding the first ``stored`` blocks
    of HASHES) on ``name``, as each rank of a tensor-parallel engine does."""
    code = (
        "import sys, torch, kvstore\n"
        "from kvstore.integrations.vllm.lookup_socket import LookupServer\n"
        f"ns = kvstore.Namespace(model='m', dtype='float32', block_size=16)\n"
        f"hashes = [bytes([i]) * 32 for i in range({stored})]\n"
        f"with kvstore.open_blocking({str(store)!r}, namespace=ns, extent_bytes=4 << 20) as s:\n"
        "    keys = ns.engine_keys(hashes)\n"
        "    s.put_many(keys, [torch.zeros(64) for _ in keys], parents=kvstore.chain_parents(keys))\n"
        f"    srv = LookupServer({name!r}, lambda h: s.match_prefix(ns.engine_keys(h)), "
        f"{ENGINE!r}, {SCOPE!r})\n"
        "    print('ready', flush=True)\n"
        "    sys.stdin.read()\n"
        "    srv.close()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_rank_lookups_count_a_block_only_when_every_rank_has_it(tmp_path: Path) -> None:
    """Two worker processes, as two TP ranks: rank 1 lost blocks 3 and 4 (its own
    eviction), so the engine's hit is 3 blocks although rank 0 has 5; a rank that
    stops answering fails the lookup (the scheduler then counts no hit)."""
    names = [socket_name(tmp_path / f"rank-{r}-of-2", ENGINE) for r in range(2)]
    workers = [_rank_server(tmp_path / "rank-0-of-2", names[0], 5),
               _rank_server(tmp_path / "rank-1-of-2", names[1], 3)]
    try:
        lookups = RankLookups(names, ENGINE, SCOPE, timeout=10)
        try:
            assert lookups.match(HASHES) == 3
            assert lookups.match(HASHES[:2]) == 2
            assert lookups.match(HASHES[3:]) == 0
            workers[1].stdin.close()  # type: ignore[union-attr]
            workers[1].wait(timeout=60)
            with pytest.raises(OSError):
                lookups.match(HASHES)
        finally:
            lookups.close()
    finally:
        for w in workers:
            if w.poll() is None:
                w.stdin.close()  # type: ignore[union-attr]
                w.wait(timeout=60)


def test_rank_lookups_fail_at_start_when_a_rank_is_not_serving(server: LookupServer,
                                                                tmp_path: Path) -> None:
    with pytest.raises(OSError):
        RankLookups([server.name, socket_name(tmp_path / "nobody", ENGINE)], ENGINE, SCOPE)


def test_a_lookup_of_another_scope_epoch_is_answered_zero() -> None:
    """After a weight update the scheduler asks with the new epoch before its worker
    moved (the step metadata carries the move): the worker counts nothing meanwhile."""
    epoch = [0]
    name = socket_name(f"/epoch-test-{os.getpid()}", ENGINE)
    server = LookupServer(name, lambda hashes: len(hashes), ENGINE, SCOPE,
                          epoch=lambda: epoch[0])
    client = LookupClient(name, ENGINE, SCOPE)
    try:
        assert client.match(HASHES, 0) == len(HASHES)
        assert client.match(HASHES, 1) == 0  # the scheduler moved, the worker not yet
        epoch[0] = 1
        assert client.match(HASHES, 1) == len(HASHES)
        assert client.match(HASHES, 0) == 0  # a lookup of the old scope, late
    finally:
        client.close()
        server.close()


def test_rank_lookups_settle_on_a_hit_every_rank_can_serve(tmp_path: Path) -> None:
    """A hybrid model's hits are not prefix-closed: a rank may serve a hit of 4 blocks
    and not one of 3 (no state stored at 3).  Rank 0 serves 4 or 2, rank 1 serves 3 or
    2: the engine's hit is 2, never 3 (rank 0 would fail it) nor 4."""
    valid = [{4, 2}, {3, 2}]
    servers = [LookupServer(socket_name(tmp_path / f"rank-{r}-of-2", ENGINE),
                            lambda hashes, ok=ok: max((n for n in ok if n <= len(hashes)),
                                                      default=0), ENGINE, SCOPE)
               for r, ok in enumerate(valid)]
    try:
        lookups = RankLookups([s.name for s in servers], ENGINE, SCOPE, timeout=10)
        try:
            assert lookups.match(HASHES[:5]) == 2
            assert lookups.match(HASHES[:1]) == 0
        finally:
            lookups.close()
    finally:
        for s in servers:
            s.close()
