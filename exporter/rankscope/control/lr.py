"""Reducing the learning rate so that the scheduler keeps the reduction.

Multiplying `param_group["lr"]` alone does not last: LambdaLR (warmup,
cosine) recomputes `lr = base_lr * f(step)` at its next step and undoes it.
So the scheduler's own reference values are scaled by the same factor:
`base_lrs` (every LRScheduler), `max_lrs` (CyclicLR), the param groups'
`initial_lr` / `max_lr` / `min_lr` (OneCycleLR and schedulers built with
`last_epoch`), and the children of SequentialLR / ChainedScheduler.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "can_reduce",
    "capture_references",
    "current_learning_rates",
    "reduction_ratios",
    "reference_rates",
    "restore_references",
    "scale_learning_rates",
]

_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr")
_SCHEDULER_ATTRIBUTES = ("base_lrs", "max_lrs")

Floor = float | Sequence[float]


def current_learning_rates(optimizer: Any) -> list[float]:
    """Each param group's learning rate, as floats (never a device sync: a CUDA lr tensor reads NaN)."""
    if optimizer is None:
        return []
    return [_as_float(group["lr"]) for group in optimizer.param_groups]


def can_reduce(optimizer: Any, floor: Floor) -> bool:
    """True when some param group's learning rate is above its floor."""
    rates = current_learning_rates(optimizer)
    return any(lr > bound for lr, bound in zip(rates, _per_group(floor, len(rates)), strict=True))


def scale_learning_rates(
    optimizer: Any, scheduler: Any | None, factor: float | Sequence[float], floor: Floor = 0.0
) -> list[float]:
    """Multiply every learning rate by `factor`, never below `floor` (each one value, or one per param
    group); returns the new rates. A factor above 1 gives back what an earlier reduction took
    (`reduction_ratios`).

    The floor bounds the reduction of the reference values too; a scheduler
    that later multiplies a floored base LR by a warmup factor below 1 may
    still go under it, as it would have without the reduction.

    Deterministic given the optimizer's state, so ranks holding the same state
    (DDP replicas) end with identical rates.
    """
    floors = _per_group(floor, len(optimizer.param_groups))
    factors = _per_group(factor, len(optimizer.param_groups), "learning-rate factors")
    for group, by, bound in zip(optimizer.param_groups, factors, floors, strict=True):
        group["lr"] = _scaled(group["lr"], by, bound)
        for key in _GROUP_KEYS:
            if key in group:
                group[key] = _scaled(group[key], by, 0.0 if key == "min_lr" else bound)
    if scheduler is not None:
        _scale_scheduler(scheduler, factors, floors)
    return current_learning_rates(optimizer)


def reference_rates(optimizer: Any) -> list[float]:
    """Each param group's reference rate: its scheduler's `initial_lr` where it has one (the schedule's rate at
    any step follows it), else the rate itself."""
    if optimizer is None:
        return []
    return [_as_float(group.get("initial_lr", group["lr"])) for group in optimizer.param_groups]


def reduction_ratios(before: Sequence[float], after: Sequence[float]) -> list[float]:
    """Per group, the factor that gives back a reduction from the `reference_rates` `before` to `after`: 1 where
    nothing was reduced (at its floor) or a rate cannot be read."""
    return [b / a if 0 < a < b and math.isfinite(b) else 1.0 for b, a in zip(before, after, strict=True)]


def capture_references(optimizer: Any, scheduler: Any | None) -> list[tuple[Any, str, Any]]:
    """What `scale_learning_rates` changes besides the rates themselves (the param groups' reference
    keys, the schedulers' base and max rates), to put back with `restore_references` if a reduction
    turns out not to have taken effect."""
    saved: list[tuple[Any, str, Any]] = []
    for group in optimizer.param_groups if optimizer is not None else ():
        saved += [(group, key, _copied(group[key])) for key in _GROUP_KEYS if key in group]
    pending = [scheduler] if scheduler is not None else []
    while pending:
        current = pending.pop()
        saved += [
            (current, name, _copied(getattr(current, name)))
            for name in _SCHEDULER_ATTRIBUTES
            if isinstance(getattr(current, name, None), list)
        ]
        pending += list(getattr(current, "_schedulers", ()) or ())
    return saved


def restore_references(saved: list[tuple[Any, str, Any]]) -> None:
    """Put back what `capture_references` saved."""
    for owner, name, value in saved:
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _per_group(values: Floor, groups: int, what: str = "learning-rate floors") -> list[float]:
    if isinstance(values, (int, float)):
        return [float(values)] * groups
    per_group = [float(v) for v in values]
    if len(per_group) != groups:
        raise ValueError(f"{len(per_group)} {what} for {groups} param groups")
    return per_group


def _scale_scheduler(scheduler: Any, factors: list[float], floors: list[float]) -> None:
    for attribute in _SCHEDULER_ATTRIBUTES:
        values = getattr(scheduler, attribute, None)
        if isinstance(values, list):
            # Lists that are not one per param group take the smallest factor: the most a reduction takes,
            # the least a return gives back.
            bounds = floors if len(floors) == len(values) else [min(floors, default=0.0)] * len(values)
            by = factors if len(factors) == len(values) else [min(factors, default=1.0)] * len(values)
            setattr(scheduler, attribute, [_scaled(v, f, b) for v, f, b in zip(values, by, bounds, strict=True)])
    # What get_last_lr() reports should match the optimizer right away.
    if isinstance(getattr(scheduler, "_last_lr", None), list) and hasattr(scheduler, "optimizer"):
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    for child in getattr(scheduler, "_schedulers", ()) or ():
        _scale_scheduler(child, factors, floors)


def _scaled(value: Any, factor: float, floor: float) -> Any:
    """value * factor, but not below `floor`; a value already at or below the floor is left alone
    (a reduction must never raise a rate, e.g. one still low in its warmup)."""
    if isinstance(value, torch.Tensor):
        # Tensor learning rates (capturable optimizers) are updated in place, keeping device and dtype.
        return value.copy_(torch.where(value > floor, (value * factor).clamp(min=floor), value))
    value = float(value)
    return value if value <= floor else max(value * factor, floor)


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.device.type == "cpu" else float("nan")
    return float(value)
