"""Logging that cannot flood: a failing probe is logged once, then only counted."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("rankscope")


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
