"""Did an action's effect happen? The checks that make an "applied" outcome true.

An action is carried out at a step boundary, but some effects are only visible later:

- `reduce_lr` writes smaller rates into the optimizer, but a loop that computes its own rate
  (a hand-written warmup/cosine function that sets every group's `lr` at the top of each step)
  overwrites them before the optimizer ever uses them. So the rates are read again when the
  optimizer next steps (a step pre-hook): the reduction took effect when every reduced group's
  rate is at most the geometric mean of its reduced and its unreduced rate, i.e. closer to the
  reduced one. The unreduced rate is where the schedule was going: the last rate plus the growth
  of the last optimizer step (a warmup doubles the rate at its first steps, so the last rate alone
  would make an honoured halving look overwritten); a falling schedule is judged against the last
  rate. A scheduler stepping after the optimizer leaves exactly the written rate; a loop that
  multiplies in `ControlChannel.lr_scale` sets about the reduced one; a loop that overwrites sets
  about the unreduced one. Exact for linear warmups; a reduction after the first optimizer step
  has no growth to go by.
- `checkpoint` may be written later by a framework (the Hugging Face Trainer saves after the
  step's callbacks): the handler then returns a callable that tells when it was written.
- `stop` is done when the loop leaves (the channel is closed), not when it was asked.

Each check answers None while it cannot tell yet, True when the effect happened, or a one-line
reason why it did not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rankscope.control.lr import current_learning_rates

__all__ = ["Check", "LRReductionCheck", "OptimizerWatch"]

#: None: cannot tell yet; True: the effect happened; a string: it did not, and why.
Verdict = bool | str | None
Check = Callable[[], Verdict]


@dataclass
class LRReductionCheck:
    """One reduction on this rank: the rates before and as written, and those the optimizer used next."""

    before: list[float]
    written: list[float]
    used: list[float] | None = None
    growth: list[float] = field(default_factory=list)
    """Per group, how much the rate rose at the last optimizer step (0 where it fell or is unknown)."""

    def __call__(self) -> Verdict:
        if self.used is None:
            return None  # the optimizer has not stepped since (a skipped or accumulating step)
        for group, (old, new, used) in enumerate(zip(self.before, self.written, self.used, strict=False)):
            if not (new < old) or math.isnan(used):
                continue  # not reduced (at its floor), or a device tensor the host cannot read without a sync
            unreduced = old + (self.growth[group] if group < len(self.growth) else 0.0)
            if used > unreduced * math.sqrt(new / old) * (1 + 1e-9):
                return (
                    f"the loop overwrote the reduced learning rate of param group {group} before the optimizer "
                    f"used it ({used:.3g} used, {new:.3g} written, {old:.3g} before); multiply your rate by "
                    "ControlChannel.lr_scale to honour reductions"
                )
        return True


@dataclass
class OptimizerWatch:
    """A step pre-hook on the loop's optimizer: the rates it steps with, and the largest seen per group.

    The hook runs inside `optimizer.step()` on the training thread and only reads the param groups."""

    optimizer: Any
    peak: list[float] = field(default_factory=list)
    _waiting: list[LRReductionCheck] = field(default_factory=list)
    _handle: Any = None
    _last: list[float] = field(default_factory=list)
    _previous: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.peak = _finite_or_zero(current_learning_rates(self.optimizer))
        self._handle = self.optimizer.register_step_pre_hook(self._before_step)

    def expect(self, check: LRReductionCheck) -> LRReductionCheck:
        """Fill `check.used` with the rates of the next optimizer step; `check.growth` with the last step's rise."""
        check.growth = self.growth()
        self._waiting.append(check)
        return check

    def growth(self) -> list[float]:
        """Per group, how much the rate rose from the optimizer's second-last step to its last (0 if it fell)."""
        rises = [last - previous for last, previous in zip(self._last, self._previous, strict=False)]
        return [rise if math.isfinite(rise) and rise > 0 else 0.0 for rise in rises]

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        rates = current_learning_rates(optimizer)
        self._previous, self._last = self._last, rates
        self.peak = [max(p, r) if not math.isnan(r) else p for p, r in zip(self.peak, rates, strict=False)]
        self.peak += _finite_or_zero(rates[len(self.peak) :])
        for check in self._waiting:
            check.used = rates
        self._waiting.clear()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _finite_or_zero(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else 0.0 for v in values]
