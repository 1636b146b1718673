"""A small, real S3 endpoint on 127.0.0.1 that holds requests until the test lets them go:
a slow or hung cluster, for tests/tiers/remote/test_slow_cluster.py.

It speaks what obstore's ``S3Store`` sends kvstore's client (path-style, signatures not
checked): GET / HEAD / PUT of an object (``If-None-Match: *`` answered with 412 when the
object exists; an object named in ``refuse`` answered with the error given there) and
the first page of a ListObjectsV2.  Requests of the methods in
``hold`` ("GET", "PUT", "HEAD", "LIST") wait, at the server, until ``release()``; a held
request whose client closes the connection first is counted in ``abandoned`` and gets
no answer.  ``in_flight`` / ``max_in_flight`` count requests being served at once (from
the request line until its answer starts, or the client left): what the cluster
sees.  Every server thread is named ``slow-s3...``, so a test can count the client's
threads apart (:func:`client_threads`).
"""

from __future__ import annotations

import hashlib
import os
import select
import socket
import threading
from collections import Counter
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

THREAD_PREFIX = "slow-s3"


def client_threads() -> int:
    """Threads alive in this process that are not the test server's."""
    return sum(not t.name.startswith(THREAD_PREFIX) for t in threading.enumerate())


class _Gate:
    """Closed until ``open()``: a pipe whose read end turns readable then, so a held
    request can wait for it and for its client's socket in one ``select``."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.opened = False

    def open(self) -> None:
        if not self.opened:
            self.opened = True
            os.write(self.w, b"x")

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class SlowS3:
    def __init__(self, bucket: str, hold: tuple[str, ...] = ("GET",)) -> None:
        self.bucket = bucket
        self.hold = set(hold)
        self.objects: dict[str, bytes] = {}
        # object name -> (status, S3 error code) answered to every GET and PUT of it: an
        # object the cluster refuses while it serves the others
        self.refuse: dict[str, tuple[int, str]] = {}
        self.requests: Counter[str] = Counter()  # per kind, as they arrived
        self.in_flight = 0
        self.max_in_flight = 0
        self.abandoned = 0  # held requests whose client left before the release
        self._cond = threading.Condition()
        self._gate = _Gate()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"{THREAD_PREFIX}-accept", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> SlowS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self.wait_idle()
        self._gate.close()

    def release(self) -> None:
        """Let every held request (and every later one) be answered."""
        with self._cond:
            self._gate.open()

    def rearm(self) -> None:
        """Hold requests of the kinds in ``hold`` again (after a ``release``); call it
        when no request is held (after ``wait_idle``)."""
        with self._cond:
            if self._gate.opened:
                self._gate.close()
                self._gate = _Gate()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Until no request is being served (bounded by ``timeout``: a hang fails)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.in_flight == 0, timeout)

    # ------------------------------------------------------------ on server threads

    def _enter(self, kind: str) -> _Gate | None:
        with self._cond:
            self.requests[kind] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return self._gate if kind in self.hold and not self._gate.opened else None

    def _leave(self, abandoned: bool) -> None:
        with self._cond:
            self.in_flight -= 1
            self.abandoned += abandoned
            self._cond.notify_all()


def _wait(gate: _Gate, conn: socket.socket) -> bool:
    """Hold until ``gate`` opens: True; False if the client closed its connection
    first (a client that gave up is noticed before a release that came at once)."""
    while True:
        ready, _, _ = select.select([conn.fileno(), gate.r], [], [])
        if conn.fileno() in ready:
            try:
                peek = conn.recv(1, socket.MSG_PEEK)
            except OSError:
                return False
            if not peek:
                return False
            select.select([gate.r], [], [])  # a pipelined request: the release only
            return True
        if gate.r in ready:
            return True


class _Server(HTTPServer):
    owner: SlowS3
    daemon_threads = True

    def process_request(self, request: Any, client_address: Any) -> None:
        # one named thread per connection (ThreadingMixIn's are named Thread-N)
        threading.Thread(target=self._serve_one, args=(request, client_address),
                         name=f"{THREAD_PREFIX}-conn", daemon=True).start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a client that went away
            pass
        finally:
            self.shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _key(self) -> tuple[str, dict[str, list[str]]]:
        url = urlsplit(self.path)
        parts = unquote(url.path).lstrip("/").split("/", 1)
        return (parts[1] if len(parts) > 1 else ""), parse_qs(url.query)

    def _serve(self, kind: str, answer: Any) -> None:
        s3 = self.server.owner
        gate = s3._enter(kind)
        self._left = False
        try:
            if gate is not None and not _wait(gate, self.connection):
                self.close_connection = True
                return
            answer()
        finally:
            if not self._left:  # (held, and its client left before the release)
                self._left = True
                s3._leave(abandoned=gate is not None)

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              *, head: bool = False) -> None:
        # Out of ``in_flight`` before the first byte of the answer leaves: once the client
        # has it, it may give its slot back and send the next request, which this server
        # could otherwise see while still counting the answered one (a count of
        # concurrency + 1 with the client within its bound).
        if not getattr(self, "_left", True):
            self._left = True
            self.server.owner._leave(abandoned=False)
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{code}</Message></Error>").encode()
        self._send(status, body, {"Content-Type": "application/xml"})

    def _refused(self, key: str) -> bool:
        refusal = self.server.owner.refuse.get(key)
        if refusal is not None:
            self._error(*refusal)
        return refusal is not None

    def _object(self, key: str, *, head: bool) -> None:
        if self._refused(key):
            return
        data = self.server.owner.objects.get(key)
        if data is None:
            if head:
                self._send(404, head=True)
            else:
                self._error(404, "NoSuchKey")
            return
        self._send(200, data, {"Content-Type": "application/octet-stream",
                               "ETag": f'"{hashlib.md5(data).hexdigest()}"',  # noqa: S324
                               "Last-Modified": formatdate(usegmt=True)}, head=head)

    def do_GET(self) -> None:  # noqa: N802
        key, query = self._key()
        if not key:  # a listing of the bucket
            prefix = query.get("prefix", [""])[0]
            self._serve("LIST", lambda: self._list(prefix))
        else:
            self._serve("GET", lambda: self._object(key, head=False))

    def do_HEAD(self) -> None:  # noqa: N802
        key, _ = self._key()
        self._serve("HEAD", lambda: self._object(key, head=True))

    def do_PUT(self) -> None:  # noqa: N802
        key, _ = self._key()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        objects = self.server.owner.objects

        def answer() -> None:
            if self._refused(key):
                return
            if self.headers.get("If-None-Match") == "*" and key in objects:
                self._error(412, "PreconditionFailed")
                return
            objects[key] = body
            self._send(200, headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})  # noqa: S324

        self._serve("PUT", answer)

    def _list(self, prefix: str) -> None:
        s3 = self.server.owner
        names = sorted(k for k in s3.objects if k.startswith(prefix))[:1000]
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><Size>{len(s3.objects[k])}</Size>"
            f"<LastModified>2026-01-01T00:00:00.000Z</LastModified>"
            f'<ETag>"{hashlib.md5(s3.objects[k]).hexdigest()}"</ETag></Contents>'  # noqa: S324
            for k in names)
        body = ('<?xml version="1.0" encoding="UTF-8"?>'
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>{escape(s3.bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
                f"<KeyCount>{len(names)}</KeyCount><MaxKeys>1000</MaxKeys>"
                f"<IsTruncated>false</IsTruncated>{contents}</ListBucketResult>").encode()
        self._send(200, body, {"Content-Type": "application/xml"})
