"""The HTTP endpoint of :mod:`kvstore.metrics`: :func:`serve` stores' metrics with a
registry of their own (:class:`MetricsServer`, ``GET /metrics`` on a daemon thread)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio
from prometheus_client import CollectorRegistry, make_wsgi_app

from kvstore.metrics.collector import AnyStore, StoreCollector

__all__ = ["MetricsServer", "serve"]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold up the process' exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Scrapes are not logged to stderr."""


class MetricsServer:
    """An HTTP endpoint serving one registry (``GET /metrics``, any path works) on a
    daemon thread.  ``close()`` (or leaving ``with``) stops it and frees the port;
    ``aclose()`` (or ``async with``) does it without blocking the event loop."""

    def __init__(self, collector: StoreCollector, port: int, addr: str) -> None:
        self.collector = collector
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self._httpd = make_server(addr, port, make_wsgi_app(self.registry),
                                  server_class=_Server6 if ":" in addr else _Server,
                                  handler_class=_QuietHandler)
        self.addr = addr
        self.port: int = self._httpd.server_port
        # close() waits for the serving loop to notice: poll often enough to stop quickly
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,),
                                        name="kvstore-metrics", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def serve(stores: AnyStore | Iterable[AnyStore], port: int = 0,
          addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the metrics of ``stores`` over HTTP at ``addr:port`` (``port=0``: a free
    port, see ``.port``), with a registry of their own.  Loopback by default: the
    numbers describe users' traffic; pass ``addr="0.0.0.0"`` to expose them.  Call from
    the stores' event loop, or pass ``BlockingStore`` objects."""
    return MetricsServer(StoreCollector(stores), port, addr)
