"""A webhook receiver on loopback that records every POST: a pager (or a trainer) for tests and benchmarks.

sink = WebhookSink()                     # listens on 127.0.0.1, a free port: sink.url
...                                      # point Alertmanager's receiver at it
delivery = sink.wait_for(lambda d: d.body["status"] == "firing", timeout=30)
sink.close()
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Delivery", "WebhookSink"]


@dataclass
class Delivery:
    """One webhook request received by a WebhookSink."""

    path: str
    authorization: str
    body: dict
    received_at: float = field(default_factory=time.time)
    """When it arrived (Unix seconds, this machine's clock)."""


class WebhookSink:
    """A tiny HTTP server standing in for a pager (or the trainer): it records every POST.

    Its condition is shared by the HTTP threads and the waiting caller.
    """

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self._changed = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with sink._changed:
                    sink.deliveries.append(Delivery(self.path, self.headers.get("Authorization", ""), body))
                    sink._changed.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self) -> list[Delivery]:
        with self._changed:
            return list(self.deliveries)

    def wait_for(
        self, predicate: Callable[[Delivery], bool], timeout: float, diagnose: Callable[[], str] = lambda: ""
    ) -> Delivery:
        """The first delivery matching `predicate`, waiting up to `timeout` seconds for it (AssertionError,
        with what did arrive, if none does)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((d for d in self.deliveries if predicate(d)), None)
                if found or time.monotonic() >= deadline:
                    break
                self._changed.wait(deadline - time.monotonic())
        if found is None:
            got = [(d.path, d.body) for d in self.received()]
            raise AssertionError(f"no matching delivery within {timeout}s; got {got}\n{diagnose()}")
        return found

    def wait_for_new(self, seen: int, timeout: float) -> list[Delivery]:
        """Deliveries after the first `seen`, waiting up to `timeout` seconds for one (may be empty)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.deliveries) <= seen and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            return list(self.deliveries[seen:])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
