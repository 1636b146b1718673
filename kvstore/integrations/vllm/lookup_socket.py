"""Prefix lookups for a vLLM scheduler that runs in another process than its worker.

Before it schedules a request, vLLM's scheduler asks the connector how many of the
request's blocks are stored.  The store is open in the worker (one process owns a store
directory).  When scheduler and worker share a process (vLLM's default for a single
worker on GPU, or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler calls the store
directly; when they do not (the multiprocess executor, vLLM's default on CPU), the
worker answers over a Unix socket in Linux's abstract namespace (no file to create or
clean up; it disappears with the worker), named after the store's real path and the
engine's id (vLLM's ``kv_transfer_config.engine_id``, shared by an engine's scheduler and
workers, unique per engine): two engines never share a name, even where the same path
is another directory (containers with their own mount namespace but the host's network
namespace, where abstract socket names are shared).

Protocol, little-endian.  At connect, one handshake; then one request at a time::

    hello     b"KVSL", u16 version (3), u16 n, n bytes engine id (UTF-8), 16 bytes scope
    welcome   u8 status (0 ok, 1 another engine, 2 another key scope),
              u16 n, n bytes the server's engine id, 16 bytes the server's scope
    request   u32 scope epoch, u32 n, then n times (u16 length, that many bytes of
              vLLM block hash)
    response  u32 how many leading hashes name stored blocks (0 when the worker's
              scope epoch is not the request's)

The scope epoch counts the connector's moves to a new key scope since the engine
started (``reset_cache``, after a weight update): the scheduler moves first, the worker
when the step metadata reaches it; in between the worker answers 0, so a lookup never
counts blocks of the other weights.

The scope is a digest of everything the connector puts in the store's key scope that
the scheduler knows too (model weights fingerprint, model config, KV cache dtype, ...):
a scheduler is only ever answered by a worker of its own engine and model, so a hit it
reports is a block its worker can load.  The worker turns the hashes into keys with its
own namespace, so the scheduler never needs to know the KV layout.  With tensor/pipeline parallel every rank serves its own store
(:mod:`kvstore.integrations.vllm.ranks`) on its own socket, and the scheduler asks them
all (:class:`RankLookups`): a block is a hit only when every rank has it.  Both ends check the
other's user (``SO_PEERCRED``): the worker answers only processes of its own user, and
the scheduler talks only to a worker of its own user (an abstract name is first come,
first served: another user could bind it before the worker starts, and would otherwise
see the hashes of every prompt).  Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence

__all__ = ["MAX_HASHES", "SCOPE_BYTES", "LookupClient", "LookupMismatchError", "LookupServer",
           "RankLookups", "socket_name"]

MatchFn = Callable[[list[bytes]], int]
MAX_HASHES = 1 << 20  # a request of more blocks than any context holds is refused
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_MAGIC = b"KVSL"
_VERSION = 3
SCOPE_BYTES = 16
_OK, _OTHER_ENGINE, _OTHER_SCOPE = 0, 1, 2
_MAX_ENGINE_ID = 1024


class LookupMismatchError(ConnectionError):
    """The lookup socket is served by another engine, or for another key scope."""


def socket_name(store_path: str | os.PathLike[str], engine_id: str) -> str:
    """The abstract socket name of engine ``engine_id``'s worker serving ``store_path``."""
    real = os.path.realpath(os.fspath(store_path)).encode()
    h = hashlib.blake2b(real + b"\0" + engine_id.encode(), digest_size=12)
    return "\0kvstore-vllm-" + h.hexdigest()


def _encode_hello(engine_id: str, scope: bytes, status: int | None = None) -> bytes:
    ident = engine_id.encode()
    if len(ident) > _MAX_ENGINE_ID or len(scope) != SCOPE_BYTES:
        raise ValueError(f"engine id of at most {_MAX_ENGINE_ID} bytes and a "
                         f"{SCOPE_BYTES}-byte scope expected")
    head = _MAGIC + struct.pack("<H", _VERSION) if status is None else bytes([status])
    return head + _U16.pack(len(ident)) + ident + scope


def _read_ident(conn: socket.socket) -> tuple[str, bytes] | None:
    size = _recv_exact(conn, _U16.size)
    if size is None or (n := _U16.unpack(size)[0]) > _MAX_ENGINE_ID:
        return None
    ident = _recv_exact(conn, n)
    scope = _recv_exact(conn, SCOPE_BYTES)
    if ident is None or scope is None:
        return None
    return ident.decode("utf-8", "replace"), scope


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None if the peer closed the connection first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def encode_request(hashes: Sequence[bytes], epoch: int = 0) -> bytes:
    if len(hashes) > MAX_HASHES:
        raise ValueError(f"at most {MAX_HASHES} hashes per lookup, got {len(hashes)}")
    parts = [_U32.pack(epoch), _U32.pack(len(hashes))]
    for h in hashes:
        if len(h) > 0xFFFF:
            raise ValueError(f"a block hash of {len(h)} bytes is too long")
        parts += [_U16.pack(len(h)), bytes(h)]
    return b"".join(parts)


def _read_request(conn: socket.socket) -> tuple[int, list[bytes]] | None:
    head = _recv_exact(conn, 2 * _U32.size)
    if head is None:
        return None
    epoch, n = _U32.unpack(head[:4])[0], _U32.unpack(head[4:])[0]
    if n > MAX_HASHES:
        return None
    hashes: list[bytes] = []
    for _ in range(n):
        size = _recv_exact(conn, _U16.size)
        data = None if size is None else _recv_exact(conn, _U16.unpack(size)[0])
        if data is None:
            return None
        hashes.append(data)
    return epoch, hashes


class LookupServer:
    """Answers lookups with ``match(hashes)`` on a thread per connection, to clients
    of engine ``engine_id`` with key scope ``scope`` only, and only while the request's
    scope epoch is ``epoch()``'s (else 0)."""

    def __init__(self, name: str, match: MatchFn, engine_id: str, scope: bytes,
                 epoch: Callable[[], int] = lambda: 0) -> None:
        self.name = name
        self._match = match
        self._epoch = epoch
        self._engine_id, self._scope = engine_id, bytes(scope)
        _encode_hello(engine_id, self._scope)  # validates both before binding
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(name)
            self._sock.listen(8)
        except OSError:
            self._sock.close()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvstore-vllm-lookup",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-vllm-lookup",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if _peer_uid(conn) != os.getuid() or not self._welcome(conn):
                return
            while True:
                try:
                    request = _read_request(conn)
                    if request is None:
                        return
                    epoch, hashes = request
                    hit = self._safe_match(hashes) if epoch == self._epoch() else 0
                    conn.sendall(_U32.pack(hit))
                except OSError:
                    return

    def _welcome(self, conn: socket.socket) -> bool:
        """Read the client's hello and answer it; True if lookups may follow."""
        try:
            magic = _recv_exact(conn, len(_MAGIC) + 2)
            if magic is None or magic[:4] != _MAGIC or \
                    struct.unpack("<H", magic[4:])[0] != _VERSION:
                return False
            peer = _read_ident(conn)
            if peer is None:
                return False
            status = _OTHER_ENGINE if peer[0] != self._engine_id else \
                _OTHER_SCOPE if peer[1] != self._scope else _OK
            conn.sendall(_encode_hello(self._engine_id, self._scope, status))
            return status == _OK
        except OSError:
            return False

    def _safe_match(self, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        try:
            return self._match(hashes)
        except Exception:  # a lookup that fails (store closing, I/O) is a miss, never wrong
            return 0

    def close(self) -> None:
        self._closed = True
        # shutdown() wakes the thread blocked in accept(); close() alone may not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class LookupClient:
    """The scheduler's end: ``match(hashes)`` asks the worker; thread-safe.

    A lookup that takes longer than ``timeout`` seconds (a stuck worker) raises instead
    of blocking the scheduler, and drops the connection -- a late reply would otherwise
    answer the next request -- so the next lookup reconnects.  Every connection starts
    with the handshake: a server of another engine or key scope raises
    :class:`LookupMismatchError`, never answers.
    """

    def __init__(self, name: str, engine_id: str, scope: bytes, timeout: float = 10.0) -> None:
        self._name, self._timeout = name, timeout
        self._hello = _encode_hello(engine_id, bytes(scope))
        self._engine_id, self._scope = engine_id, bytes(scope)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = self._connect()  # fails loudly at start

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(self._name)
            uid = _peer_uid(sock)
            if uid != os.getuid():
                raise PermissionError(
                    f"the lookup socket {self._name[1:]!r} is served by uid {uid}, not by this "
                    f"user (uid {os.getuid()}); not sending it anything")
            sock.sendall(self._hello)
            status = _recv_exact(sock, 1)
            peer = None if status is None else _read_ident(sock)
            if status is None or peer is None:
                raise ConnectionError("the kvstore lookup server closed the connection at "
                                      "the handshake (another program or protocol version)")
            if status[0] != _OK:
                what = "engine" if status[0] == _OTHER_ENGINE else "key scope"
                raise LookupMismatchError(
                    f"the kvstore lookup socket is served by another {what} (engine "
                    f"{peer[0]!r}, scope {peer[1].hex()}; this scheduler is engine "
                    f"{self._engine_id!r}, scope {self._scope.hex()})")
        except OSError:
            sock.close()
            raise
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def match(self, hashes: Sequence[bytes], epoch: int = 0) -> int:
        request = encode_request(hashes, epoch)
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.sendall(request)
                reply = _recv_exact(self._sock, _U32.size)
            except OSError:                      # timeouts included
                self._drop()
                raise
            if reply is None:
                self._drop()
                raise ConnectionError("the kvstore worker closed the lookup connection")
        (hit,) = _U32.unpack(reply)
        return int(hit)

    def close(self) -> None:
        with self._lock:
            self._drop()


class RankLookups:
    """The scheduler's end for a multi-rank engine: one :class:`LookupClient` per rank;
    ``match`` is the minimum of the ranks' answers (a block counts only when every
    rank holds its shard).  Connects to every rank at start, failing loudly."""

    def __init__(self, names: Sequence[str], engine_id: str, scope: bytes,
                 timeout: float = 10.0) -> None:
        self._clients: list[LookupClient] = []
        try:
            for name in names:
                self._clients.append(LookupClient(name, engine_id, scope, timeout))
        except BaseException:
            self.close()
            raise

    def match(self, hashes: Sequence[bytes], epoch: int = 0) -> int:
        hit = len(hashes)
        answers = [-1] * len(self._clients)
        # Until every rank answered the same: each answers the longest hit it can
        # serve within what it is asked.  A hybrid model's hits are not prefix-closed
        # (a rank that can serve 4 blocks may not serve 3: no state at 3), so a rank
        # that answered more than the others settled on is asked again.
        while hit and any(a != hit for a in answers):
            for i, client in enumerate(self._clients):
                if hit == 0:
                    break
                if answers[i] != hit:
                    answers[i] = client.match(hashes[:hit], epoch)
                    hit = min(hit, answers[i])
        return hit

    def close(self) -> None:
        for client in self._clients:
            client.close()
