"""A module import held open on purpose, for tests of what a process forked meanwhile inherits.

`arm()` then importing `tests.import_gated` on a thread: that import stops inside the module (so the
thread holds the module's import lock) until `release()`. In any other process the gate is not armed
and the import finishes at once.
"""

from __future__ import annotations

import threading

_armed = False
entered = threading.Event()
_released = threading.Event()


def arm() -> None:
    global _armed
    _armed = True


def release() -> None:
    _released.set()


def hold() -> None:
    """Called by `tests.import_gated` as it is imported: waits for `release()` where the gate is armed."""
    if _armed:
        entered.set()
        _released.wait()
