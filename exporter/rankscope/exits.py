"""Which rank's previous process ended without a word (SIGKILL, the OOM killer, a crash in native code).

torchrun restarts the whole group when one process dies, within seconds: before a scrape can
tell the rank that died from the ones the agent stopped after it. The agent knows, but only its own log says.
So each rank keeps a small note in the run's state directory (beside the checkpoints, where the goodput
ledger is): "running" when its process starts, "ended: <how>" when it ends in any way Python sees (a clean
finish, a close, an exception reaching the interpreter's exit, a signal's stop, a control restart, a stop
deadline). A process killed outright writes nothing, so the next process of the same rank finds the note
still saying "running", and says so: `rankscope_previous_process_vanished_timestamp_seconds` (the time it
found out), which the rule pack turns into an alert naming the rank.

One file per rank (`rankscope-exits/rank-<N>.json`), written atomically (a rename), so ranks never share a
file. With a node-local state directory, a rank that comes back on another node finds no note and says
nothing: this can miss, never accuse.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ExitNote", "end_all"]

logger = logging.getLogger("rankscope")

DIRECTORY = "rankscope-exits"
_active: list[ExitNote] = []
_active_lock = threading.Lock()


class ExitNote:
    """This rank's note; `vanished` is the previous process's note when that process ended without a word."""

    def __init__(self, directory: str | os.PathLike[str], rank: int, run_id: str) -> None:
        self.path = Path(directory) / DIRECTORY / f"rank-{rank}.json"
        self.rank, self.run_id = rank, run_id
        self.vanished: dict[str, Any] | None = None
        self.found_at: float | None = None
        self._ended = False

    def begin(self) -> ExitNote:
        """Read the previous process's note, then write this one's "running"."""
        previous = self._read()
        # Only this run's: a new run in an old run's directory is not accused of the old one's deaths.
        if (previous is not None and previous.get("ended") is None and previous.get("pid") != os.getpid()
                and previous.get("run_id") == self.run_id):  # fmt: skip
            self.vanished, self.found_at = previous, time.time()
            logger.warning(
                "rankscope: rank %d's previous process (pid %s, started %s) ended without a word: killed "
                "(SIGKILL, the OOM killer) or crashed in native code",
                self.rank, previous.get("pid"), time.strftime("%H:%M:%S", time.localtime(previous.get("started", 0))),
            )  # fmt: skip
        self._write({"pid": os.getpid(), "run_id": self.run_id, "started": time.time(), "ended": None})
        with _active_lock:
            if not _active:
                atexit.register(end_all, "exit")  # an exception that reaches the interpreter's exit
            _active.append(self)
        return self

    def end(self, how: str) -> None:
        """Say how this process ends (idempotent: the first word stays)."""
        if self._ended:
            return
        self._ended = True
        note = self._read() or {"pid": os.getpid(), "run_id": self.run_id}
        note.update(ended=how, ended_at=time.time())
        with contextlib.suppress(OSError):  # a full or vanished disk must not turn an ending into a crash
            self._write(note)

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _write(self, note: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(note))
        partial.replace(self.path)


def end_all(how: str) -> None:
    """Every note of this process says how it ends: called on the paths that leave with os._exit (which runs
    no atexit hook) right before they leave, and at the interpreter's exit."""
    with _active_lock:
        notes = list(_active)
    for note in notes:
        note.end(how)
