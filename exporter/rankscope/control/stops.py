"""Reasons to stop that do not come over HTTP: SIGTERM/SIGINT, and a torchrun agent that is gone.

`docker compose stop`, Kubernetes and SLURM preemption send SIGTERM (torchrun forwards it to every
rank's process group); Ctrl-C sends SIGINT. Either means "checkpoint, then stop": the handler only
notes the signal, and at the next step boundary the ranks agree (any rank's signal counts for all)
and every rank stops at the same step after one checkpoint. A second SIGINT interrupts at once.

A rank whose torchrun agent died (`kill -9` of torchrun) is re-parented; it notices at the next
boundary (its parent process id changed) and stops the same way instead of training on alone.

DataLoader workers forked from the rank inherit the handler; in them it does nothing (the rank
decides), so the SIGTERM that torchrun sends to the whole process group no longer kills them.
Workers started with `spawn` or `forkserver` do not inherit it: call :func:`ignore_stop_signals`
from their `worker_init_fn`. Workers that ignore SIGTERM cannot be ended by the SIGTERM that
multiprocessing sends its daemon children at interpreter exit, so a rank that an exception ends
(a lost peer, a bug) before its DataLoader shut them down would wait on them forever: at exit,
the rank's daemon children get multiprocessing's SIGTERM, then SIGKILL after a second.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

__all__ = ["StopSignals", "ignore_stop_signals"]

#: The signals noted, in the order of `StopSignals.flags()`.
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
#: What each flag of `StopSignals.flags()` means, as the stop's reason.
REASONS: tuple[str, ...] = ("signal:SIGTERM", "signal:SIGINT", "signal:agent-gone")


def ignore_stop_signals(*_: Any) -> None:
    """Ignore SIGTERM and SIGINT in this process (a DataLoader worker): the rank that owns it stops it.

    Usable as `DataLoader(..., worker_init_fn=ignore_stop_signals)`."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopSignals:
    """SIGTERM/SIGINT received by this process, and whether its torchrun agent is gone.

    The signal handler runs on the main thread between two bytecodes of whatever it was doing, so it
    only sets a flag; the step boundary reads it.
    """

    def __init__(self, handle_signals: bool = True, watch_agent: bool = True) -> None:
        self._pid = os.getpid()
        self._received: set[signal.Signals] = set()
        self._previous: dict[signal.Signals, Any] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            _kill_data_loader_workers_at_exit()
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
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()


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
