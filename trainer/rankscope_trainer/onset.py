"""Where a loss excursion began, so a rollback loads the newest checkpoint before it.

An alert bounds its incident from below by its lookback (its smoothing window and its `for`): the
worst case, minutes before the loss actually left its level. A rollback to the newest checkpoint
before that bound trains every step since again (the fault campaign: 2,500-6,100 steps, three minutes
each time). The trainer saw every step's loss: the excursion the alert smoothed starts where the step
losses left their level and never came back. So it keeps the last steps' losses (on the device, no
sync per step), and at a rollback finds the start of the excursion that lasts to now; a checkpoint
between the alert's bound and that start was written before the damage and is the one to load.

The search only ever moves the rollback later within the alert's lookback, and only past losses that
stayed at their level: a noisy, young or short history finds no lasting excursion, and the rollback
stays at the alert's bound. Where every checkpoint before the bound was pruned (an answer minutes late),
the oldest kept checkpoint the history reaches back to stands in for the bound: the same search from it,
or the refusal where its losses were already off their level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LOSS_HISTORY_STEPS", "ONSET_FACTOR", "LossHistory", "excursion_start", "rate_raised"]

#: The loss has left its level when the median of a window of step losses is over this many times the
#: highest loss of the first window after the alert's bound. A lower factor only finds an earlier start (a
#: safer, older checkpoint); a diverging or poisoned run's loss goes to chance, tens of times its level.
ONSET_FACTOR = 2.0

#: Steps of loss kept: an alert's lookback (130 s by default) and its answer, twice over at 10 ms a step; 128 KiB.
LOSS_HISTORY_STEPS = 32_768


class LossHistory:
    """The losses of the last `capacity` steps, kept where they were computed (no sync per step)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._values: torch.Tensor | None = None
        self._steps: list[int] = [0] * capacity
        self._count = 0

    def record(self, step: int, loss: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        if self._values is None:
            self._values = torch.full((self.capacity,), math.nan, dtype=torch.float32, device=loss.device)
        slot = self._count % self.capacity
        self._values[slot] = loss.detach().reshape(())  # a device copy, no transfer
        self._steps[slot] = step
        self._count += 1

    def clear(self) -> None:
        """Forget every step (after a rollback the run trains its steps again)."""
        self._count = 0

    def ordered(self, device: torch.device) -> tuple[list[int], torch.Tensor]:
        """(steps, losses) oldest first; losses is always `capacity` long, NaN before the first step, so that
        every rank can all-reduce it whatever it recorded."""
        values = self._values if self._values is not None else torch.full((self.capacity,), math.nan)
        values = values.to(device, torch.float64)
        kept = min(self._count, self.capacity)
        start = self._count % self.capacity if self._count > self.capacity else 0
        order = [(start + i) % self.capacity for i in range(kept)]
        padding = torch.full((self.capacity - kept,), math.nan, dtype=torch.float64, device=device)
        return [self._steps[i] for i in order], torch.cat([values[order], padding])


def excursion_start(losses: Sequence[float], window: int, factor: float = ONSET_FACTOR) -> int | None:
    """The index of the first loss of the last window still at the level, before an excursion that lasts to
    the end of `losses`; None when there is none, or too little history to tell (under two windows, no level).

    The level is the highest finite loss of the first `window`; a window has left it when its median is over
    `factor` times that (a non-finite loss counts as over). The highest, not the median: near convergence a
    batch's loss goes from 0.0001 to 0.13 (the fault campaign), so windows' medians double and halve around the
    first one's for a hundred steps before anything happened; the highest already covers the batches' spread,
    while a diverged or poisoned loss goes to chance (2.77), twenty times the highest there. The index returned
    is the start of the last window whose median was not over: every step before it trained before more than
    half of a window's losses rose, a margin of about half a window before the rise."""
    if window < 1 or len(losses) < 2 * window:
        return None
    values = torch.tensor([v if math.isfinite(v) else math.inf for v in losses], dtype=torch.float64)
    first = values[:window]
    finite = first[torch.isfinite(first)]
    if len(finite) <= window // 2:  # mostly non-finite: no level to measure from
        return None
    level = float(finite.max())
    if level <= 0:
        return None
    # The lower median of each window (torch.median), for each window start.
    high = values.unfold(0, window, 1).median(dim=1).values > factor * level
    if not bool(high[-1]):
        return None
    below = (~high).nonzero()
    return int(below[-1]) if len(below) else None


def rate_raised(state: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether a checkpoint's learning rates were raised since the `reference` checkpoint (its scheduler's base
    rates; a schedule's own warm-up and decay leave those alone), or cannot be compared."""
    new, old = (s.get("scheduler", {}).get("base_lrs") for s in (state, reference))
    if not isinstance(new, list) or not isinstance(old, list) or len(new) != len(old):
        return True
    return any(float(n) > float(o) * (1 + 1e-9) for n, o in zip(new, old, strict=True))
