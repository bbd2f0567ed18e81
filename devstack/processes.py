"""Child processes of the stack launcher (and of the tests and benchmarks that start servers):
start them, watch them, stop every one.

Each child starts in its own session, so a Ctrl-C in the terminal reaches only
the launcher, which then stops the children in order (trainer first, so it can
checkpoint, then Alertmanager and Prometheus). torchrun starts its workers in
sessions of their own too, so stopping a child also sweeps up any descendant
still alive after the grace period.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

__all__ = ["Child", "Children", "StackError", "find_binaries", "find_binary"]


class StackError(RuntimeError):
    """A component of the stack could not start or died; the message is one line for the user."""


def find_binaries(*names: str, hint: str) -> list[str]:
    """Paths of system binaries; StackError (one line naming every missing one, and `hint`: how to install them)."""
    found = [shutil.which(name) for name in names]
    missing = [name for name, path in zip(names, found, strict=True) if path is None]
    if missing:
        raise StackError(f"{' and '.join(missing)} not found on PATH; {hint}")
    return [path for path in found if path is not None]


def find_binary(name: str, hint: str) -> str:
    """Path of a system binary; StackError (one line, `hint`: how to install it) when it is missing."""
    return find_binaries(name, hint=hint)[0]


@dataclass
class Child:
    """One started process and where its output goes (None: the launcher's terminal)."""

    name: str
    popen: subprocess.Popen
    log_path: Path | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class Children:
    """The processes one launcher started, stopped in reverse start order."""

    def __init__(self) -> None:
        self._children: list[Child] = []

    def __iter__(self):
        return iter(list(self._children))

    def start(self, name: str, argv: Sequence[str], *, log_path: Path | None = None, cwd: Path | None = None) -> Child:
        log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - closed in stop()
        try:
            popen = subprocess.Popen(
                list(argv), cwd=cwd, stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True
            )
        except OSError as exc:
            if log is not None:
                log.close()
            raise StackError(f"cannot start {name} ({argv[0]}): {exc.strerror or exc}") from None
        child = Child(name, popen, log_path, log)
        self._children.append(child)
        return child

    def wait_http_ok(self, child: Child, url: str, timeout: float) -> None:
        """Poll `url` until it answers 200; fail early, with the child's log, if the child exits."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if child.popen.poll() is not None:
                raise StackError(
                    f"{child.name} exited with code {child.popen.returncode} while starting; "
                    f"log {child.log_path}:\n{child.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except (urllib.error.URLError, OSError) as exc:
                last = str(getattr(exc, "reason", exc))
            time.sleep(0.2)  # polling interval of a readiness probe, not synchronisation
        raise StackError(f"{child.name} not ready at {url} after {timeout:.0f}s ({last}); log {child.log_path}")

    def stop(self, child: Child, timeout: float) -> int | None:
        """SIGTERM the child's process group, then SIGKILL whatever of it and its descendants remains."""
        descendants = _descendants(child.pid)
        if child.popen.poll() is None:
            _signal_group(child.pid, signal.SIGTERM)
            try:
                child.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(child.pid, signal.SIGKILL)
                child.popen.wait()
        # torchrun's workers live in their own sessions: make sure none outlives it.
        leftovers = [p for p in descendants if p.is_running()]
        for proc in leftovers:
            proc.terminate()
        _, alive = psutil.wait_procs(leftovers, timeout=min(timeout, 10))
        for proc in alive:
            proc.kill()
        if child._log is not None:
            child._log.close()
        return child.popen.returncode

    def stop_all(self, timeouts: dict[str, float], default: float = 10.0) -> None:
        for child in reversed(self._children):
            self.stop(child, timeouts.get(child.name, default))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # The child is its session's (and process group's) leader: its pid is the group id.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
