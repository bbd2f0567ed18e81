"""A rank that stops because another rank is gone: recognised, and said in one line instead of a traceback.

The line goes out as soon as the loop fails, before its clean-up: torchrun SIGTERMs the surviving ranks the
moment it sees one gone, and once the clean-up has put back the default SIGTERM handler that signal ends the
rank mid-way, before anything printed after the clean-up.
"""

from __future__ import annotations

import sys

from torch.distributed import DistError

__all__ = ["lost_peer", "report_lost_peer"]


def lost_peer(exc: BaseException) -> bool:
    """A collective failed because another rank is gone: torch's DistError (NCCL, timeouts) or gloo's
    RuntimeError from its TCP transport (a peer that died closes its sockets)."""
    if isinstance(exc, DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    lost = ("Connection reset", "Connection closed", "Broken pipe")
    return "gloo" in message and any(word in message for word in lost)


def report_lost_peer(rank: int, exc: BaseException) -> None:
    """The one line, on stderr, flushed."""
    detail = " ".join(str(exc).split())[:160]
    print(f"trainer: rank {rank} stopped: lost contact with another rank ({detail}); "
          "the first error is in that rank's output", file=sys.stderr, flush=True)  # fmt: skip
