"""What rankscope's framework callbacks share (rankscope.integrations.hf.callback and
rankscope.integrations.lightning.callback).

Each holds a Monitor and, with `control`, a ControlChannel that live until `close()`, and runs its
own work inside `_guard()`: monitoring must never break training, so a failure is counted in
`rankscope_monitor_errors_total{probe}` and logged once, then training goes on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from rankscope._log import LogOnce

__all__ = ["CallbackParts", "setup_hash"]


class CallbackParts:
    """Mixed into a framework's callback class; the subclass sets `_probe` and `_what` and calls
    `_init_parts()` from its `__init__`."""

    _probe = ""
    """The `probe` label of the callback's own failures."""
    _what = ""
    """The callback, in the failure's log line ("Trainer callback")."""

    def _init_parts(self) -> None:
        self.monitor: Any = None
        """Created when training starts; serves /metrics until `close()` or the process ends."""
        self.channel: Any = None
        """The control channel while training runs (None without `control`)."""
        self._log = LogOnce()
        self._phase_scope = ExitStack()  # the open Monitor.phase (validation, checkpoint), if any

    @property
    def control_url(self) -> str | None:
        """Base URL of the control endpoint (rank 0, while training runs)."""
        return self.channel.url if self.channel is not None else None

    def close(self) -> None:
        """Stop serving metrics and control (the endpoints otherwise live until the process ends)."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.monitor is not None:
            self.monitor.close()

    def _enter_phase(self, name: str) -> None:
        """The framework is about to validate or checkpoint: the goodput counts the time in that bucket
        until `_leave_phase()` (or the next phase)."""
        self._leave_phase()
        if self.monitor is not None:
            with self._guard():
                self._phase_scope.enter_context(self.monitor.phase(name))
                self._phase_open = True

    def _leave_phase(self) -> None:
        if getattr(self, "_phase_open", False):  # cheap when none is open: called on every batch
            self._phase_open = False
            with self._guard():
                self._phase_scope.close()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Monitoring must never break training: a failure is counted and logged once, then training goes on."""
        try:
            yield
        except Exception as exc:
            if self.monitor is not None:
                self.monitor.record_error(self._probe)
            self._log.warning(self._probe, "rankscope: %s failed (training goes on): %r", self._what, exc)


def setup_hash(document: dict[str, Any]) -> str:
    """12 hex digits of a JSON document (keys sorted): the `config_hash` of rankscope_run_info."""
    text = json.dumps(document, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
