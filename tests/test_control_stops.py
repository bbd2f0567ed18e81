"""rankscope.control.stops: signal handling that never keeps a rank from exiting.

DataLoader workers ignore SIGTERM while the rank handles stop signals (the rank decides when to stop),
so multiprocessing's SIGTERM to its daemon children at interpreter exit cannot end them: a rank that an
uncaught exception ends while its DataLoader still runs would wait on them forever (until torchrun's
SIGKILL, 30 s later, or for ever outside torchrun). Real processes: a rank-like script, a real
DataLoader with a forked worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support import REPO

RANK = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader

    from rankscope.control.stops import StopSignals, ignore_stop_signals

    stops = StopSignals()  # as a ControlChannel installs it on every rank
    loader = DataLoader(list(range(1000)), batch_size=1, num_workers=1, worker_init_fn=ignore_stop_signals)
    batches = iter(loader)  # held, as a trainer holds its epoch's iterator: alive until the interpreter exits
    for batch in batches:
        if int(batch) == 3:
            raise RuntimeError("a bug in the loop")  # uncaught
    """
)


def test_a_rank_ended_by_an_uncaught_exception_exits_although_its_workers_ignore_sigterm() -> None:
    try:
        result = subprocess.run([sys.executable, "-c", RANK], cwd=REPO, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("the process did not exit: it waits on DataLoader workers that ignore SIGTERM") from None
    assert result.returncode == 1 and "a bug in the loop" in result.stderr, result.stderr[-2000:]
    assert "is killed by signal" not in result.stderr, result.stderr[-2000:]  # the bug stays the last word


def test_sigterm_reaches_a_thread_and_an_earlier_wakeup_fd_still_hears_every_signal():
    # Real signals to this process. The watcher hears SIGTERM on its own thread (what a rank whose main thread
    # is blocked in a collective needs), once; a wakeup fd set before it (asyncio's) still gets every byte.
    import os
    import signal
    import socket
    import threading

    from rankscope.control.stops import StopSignals

    heard = threading.Event()
    threads: list[str] = []

    def react() -> None:
        threads.append(threading.current_thread().name)
        heard.set()

    earlier_reader, earlier = socket.socketpair()
    earlier.setblocking(False)
    before = signal.set_wakeup_fd(earlier.fileno())
    stops = StopSignals(on_sigterm=react)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert heard.wait(10), "the watcher never heard SIGTERM"
        assert threads == ["rankscope-stop-deadline"]
        assert stops.flags()[0] == 1  # the handler noted it too, for the next step boundary
        earlier_reader.settimeout(10)
        assert signal.SIGTERM in earlier_reader.recv(16)
    finally:
        stops.close()
        assert signal.set_wakeup_fd(before) == earlier.fileno()  # put back as found
        earlier_reader.close()
        earlier.close()


def test_a_forked_child_does_not_speak_for_its_parent():
    # A DataLoader worker is forked with the parent's wakeup fd: its own SIGTERM (multiprocessing's at exit)
    # must not read as the rank's. The watcher forwards every byte it reads, in order, to the wakeup fd set
    # before it: the parent's own SIGUSR1 after the child's exit comes through with no SIGTERM before it.
    import os
    import signal
    import socket
    import threading

    from rankscope.control.stops import StopSignals

    heard = threading.Event()
    earlier_reader, earlier = socket.socketpair()
    earlier.setblocking(False)
    before = signal.set_wakeup_fd(earlier.fileno())
    usr1 = signal.signal(signal.SIGUSR1, lambda *_: None)  # a Python handler: its number reaches the wakeup fd
    stops = StopSignals(on_sigterm=heard.set)
    try:
        child = os.fork()
        if child == 0:  # our handler ignores the signal in a child; the C handler writes the byte regardless
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        earlier_reader.settimeout(10)
        received = b""
        while signal.SIGUSR1 not in received:
            received += earlier_reader.recv(16)
        assert signal.SIGTERM not in received and not heard.is_set(), received
    finally:
        stops.close()
        signal.signal(signal.SIGUSR1, usr1)
        signal.set_wakeup_fd(before)
        earlier_reader.close()
        earlier.close()


def test_a_watcher_closed_off_the_main_thread_keeps_the_wakeup_fd_it_cannot_unset_open() -> None:
    """Off the main thread the C-level wakeup fd cannot be put back: closing its socket would free the fd number
    for the next file opened, and the next signal would write a byte into that file."""
    import os
    import signal
    import threading

    from rankscope.control.stops import SignalWatcher

    previous = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(previous)
    watcher = SignalWatcher(signal.SIGUSR2, lambda: None)
    closer = threading.Thread(target=watcher.close)
    closer.start()
    closer.join(10)
    current = signal.set_wakeup_fd(previous)  # on the main thread: put back what was there before the watcher
    try:
        assert current >= 0 and current != previous
        os.fstat(current)  # still open: a signal's byte lands in the watcher's own socket, not a stranger's file
    finally:
        watcher.close()  # on the main thread now: closes what it kept open
