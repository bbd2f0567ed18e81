"""The data loader's fork server, forked from the rank itself after its imports and before its first thread.

The training loader starts its workers from a fork server (`rankscope_trainer.data.worker_context` says why
never from the rank). Python's fork server is a fresh interpreter that imports the data module, torch and
torchvision with it, before it can fork the first worker: about 4 s of CPU on every start and every restart of
every rank, on the path to the first step (5 s of each 13 s restart of the fault campaign's 2-rank job on 2
cores). A fork of the rank taken when its imports are done and before it starts a thread has every module
already, and no lock a Python thread could hold: the same state the stock server reaches, minus the import
(the one native thread then is OpenBLAS's, started by numpy's import, which parks itself across a fork, as it
does for the forked DataLoader workers of most PyTorch jobs).

It runs the standard library's own server loop (`multiprocessing.forkserver.main`) and is registered as the
process's fork server, so `multiprocessing.get_context("forkserver")` uses it unchanged: the workers, their
seeds and their data are the same as from the stock server (tests/test_trainer_fork_server.py compares them).
It ends as the stock one does, when the rank and the workers it forked have ended. That registration uses
private attributes of `multiprocessing.forkserver` (the same in Python 3.10 to 3.13, read in their sources);
where they differ (3.14 authenticates its clients) or a thread already runs, nothing is forked and the stock
server starts as before.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import sys
import threading
from multiprocessing import connection, forkserver, util
from typing import Any

__all__ = ["start_fork_server"]

logger = logging.getLogger("rankscope_trainer")

#: The private attributes this module sets, as Python 3.10 to 3.13 name them.
_SERVER_ATTRIBUTES = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")


def _why_not() -> str | None:
    """Why this process cannot fork its fork server now, or None when it can."""
    if sys.platform != "linux":
        return f"fork servers are forked here on Linux only, not {sys.platform}"
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} thread(s) besides the main one run already"
    server = getattr(forkserver, "_forkserver", None)
    if server is None or not all(hasattr(server, name) for name in _SERVER_ATTRIBUTES):
        return "this Python's multiprocessing.forkserver keeps its server elsewhere"
    if hasattr(server, "_forkserver_authkey") or list(inspect.signature(forkserver.main).parameters)[:3] != [
        "listener_fd", "alive_r", "preload",
    ]:  # fmt: skip
        return "this Python's fork server authenticates its clients or takes other arguments"
    if server._forkserver_pid is not None:
        return "a fork server runs already"
    return None


def start_fork_server() -> int | None:
    """Fork this process's fork server now; its pid, or None (and why, at debug level) where it cannot be,
    in which case `multiprocessing` starts the stock server on the first worker as before."""
    why = _why_not()
    if why is not None:
        logger.debug("data loader fork server not forked from the rank: %s", why)
        return None
    server: Any = forkserver._forkserver  # private: see the module's docstring
    util._flush_std_streams()  # type: ignore[attr-defined]  # else the workers write the rank's buffered output again
    with socket.socket(socket.AF_UNIX) as listener:
        # As ForkServer.ensure_running sets up the stock server's socket and liveness pipe.
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every client (the rank, each worker) holds the write end; the server ends when all have closed it.
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: its loop, then out, never back into the rank's code
            code = 1
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:  # the loop's way out: every client is gone
                code = 0
            except BaseException:
                sys.excepthook(*sys.exc_info())
            finally:
                os._exit(code)
        os.close(alive_r)
    with server._lock:
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return pid
