"""Serving one rank's /metrics page on its own port.

Rank with local rank r listens on base_port + r, so several ranks on one host
never collide. A port that is taken is a loud, named error (or, if asked for,
a logged fallback to the next ports): never a silently missing rank.
"""

from __future__ import annotations

import errno
import logging
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["MetricsPortInUse", "MetricsServer", "serve_metrics"]

logger = logging.getLogger("rankscope")


class MetricsPortInUse(RuntimeError):
    """The metrics port (and every allowed fallback) is already taken."""


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    fallback: int = 0,
    who: str = "",
) -> MetricsServer:
    """Serve `registry` on a daemon thread; port 0 picks a free port."""
    attempts = [port] if port == 0 else list(range(port, min(port + fallback, 65535) + 1))
    for candidate in attempts:
        try:
            server, thread = start_http_server(candidate, addr=host, registry=registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise OSError(f"{who}cannot serve metrics on {host}:{candidate}: {exc.strerror}") from None
            continue
        actual = server.server_address[1]
        if candidate != port and port != 0:
            logger.warning("rankscope: %smetrics port %d was taken; serving on %d instead", who, port, actual)
        return MetricsServer(host, actual, server, thread)
    tried = f"ports {attempts[0]}-{attempts[-1]}" if len(attempts) > 1 else f"port {port}"
    raise MetricsPortInUse(
        f"{who}metrics {tried} on {host} already in use; stop the other process, "
        "or change metrics.base_port (or allow metrics.port_fallback)",
    )
