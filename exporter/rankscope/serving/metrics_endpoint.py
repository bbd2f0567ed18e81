"""Serving one rank's /metrics page on its own port.

Rank with local rank r listens on base_port + r, so several ranks on one host
never collide. A port that is taken is a loud, named error (or, if asked for,
a logged fallback to the next ports): never a silently missing rank.

The server (rankscope.serving.http_server) has a fixed number of threads, read timeouts and a
connection cap, so abusive clients cannot stall training; its sockets are not
inherited by forked children (DataLoader workers). The page is rendered by
rankscope.serving.exposition and cached for `page_cache_seconds` (MonitorConfig), so
however often it is scraped, the page is rendered, and the probes run, at most
once per period. Paths: /metrics (and /) the page, /-/healthy a liveness check.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from rankscope._log import LogOnce
from rankscope.serving.exposition import CONTENT_TYPE, CachedPage, PageRenderer
from rankscope.serving.http_server import Body, Handler, HttpServer, Request, Response, listen

__all__ = ["MetricsPortInUse", "MetricsServer", "serve_metrics"]

logger = logging.getLogger("rankscope")

#: Seconds a client gets to send its request (and a kept-alive connection may stay idle).
READ_TIMEOUT = 5.0
#: Open connections at most; past it the longest-waiting one is closed. Scrapers need one each.
MAX_CONNECTIONS = 64


class MetricsPortInUse(RuntimeError):
    """The metrics port (and every allowed fallback) is already taken."""


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: HttpServer

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.close()


def _text(status: int, message: str) -> Response:
    return Response(status, (message + "\n").encode("utf-8"), [("Content-Type", "text/plain; charset=utf-8")])


def _accepts_gzip(header: str) -> bool:
    for part in header.split(","):
        coding, _, params = part.partition(";")
        if coding.strip().lower() == "gzip":
            q = params.strip().lower()
            return not q.startswith("q=") or q[2:].strip() not in ("0", "0.0", "0.00", "0.000")
    return False


def _page_response(content: bytes, gzip: bool) -> Response:
    headers = [("Content-Type", CONTENT_TYPE)] + ([("Content-Encoding", "gzip")] if gzip else [])
    return Response(200, content, headers)


def _other(request: Request) -> Response | None:
    """The answer to anything but a page request (None for a page request)."""
    if request.path not in ("/metrics", "/", "/-/healthy"):
        return _text(404, f"no page at {request.path[:100]}; the metrics are at /metrics")
    if request.method not in ("GET", "HEAD"):
        return Response(405, b"use GET\n", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")])
    if request.path == "/-/healthy":
        return _text(200, "OK")
    return None


def _handlers(page: CachedPage) -> tuple[Handler, Callable[[Request], Response | None]]:
    """(the worker's handler, which may render; the I/O thread's, which only serves a fresh page)."""
    log = LogOnce()

    def handle(request: Request, body: Body) -> Response:
        answer = _other(request)
        if answer is not None:
            return answer
        gzip = _accepts_gzip(request.headers.get("accept-encoding", ""))
        try:
            return _page_response(page.get(compressed=gzip), gzip)
        except Exception as exc:  # a broken collector: say so, and keep serving
            log.warning(type(exc).__name__, "rankscope: rendering /metrics failed (logged once): %r", exc)
            return _text(500, f"cannot render the page: {exc!r}"[:300])

    def fast(request: Request) -> Response | None:
        answer = _other(request)
        if answer is not None:
            return answer
        gzip = _accepts_gzip(request.headers.get("accept-encoding", ""))
        content = page.peek(compressed=gzip)
        return None if content is None else _page_response(content, gzip)

    return handle, fast


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    fallback: int = 0,
    who: str = "",
    *,
    page_cache_seconds: float = 1.0,
    timeout: float = READ_TIMEOUT,
) -> MetricsServer:
    """Serve `registry` from background threads; port 0 picks a free port.

    The page is cached for `page_cache_seconds` (0: rendered on every scrape)."""
    page = CachedPage(PageRenderer(registry).render, page_cache_seconds)
    attempts = [port] if port == 0 else list(range(port, min(port + fallback, 65535) + 1))
    for candidate in attempts:
        try:
            sock = listen(host, candidate)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise OSError(f"{who}cannot serve metrics on {host}:{candidate}: {exc.strerror}") from None
            continue
        handle, fast = _handlers(page)
        server = HttpServer(
            sock, handle, _text, name="rankscope-metrics", fast=fast, max_connections=MAX_CONNECTIONS, timeout=timeout
        )
        actual = server.address[1]
        if candidate != port and port != 0:
            logger.warning("rankscope: %smetrics port %d was taken; serving on %d instead", who, port, actual)
        return MetricsServer(host, actual, server)
    tried = f"ports {attempts[0]}-{attempts[-1]}" if len(attempts) > 1 else f"port {port}"
    raise MetricsPortInUse(
        f"{who}metrics {tried} on {host} already in use; stop the other process, "
        "or change metrics.base_port (or allow metrics.port_fallback)",
    )
