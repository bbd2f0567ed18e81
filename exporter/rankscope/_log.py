"""rankscope's own log lines: seen on stderr whatever logging the loop set up, and never a flood.

Most training loops configure no logging at all, and Python then prints only warnings: the metrics
URL, "applied reduce_lr at step N" and the refusals would be lost. So the "rankscope" logger logs at
INFO and has its own stderr handler, which stays quiet while the root logger already writes to
stderr (the loop's own `logging.basicConfig`), so no line is printed twice. Records still propagate:
a loop that logs to a file gets them there too.

`RANKSCOPE_LOG_LEVEL` (debug, info, warning, error, off; default info) or :func:`set_log_level`
chooses how much; "off" silences rankscope entirely.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["LogOnce", "set_log_level", "set_log_rank"]

logger = logging.getLogger("rankscope")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_OFF = logging.CRITICAL + 10


def _writes_to_stderr(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (
        sys.stderr,
        sys.__stderr__,
    )


class _UnlessTheRootPrints(logging.Filter):
    """Pass records only while no handler of the root logger writes to stderr already."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(_writes_to_stderr(h) for h in logging.getLogger().handlers)


class _StderrNow(logging.StreamHandler):
    """A stream handler on whatever sys.stderr is at the time of the record (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def set_log_level(level: str) -> None:
    """How much rankscope logs: "debug", "info" (default), "warning", "error" or "off"."""
    name = level.strip().lower()
    if name != "off" and name not in _LEVELS:
        raise ValueError(f"rankscope log level must be one of {', '.join([*_LEVELS, 'off'])}, got {level!r}")
    logger.setLevel(_OFF if name == "off" else _LEVELS[name])


def _formatter(rank: int | str) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")


def set_log_rank(rank: int) -> None:
    """The rank in the prefix of rankscope's lines. Read from RANK at import; an integration whose framework
    starts its own processes (Lightning's launcher sets no RANK) sets the framework's global rank."""
    for handler in logger.handlers:
        if isinstance(handler, _StderrNow):
            handler.setFormatter(_formatter(rank))


def _install() -> None:
    if any(isinstance(h, _StderrNow) for h in logger.handlers):
        return
    handler = _StderrNow()
    handler.setFormatter(_formatter(os.environ.get("RANK", "0")))
    handler.addFilter(_UnlessTheRootPrints())
    logger.addHandler(handler)
    try:
        set_log_level(os.environ.get("RANKSCOPE_LOG_LEVEL", "info"))
    except ValueError as exc:
        logger.setLevel(logging.INFO)
        logger.warning("rankscope: %s (RANKSCOPE_LOG_LEVEL); logging at info", exc)


_install()


class LogOnce:
    """Remembers which keys were logged. Probes fail from the scrape thread and
    the training thread alike, hence the lock."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args: object) -> None:
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        logger.warning(message, *args)
