"""Serving one rank's /metrics page on its own port.

Rank with local rank r listens on base_port + r, so several ranks on one host
never collide. A port that is taken is a loud, named error (or, if asked for,
a logged fallback to the next ports): never a silently missing rank.

The page is a WSGI app served by rankscope.serving.wsgi, as the control endpoint is (a fixed
number of threads, read timeouts, a connection cap, no sockets inherited by forked DataLoader
workers; TLS, client certificates and basic auth from the web configuration file). The page is
rendered by rankscope.serving.exposition and cached for `page_cache_seconds` (MonitorConfig), so
however often it is scraped, the page is rendered, and the probes run, at most once per period
(and never served older than the last state change). Paths: /metrics (and /) the page,
/-/healthy a liveness check (no authentication, as Prometheus's own).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry

from rankscope._log import LogOnce
from rankscope.serving.exposition import CONTENT_TYPE, CachedPage, PageRenderer, Publication
from rankscope.serving.http_server import Request, Response
from rankscope.serving.webconfig import BasicAuth, WebConfig
from rankscope.serving.wsgi import Endpoint, serve_app, warn_if_exposed

__all__ = ["MetricsPortInUse", "MetricsServer", "metrics_app", "serve_metrics"]

logger = logging.getLogger("rankscope")

#: Seconds a client gets to send its request (and a kept-alive connection may stay idle).
READ_TIMEOUT = 5.0
#: Open connections at most; past it the longest-waiting one is closed. Scrapers need one each.
MAX_CONNECTIONS = 64

MetricsServer = Endpoint


class MetricsPortInUse(RuntimeError):
    """The metrics port (and every allowed fallback) is already taken."""


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


def _route(method: str, path: str, authorization: str | None, auth: Callable[[str | None], bool]) -> Response | None:
    """The answer to anything but an authorized page request (None for one)."""
    if path not in ("/metrics", "/", "/-/healthy"):
        return _text(404, f"no page at {path[:100]}; the metrics are at /metrics")
    if method not in ("GET", "HEAD"):
        return Response(405, b"use GET\n", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")])
    if path == "/-/healthy":
        return _text(200, "OK")
    if not auth(authorization):
        return Response(
            401,
            b"basic authentication required\n",
            [("WWW-Authenticate", 'Basic realm="rankscope"'), ("Content-Type", "text/plain")],
        )
    return None


def metrics_app(page: CachedPage, basic_auth: BasicAuth | None = None) -> Callable[..., Iterable[bytes]]:
    """The /metrics WSGI app (it may render the page, and runs bcrypt for a credential it has not seen)."""
    log = LogOnce()
    check = basic_auth.check if basic_auth is not None else (lambda header: True)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        response = _route(environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("HTTP_AUTHORIZATION"), check)
        if response is None:
            gzip = _accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", ""))
            try:
                response = _page_response(page.get(compressed=gzip), gzip)
            except Exception as exc:  # a broken collector: say so, and keep serving
                log.warning(type(exc).__name__, "rankscope: rendering /metrics failed (logged once): %r", exc)
                response = _text(500, f"cannot render the page: {exc!r}"[:300])
        start_response(f"{response.status} {HTTPStatus(response.status).phrase}", response.headers)
        return [response.body]

    return app


def _fast(page: CachedPage, basic_auth: BasicAuth | None) -> Callable[[Request], Response | None]:
    """The I/O thread's answer: a fresh page or a refusal, never a render nor a bcrypt (None: a worker's job)."""
    cached = basic_auth.cached if basic_auth is not None else (lambda header: True)

    def fast(request: Request) -> Response | None:
        answer = _route(request.method, request.path, request.headers.get("authorization"), cached)
        if answer is not None:
            return None if answer.status == 401 else answer  # unknown credentials: bcrypt in a worker
        gzip = _accepts_gzip(request.headers.get("accept-encoding", ""))
        content = page.peek(compressed=gzip)
        return None if content is None else _page_response(content, gzip)

    return fast


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    fallback: int = 0,
    who: str = "",
    *,
    page_cache_seconds: float = 1.0,
    timeout: float = READ_TIMEOUT,
    web: WebConfig | None = None,
    consistent: Publication | None = None,
) -> MetricsServer:
    """Serve `registry` from background threads; port 0 picks a free port.

    The page is cached for `page_cache_seconds` (0: rendered on every scrape). `consistent`: the publication
    through which the recording side publishes values that belong together (see `PageRenderer`)."""
    web = web or WebConfig()
    page = CachedPage(PageRenderer(registry, consistent).render, page_cache_seconds)
    attempts = [port] if port == 0 else list(range(port, min(port + fallback, 65535) + 1))
    try:
        server = serve_app(
            metrics_app(page, web.basic_auth),
            host,
            attempts,
            name="rankscope-metrics",
            error_page=_text,
            web=web,
            fast=_fast(page, web.basic_auth),
            max_connections=MAX_CONNECTIONS,
            timeout=timeout,
            path="/metrics",
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            tried = f"ports {attempts[0]}-{attempts[-1]}" if len(attempts) > 1 else f"port {port}"
            raise MetricsPortInUse(
                f"{who}metrics {tried} on {host} already in use; stop the other process, "
                "or change metrics.base_port (or allow metrics.port_fallback)",
            ) from None
        raise OSError(f"{who}cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    if server.port != port and port != 0:
        logger.warning("rankscope: %smetrics port %d was taken; serving on %d instead", who, port, server.port)
    warn_if_exposed("the metrics endpoint", host, web, web.basic_auth is not None)
    return server
