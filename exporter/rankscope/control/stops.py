"""Reasons to stop that do not come over HTTP: SIGTERM/SIGINT, and a torchrun agent that is gone.

`docker compose stop`, Kubernetes and SLURM preemption send SIGTERM (torchrun forwards it to every
rank's process group); Ctrl-C sends SIGINT. Either means "checkpoint, then stop": the handler only
notes the signal, and at the next step boundary the ranks agree (any rank's signal counts for all)
and every rank stops at the same step after one checkpoint. A second SIGINT interrupts at once.

A rank whose torchrun agent died (`kill -9` of torchrun) is re-parented; it notices at the next
boundary (its parent process id changed) and stops the same way instead of training on alone.

A rank blocked in C (a collective waiting for a hung peer) runs no Python signal handler until the
call returns, which may be never. So SIGTERM is also seen by a thread: Python's C-level handler
writes the signal's number to the wakeup fd (`signal.set_wakeup_fd`) whatever the main thread is
doing, and the `SignalWatcher` thread reading it calls back (see `stop_deadline`). A wakeup fd set
before (asyncio's) still gets every byte; forked children (DataLoader workers) drop ours.

DataLoader workers forked from the rank inherit the handler; in them it does nothing (the rank
decides), so the SIGTERM that torchrun sends to the whole process group no longer kills them.
Workers started with `spawn` or `forkserver` do not inherit it: pass `worker_init_fn=WorkerInit()`
(created in the rank), which ignores the stop signals and ends a forkserver's worker with its rank.
Workers that ignore SIGTERM cannot be ended by the SIGTERM that multiprocessing sends its daemon
children at interpreter exit, so a rank that an exception ends (a lost peer, a bug) before its
DataLoader shut them down would wait on them forever: at exit, the rank's daemon children get
multiprocessing's SIGTERM, then SIGKILL after a second.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SignalWatcher", "StopSignals", "WorkerInit", "ignore_stop_signals"]

#: The signals noted, in the order of `StopSignals.flags()`.
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
#: What each flag of `StopSignals.flags()` means, as the stop's reason.
REASONS: tuple[str, ...] = ("signal:SIGTERM", "signal:SIGINT", "signal:agent-gone")


def ignore_stop_signals(*_: Any) -> None:
    """Ignore SIGTERM and SIGINT in this process (a DataLoader worker): the rank that owns it stops it.

    Usable as `DataLoader(..., worker_init_fn=ignore_stop_signals)`."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class WorkerInit:
    """A DataLoader `worker_init_fn` for workers that are not forked from the rank (`spawn`, `forkserver`).

    Create it in the rank (`DataLoader(..., worker_init_fn=WorkerInit())`): each worker ignores SIGTERM and
    SIGINT (:func:`ignore_stop_signals`) and ends when the rank that created it does, however the rank
    ended. A `forkserver` worker needs the second: it is the server's child, so torch's check that a
    worker's parent is alive watches the server, which outlives a rank killed with SIGKILL, and the worker
    would wait on its queue for ever, holding its memory.
    """

    def __init__(self) -> None:
        self.rank_pid = os.getpid()

    def __call__(self, worker_id: int = 0) -> None:
        ignore_stop_signals()
        _exit_with(self.rank_pid)


def _exit_with(pid: int) -> None:
    """End this process (at once: it is a worker whose work is gone) when process `pid` ends."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd (not Linux, or a kernel before 5.3): ask every second
        handle = None

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])  # readable once the process has ended
        else:
            while _alive(pid):
                time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="rankscope-rank-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, another user's (a pid reused after the rank ended)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class StopSignals:
    """SIGTERM/SIGINT received by this process, and whether its torchrun agent is gone.

    The signal handler runs on the main thread between two bytecodes of whatever it was doing, so it
    only sets a flag; the step boundary reads it.
    """

    def __init__(
        self,
        handle_signals: bool = True,
        watch_agent: bool = True,
        on_sigterm: Callable[[], None] | None = None,
    ) -> None:
        """`on_sigterm`: called once, on a thread of its own, when SIGTERM arrives, even while the main thread
        is blocked in C (see `SignalWatcher`)."""
        self._pid = os.getpid()
        self._received: set[signal.Signals] = set()
        self._previous: dict[signal.Signals, Any] = {}
        self._watcher: SignalWatcher | None = None
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            _kill_data_loader_workers_at_exit()
            if on_sigterm is not None:
                self._watcher = SignalWatcher(signal.SIGTERM, on_sigterm)
        # Under torchrun the parent is the agent; elsewhere the parent (a shell) is not ours to watch.
        self._agent = os.getppid() if watch_agent and "TORCHELASTIC_RUN_ID" in os.environ else None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a forked DataLoader worker: its rank received the signal too and stops it
        sig = signal.Signals(signum)
        if sig == signal.SIGINT and sig in self._received:
            signal.signal(sig, signal.default_int_handler)
            raise KeyboardInterrupt  # a second Ctrl-C: the person does not want to wait
        self._received.add(sig)

    def flags(self) -> list[int]:
        """[SIGTERM received, SIGINT received, agent gone], as 0/1 for an all-reduce."""
        agent_gone = self._agent is not None and os.getppid() != self._agent
        return [int(sig in self._received) for sig in SIGNALS] + [int(agent_gone)]

    def close(self) -> None:
        """Put back the handlers found at start (where ours is still the one installed)."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()


class SignalWatcher:
    """Calls `react` once, on a thread of its own, when this process gets `watched`, whatever its main thread is
    doing: a thread reads the wakeup fd that Python's C-level handler writes each signal's number to (only
    signals with a Python handler installed). Built and closed on the main thread."""

    def __init__(self, watched: signal.Signals, react: Callable[[], None]) -> None:
        self._watched, self._react = int(watched), react
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # set_wakeup_fd requires it: a handler must never block
        self._previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        _watching.add(self._writer.fileno())
        self._closed = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._run, name="rankscope-signal-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._reader.recv(256)
            except OSError:
                return
            if not data or self._closed.is_set():
                return
            if self._previous >= 0:  # whoever set a wakeup fd before us still hears of every signal
                with contextlib.suppress(OSError):
                    os.write(self._previous, data)
            if self._watched in data and not self._fired:
                self._fired = True
                threading.Thread(target=self._react, name="rankscope-stop-deadline", daemon=True).start()

    def close(self) -> None:
        """End the thread, put back the wakeup fd found at start (where ours is still the one set) and close the
        sockets. Off the main thread the fd cannot be put back: the sockets then stay open (closing the one the C
        handler still writes to would hand its number to the next file opened, and a signal would write into
        that file) until a close on the main thread, or the process's end."""
        if not self._closed.is_set():
            self._closed.set()
            _watching.discard(self._writer.fileno())
            with contextlib.suppress(OSError):
                self._writer.send(b"\0")
            self._thread.join(timeout=1)
        if self._writer.fileno() < 0:  # closed already
            return
        try:
            current = signal.set_wakeup_fd(self._previous)
        except ValueError:  # not the main thread
            return
        if current != self._writer.fileno():
            signal.set_wakeup_fd(current)  # someone set theirs after ours: keep it
        self._reader.close()
        self._writer.close()


#: Write ends of the live watchers' wakeup fds (this process's).
_watching: set[int] = set()


def _drop_wakeup_fd_in_child() -> None:
    """A forked child (a DataLoader worker) shares our socket: its signals are not its parent's."""
    if not _watching:
        return
    with contextlib.suppress(ValueError, OSError):
        current = signal.set_wakeup_fd(-1)
        if current not in _watching:
            signal.set_wakeup_fd(current)
    _watching.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_wakeup_fd_in_child)

_registered_at_exit: set[int] = set()


def _kill_data_loader_workers_at_exit() -> None:
    """Once per process: at exit, before multiprocessing's own clean-up (atexit runs the newest first)."""
    if os.getpid() not in _registered_at_exit:
        _registered_at_exit.add(os.getpid())
        # multiprocessing.util registers its clean-up when first imported (often at the first worker's
        # start, after this): import it now, so ours is the newer registration and runs before it.
        import multiprocessing.util  # noqa: F401

        atexit.register(end_daemon_children)


def end_daemon_children(grace_seconds: float = 1.0) -> int:
    """What multiprocessing does to its daemon children at exit (SIGTERM), then SIGKILL for those still
    alive after `grace_seconds`: DataLoader workers ignore SIGTERM. Returns how many had to be killed."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    for child in children:
        child.terminate()
    killed = 0
    deadline = time.monotonic() + grace_seconds  # one grace for all: eight stubborn workers wait 1 s, not 8
    for child in children:
        child.join(timeout=max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCHLD"):
                # torch's SIGCHLD handler reports a killed worker as an error: at exit it is the intent.
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            child.kill()
            child.join(timeout=5)
            killed += 1
    return killed


def first_reason(flags: list[int]) -> str | None:
    """The reason of the first raised flag, or None."""
    return next((reason for flag, reason in zip(flags, REASONS, strict=True) if flag), None)
