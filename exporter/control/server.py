"""Serving the control app on a daemon thread (rank 0 only)."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from .app import WSGIApp

__all__ = ["ControlPortInUse", "ControlServer", "serve_control"]

logger = logging.getLogger("rankscope")


class ControlPortInUse(RuntimeError):
    """The control port is already taken."""


class _Handler(WSGIRequestHandler):
    # A client that stops sending mid-request releases its thread after this long.
    timeout = 10.0
    server_version = "rankscope-control"
    sys_version = ""
    # Answers to unparseable requests carry a status line (the stdlib's default, HTTP/0.9, has none).
    default_request_version = "HTTP/1.0"

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Requests too broken to reach the app (bad request line, too many headers) get the
        app's kind of answer too: a status and a one-line JSON reason."""
        self.close_connection = True
        reason = message or self.responses.get(code, ("error",))[0]
        if code >= 500:
            # The parser's only 5xx is 505 (an HTTP version it does not speak): retrying cannot help, and
            # our clients read a 5xx as "retry", so it is answered as the bad request it is.
            code = 400
        body = (json.dumps({"error": reason}) + "\n").encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        logger.debug("rankscope: control %s - %s", self.address_string(), format % args)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Slow or vanished clients are not worth a traceback on the trainer's stderr.
        logger.debug("rankscope: control connection from %s failed", client_address, exc_info=True)


@dataclass
class ControlServer:
    host: str
    port: int
    _server: _Server
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_control(app: WSGIApp, host: str, port: int) -> ControlServer:
    """Serve `app` on host:port from a daemon thread; port 0 picks a free port."""
    server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in host else _Server
    try:
        server = server_class((host, port), _Handler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ControlPortInUse(
                f"control port {port} on {host} is already in use; stop the other process or change control.port"
            ) from None
        raise OSError(f"cannot serve the control endpoint on {host}:{port}: {exc.strerror or exc}") from None
    server.set_app(app)
    thread = threading.Thread(target=server.serve_forever, name="rankscope-control", daemon=True)
    thread.start()
    return ControlServer(host, server.server_address[1], server, thread)
