"""Serving a WSGI application on rankscope.serving.http_server: what both endpoints share.

    endpoint = serve_app(app, "127.0.0.1", [9300], name="rankscope-control", error_page=json_error,
                         web=load_web_config(path))
    endpoint.url, endpoint.port
    endpoint.close()

The metrics page and the control endpoint are both WSGI apps served the same way: one server
loop (fixed threads, deadlines, connection cap, no inherited sockets), TLS and client certificates
from the endpoint's web configuration file, the app's own status line (reason phrase included) on
the wire. Binding beyond loopback without TLS or authentication is logged once per process.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rankscope.serving.http_server import Body, ErrorPage, Handler, HttpServer, Request, Response, listen
from rankscope.serving.webconfig import WebConfig

__all__ = ["Endpoint", "WSGIApp", "environ_for", "serve_app", "wsgi_handler"]

logger = logging.getLogger("rankscope")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass
class Endpoint:
    """A served app: where it listens, and how to stop it."""

    host: str
    port: int
    scheme: str
    _server: HttpServer
    path: str = ""

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    @property
    def server(self) -> HttpServer:
        return self._server

    def close(self) -> None:
        self._server.close()


def environ_for(request: Request, body: Body, server: tuple[str, int]) -> dict[str, Any]:
    """The WSGI environ of a request (PEP 3333), plus `rankscope.peer_cert` (the client's verified certificate)."""
    environ: dict[str, Any] = {
        "REQUEST_METHOD": request.method,
        "SCRIPT_NAME": "",
        "PATH_INFO": urllib.parse.unquote(request.path, "iso-8859-1"),
        "QUERY_STRING": request.query,
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": request.version,
        "REMOTE_ADDR": str(request.client[0]) if request.client else "",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "https" if request.tls else "http",
        "wsgi.input": body,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "rankscope.peer_cert": request.peer_cert,
    }
    for name, value in request.headers.items():
        if name == "content-type":
            environ["CONTENT_TYPE"] = value
        elif name == "content-length":
            environ["CONTENT_LENGTH"] = value
        elif "_" not in name:  # as wsgiref: X_Token must not pass for X-Token
            environ["HTTP_" + name.upper().replace("-", "_")] = value
    return environ


def wsgi_handler(app: WSGIApp, server: tuple[str, int], error_page: ErrorPage, timeout: float) -> Handler:
    """The server's handler running `app`: its status line (code and reason) and headers as given."""

    def handle(request: Request, body: Body) -> Response:
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, headers]
            return lambda data: None  # the apps here return their body; they never write

        result = app(environ_for(request, body, server), start_response)
        try:
            payload = b"".join(result)
        finally:
            if hasattr(result, "close"):
                result.close()
        code, _, reason = started[0].partition(" ")
        status = int(code)
        if body.timed_out and status == 400:
            # The app found the body short (its 400) because the client stopped sending: say so.
            of = f" of {body.length}" if body.length is not None else ""
            return error_page(408, f"the body did not arrive within {timeout:g} s ({body.received}{of} bytes)")
        return Response(status, payload, list(started[1]), reason=reason.strip())

    return handle


_warned = threading.Event()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(what: str, host: str, web: WebConfig, authenticated: bool) -> None:
    """One line, once per process, when an endpoint listens beyond loopback in clear text without auth."""
    if _loopback(host) or web.tls is not None or authenticated or _warned.is_set():
        return
    _warned.set()
    logger.warning(
        "rankscope: %s listens on %s in plain HTTP without authentication; anyone on the network can read it "
        "(set a web config file with tls_server_config; see docs/security.md). Logged once per process.",
        what,
        host,
    )


def serve_app(
    app: WSGIApp,
    host: str,
    ports: list[int],
    *,
    name: str,
    error_page: ErrorPage,
    web: WebConfig | None = None,
    fast: Callable[[Request], Response | None] | None = None,
    max_connections: int = 64,
    timeout: float = 5.0,
    path: str = "",
) -> Endpoint:
    """Serve `app` on the first of `ports` that is free (port 0: any); OSError(EADDRINUSE) when none is."""
    web = web or WebConfig()
    for candidate in ports:
        try:
            sock = listen(host, candidate)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                continue
            raise
        port = sock.getsockname()[1]
        server = HttpServer(
            sock,
            wsgi_handler(app, (host, port), error_page, timeout),
            error_page,
            name=name,
            fast=fast,
            max_connections=max_connections,
            timeout=timeout,
            tls=web.tls,
        )
        return Endpoint(host, port, web.scheme, server, path)
    raise OSError(errno.EADDRINUSE, "address already in use")
