"""Cooldowns and caps: how often an action may be applied.

Decided by rank 0 alone, at the step boundary, before the action is
broadcast: a refused action never reaches the other ranks, so they cannot
disagree about it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rankscope.control.catalog import CATALOG
from rankscope.control.config import ControlConfig

__all__ = ["ActionLimits", "Limit"]


@dataclass(frozen=True)
class Limit:
    cooldown_steps: int = 0
    """Steps after an applied action during which the next is refused."""
    cooldown_seconds: float = 0.0
    """Seconds after an applied action during which the next is refused."""
    cap: int = 0
    """Most applications per run (0 = no cap)."""


class ActionLimits:
    """Per-action cooldowns and caps, counted over applied actions only.

    Used by rank 0's training thread only (decisions are made at the step
    boundary), so it needs no lock. `clock` is monotonic; tests pass a fake.
    """

    def __init__(self, limits: dict[str, Limit], clock: Callable[[], float] = time.monotonic) -> None:
        self._limits = limits
        self._clock = clock
        self._applied: dict[str, int] = {}
        self._last: dict[str, tuple[int, float]] = {}
        self._undo: dict[str, list[tuple[int, float] | None]] = {}

    @classmethod
    def from_config(cls, config: ControlConfig, clock: Callable[[], float] = time.monotonic) -> ActionLimits:
        """Each action's limits from the settings the catalog names for it."""

        def setting(name: str) -> float:
            return getattr(config, name) if name else 0

        return cls(
            {
                spec.name: Limit(
                    int(setting(spec.cooldown_steps)), float(setting(spec.cooldown_seconds)), int(setting(spec.cap))
                )
                for spec in CATALOG
                if spec.cooldown_steps or spec.cooldown_seconds or spec.cap
            },
            clock,
        )

    def check(self, action: str, step: int) -> tuple[str, str] | None:
        """None if `action` may run at `step`, else (result, one-line detail)."""
        limit = self._limits.get(action)
        if limit is None:
            return None
        count = self._applied.get(action, 0)
        if limit.cap and count >= limit.cap:
            return "refused_cap", f"{action} reached its cap of {limit.cap} applications"
        if action in self._last:
            last_step, last_time = self._last[action]
            if step - last_step < limit.cooldown_steps:
                return "refused_cooldown", (
                    f"{action} applied at step {last_step}; cooldown is {limit.cooldown_steps} steps"
                )
            elapsed = self._clock() - last_time
            if elapsed < limit.cooldown_seconds:
                return "refused_cooldown", (
                    f"{action} applied {elapsed:.1f}s ago; cooldown is {limit.cooldown_seconds:g}s"
                )
        return None

    def record(self, action: str, step: int) -> None:
        """Note that `action` was applied at `step` (now)."""
        self._undo.setdefault(action, []).append(self._last.get(action))
        self._applied[action] = self._applied.get(action, 0) + 1
        self._last[action] = (step, self._clock())

    def undo(self, action: str) -> None:
        """Take back the latest `record(action)`: its effect did not happen, so it uses no cap or cooldown."""
        history = self._undo.get(action)
        if not history:
            return
        previous = history.pop()
        self._applied[action] -= 1
        if previous is None:
            self._last.pop(action, None)
        else:
            self._last[action] = previous

    def state_dict(self) -> dict[str, int]:
        """Applications per action, kept in checkpoints so that a cap holds across a resume."""
        return dict(self._applied)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._applied = {str(action): int(count) for action, count in state.items()}

    def applied(self, action: str) -> int:
        return self._applied.get(action, 0)
