"""Serving the control app from background threads (rank 0 only).

The app is served by rankscope.serving.wsgi, as the metrics page is: a fixed number of threads (an
I/O thread and two workers), read timeouts, a connection cap, sockets that forked children
(DataLoader workers) do not keep, and TLS with client certificates from the web configuration
file. The app decides every answer in its own order of checks; the server adds the refusals of
requests the app never sees (400 malformed, 408 late, 413/414/431 too large, 501 unsupported
framing, 503 too many at once), as JSON with a one-line reason.
"""

from __future__ import annotations

import errno
import json
import logging

from rankscope.serving.http_server import Response
from rankscope.serving.webconfig import WebConfig
from rankscope.serving.wsgi import Endpoint, WSGIApp, serve_app, warn_if_exposed

__all__ = ["ControlPortInUse", "ControlServer", "serve_control"]

logger = logging.getLogger("rankscope")

#: Seconds a client gets to send its request head, and again its body.
READ_TIMEOUT = 5.0
#: Open connections at most (Alertmanager, an HA pair's second one, an operator's CLI).
MAX_CONNECTIONS = 32

ControlServer = Endpoint


class ControlPortInUse(RuntimeError):
    """The control port is already taken."""


def _json_error(status: int, message: str) -> Response:
    """Requests the app never sees (a broken head, a full queue, a late body) get the app's kind
    of answer: a status and a one-line JSON reason."""
    body = (json.dumps({"error": message}) + "\n").encode("utf-8")
    return Response(status, body, [("Content-Type", "application/json")], close=True)


def serve_control(
    app: WSGIApp, host: str, port: int, *, timeout: float = READ_TIMEOUT, web: WebConfig | None = None
) -> ControlServer:
    """Serve `app` on host:port from background threads; port 0 picks a free port."""
    web = web or WebConfig()
    if web.basic_auth is not None:
        logger.warning("rankscope: the control endpoint ignores basic_auth_users: it is guarded by its bearer token")
    try:
        server = serve_app(
            app,
            host,
            [port],
            name="rankscope-control",
            error_page=_json_error,
            web=web,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout,
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ControlPortInUse(
                f"control port {port} on {host} is already in use; stop the other process or change control.port"
            ) from None
        raise OSError(f"cannot serve the control endpoint on {host}:{port}: {exc.strerror or exc}") from None
    # The bearer token authenticates every request but /healthz; without TLS it crosses the network in clear.
    warn_if_exposed("the control endpoint", host, web, authenticated=False)
    return server
