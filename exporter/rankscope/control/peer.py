"""The small endpoint every rank other than 0 serves, for rank 0 alone: its stacks, and leaving on `restart`.

    GET  /healthz          liveness (no token)
    GET  /v1/stacks        this rank's Python stacks, every thread (control token)
    POST /v1/exit          write nothing more, leave with RESTART_EXIT_STATUS (control token)

It answers from its own threads, so a rank whose training thread is hung still answers. It needs the
same bearer token as rank 0's endpoint (401 without, 403 with a wrong one, and the refusal says
nothing about the rank); the metrics page never shows stacks. It listens on `control.host`, on a
port the system picks, and rank 0 learns every rank's address when the channel starts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rankscope.control.actions import _short
from rankscope.control.app import _REASONS, WSGIApp, _Answer, _authorize
from rankscope.control.restart import RESTART_EXIT_STATUS
from rankscope.control.stacks import InFlightReader, own_stacks
from rankscope.exits import end_all

__all__ = ["PEER_ROUTES", "create_peer_app"]

logger = logging.getLogger("rankscope")

PEER_ROUTES: dict[str, tuple[str, ...]] = {"/healthz": ("GET",), "/v1/stacks": ("GET",), "/v1/exit": ("POST",)}
#: Seconds between answering an exit request and leaving, so the answer goes out.
_EXIT_DELAY = 0.2


def create_peer_app(
    rank: int, token: str | None, leave: Callable[[int], None] = os._exit, in_flight: InFlightReader | None = None
) -> WSGIApp:
    """The WSGI app of rank `rank`'s peer endpoint; `leave(status)` ends the process; `in_flight` reads the
    collective the rank has in flight, handed over with its stacks."""

    def handle(environ: dict[str, Any]) -> _Answer:
        path = environ.get("PATH_INFO", "") or "/"
        methods = PEER_ROUTES.get(path)
        if methods is None:
            return _Answer(404, {"error": f"no such route {_short(path)}"})
        if environ.get("REQUEST_METHOD", "") not in methods:
            return _Answer(405, {"error": f"use {', '.join(methods)} on {path}"}, [("Allow", ", ".join(methods))])
        if path == "/healthz":
            return _Answer(200, {"status": "ok"})
        _authorize(token, environ.get("HTTP_AUTHORIZATION"))
        if path == "/v1/stacks":
            return _Answer(200, own_stacks(rank, in_flight))
        logger.warning("rankscope: rank %d: restart requested by rank 0; exiting with status %d", rank,
                       RESTART_EXIT_STATUS)  # fmt: skip
        threading.Thread(target=_leave_soon, args=(leave,), name="rankscope-exit", daemon=True).start()
        return _Answer(202, {"rank": rank, "exit_status": RESTART_EXIT_STATUS})

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            answer = handle(environ)
        except _Answer as refused:
            answer = refused
        payload = (json.dumps(answer.body) + "\n").encode("utf-8")
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload))), *answer.headers]
        start_response(f"{answer.status} {_REASONS[answer.status]}", headers)
        return [payload]

    return app


def _leave_soon(leave: Callable[[int], None]) -> None:
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    time.sleep(_EXIT_DELAY)
    end_all("restart")  # os._exit runs no atexit hook: say so, or the next process calls this one vanished
    leave(RESTART_EXIT_STATUS)
