"""Serving the control app from background threads (rank 0 only).

The server is rankscope.serving.http_server's: a fixed number of threads (an I/O thread and two workers),
read timeouts, a connection cap, and sockets that forked children (DataLoader workers) do not
keep. The app decides every answer in its own order of checks; the server adds one: a body that
does not arrive within `timeout` seconds of its headers is answered 408 (Request Timeout), a
client's fault, not a 500.
"""

from __future__ import annotations

import errno
import json
import logging
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any

from rankscope.control.app import WSGIApp
from rankscope.serving.http_server import Body, Handler, HttpServer, Request, Response, listen

__all__ = ["ControlPortInUse", "ControlServer", "serve_control"]

logger = logging.getLogger("rankscope")

#: Seconds a client gets to send its request head, and again its body.
READ_TIMEOUT = 5.0
#: Open connections at most (Alertmanager, an HA pair's second one, an operator's CLI).
MAX_CONNECTIONS = 32


class ControlPortInUse(RuntimeError):
    """The control port is already taken."""


@dataclass
class ControlServer:
    host: str
    port: int
    _server: HttpServer

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.close()


def _json_error(status: int, message: str) -> Response:
    """Requests the app never sees (a broken head, a full queue, a late body) get the app's kind
    of answer: a status and a one-line JSON reason."""
    body = (json.dumps({"error": message}) + "\n").encode("utf-8")
    return Response(status, body, [("Content-Type", "application/json")], close=True)


def _environ(request: Request, body: Body, server: tuple[str, int]) -> dict[str, Any]:
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
        "wsgi.url_scheme": "http",
        "wsgi.input": body,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    for name, value in request.headers.items():
        if name == "content-type":
            environ["CONTENT_TYPE"] = value
        elif name == "content-length":
            environ["CONTENT_LENGTH"] = value
        elif "_" not in name:  # as wsgiref: X_Token must not pass for X-Token
            environ["HTTP_" + name.upper().replace("-", "_")] = value
    return environ


def _wsgi_handler(app: WSGIApp, server: tuple[str, int], timeout: float) -> Handler:
    def handle(request: Request, body: Body) -> Response:
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, headers]
            return lambda data: None  # the app returns its body; it never writes

        result = app(_environ(request, body, server), start_response)
        try:
            payload = b"".join(result)
        finally:
            if hasattr(result, "close"):
                result.close()
        status, headers = int(started[0].split(" ", 1)[0]), started[1]
        logger.debug("rankscope: control %s - %s %s %d", request.client[0], request.method, request.path, status)
        if body.timed_out and status == 400:
            # The app found the body short (its 400) because the client stopped sending: say so.
            return _json_error(
                408, f"the body did not arrive within {timeout:g} s ({body.received} of {body.length} bytes)"
            )
        return Response(status, payload, [(k, v) for k, v in headers if k.lower() != "content-length"])

    return handle


def serve_control(app: WSGIApp, host: str, port: int, *, timeout: float = READ_TIMEOUT) -> ControlServer:
    """Serve `app` on host:port from background threads; port 0 picks a free port."""
    try:
        sock = listen(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ControlPortInUse(
                f"control port {port} on {host} is already in use; stop the other process or change control.port"
            ) from None
        raise OSError(f"cannot serve the control endpoint on {host}:{port}: {exc.strerror or exc}") from None
    address = sock.getsockname()
    server = HttpServer(
        sock,
        _wsgi_handler(app, (host, address[1]), timeout),
        _json_error,
        name="rankscope-control",
        max_connections=MAX_CONNECTIONS,
        timeout=timeout,
    )
    return ControlServer(host, address[1], server)
