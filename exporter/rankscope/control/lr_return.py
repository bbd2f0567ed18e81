"""A learning-rate reduction that lasts a number of steps: what to give back, and when.

`reduce_lr` with `restore_after_steps` N cuts the rates as any reduction does and promises them back N steps
later, as a GradScaler grows its loss scale back after a stretch of finite steps (torch's
`growth_interval`, 2000 steps): a transient burst of non-finite steps must not cost the rest of the run half
its learning rate. Reductions with a return that follow one another are given back together, N steps after
the latest; a reduction for good between them stays. The promise is in every checkpoint the channel's
`state_dict()` goes into, so a group resumed from one keeps it; a rollback drops it (the rates it loads are
the checkpoint's, reduced or not), which can only leave a rate lower, never higher.

Every rank holds the same promise (the reduction was applied at one step on every rank with the same
parameters) and keeps it at the same step boundary: no collective is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LRReturn"]


@dataclass(frozen=True)
class LRReturn:
    """Rates to give back at `due_step`: each param group's rates times its ratio, the channel's lr_scale
    times `scale`."""

    due_step: int
    ratios: tuple[float, ...]
    scale: float
    reduced_at: int
    """The step of the first reduction it gives back."""

    @classmethod
    def after(cls, earlier: LRReturn | None, step: int, steps: int, ratios: Sequence[float], scale: float) -> LRReturn:
        """The return due `steps` after a reduction at `step` by `ratios` (per group, what gives it back), joined
        with an `earlier` one still owed: both are given back at the later due step."""
        if earlier is None or len(earlier.ratios) != len(ratios):
            # Param groups added since the earlier cut: its ratios fit no group now, and it is dropped (a rate
            # left lower, never raised past what it was).
            return cls(step + steps, tuple(ratios), scale, step)
        joined = tuple(a * b for a, b in zip(earlier.ratios, ratios, strict=True))
        return cls(max(earlier.due_step, step + steps), joined, earlier.scale * scale, earlier.reduced_at)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratios": list(self.ratios)}

    @classmethod
    def from_json(cls, data: Any, groups: int) -> LRReturn:
        """Read `to_json()` back from a checkpoint; ValueError naming what does not fit."""
        try:
            ratios = tuple(float(r) for r in data["ratios"])
            owed = cls(int(data["due_step"]), ratios, float(data["scale"]), int(data["reduced_at"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"control state's lr_return is not a learning-rate return ({exc})") from None
        if len(ratios) != groups:
            raise ValueError(f"control state's lr_return has {len(ratios)} param groups, the optimizer {groups}")
        if not all(r >= 1.0 for r in (*ratios, owed.scale)):
            raise ValueError("control state's lr_return would lower a rate: its ratios must be >= 1")
        return owed
