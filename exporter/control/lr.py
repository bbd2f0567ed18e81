"""Reducing the learning rate so that the scheduler keeps the reduction.

Multiplying `param_group["lr"]` alone does not last: LambdaLR (warmup,
cosine) recomputes `lr = base_lr * f(step)` at its next step and undoes it.
So the scheduler's own reference values are scaled by the same factor:
`base_lrs` (every LRScheduler), `max_lrs` (CyclicLR), the param groups'
`initial_lr` / `max_lr` / `min_lr` (OneCycleLR and schedulers built with
`last_epoch`), and the children of SequentialLR / ChainedScheduler.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["can_reduce", "current_learning_rates", "scale_learning_rates"]

_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr")


def current_learning_rates(optimizer: Any) -> list[float]:
    """Each param group's learning rate, as floats (never a device sync: a CUDA lr tensor reads NaN)."""
    if optimizer is None:
        return []
    return [_as_float(group["lr"]) for group in optimizer.param_groups]


def can_reduce(optimizer: Any, floor: float) -> bool:
    """True when some param group's learning rate is above `floor`."""
    return any(lr > floor for lr in current_learning_rates(optimizer))


def scale_learning_rates(optimizer: Any, scheduler: Any | None, factor: float, floor: float = 0.0) -> list[float]:
    """Multiply every learning rate by `factor`, never below `floor`; returns the new rates.

    The floor bounds the reduction of the reference values too; a scheduler
    that later multiplies a floored base LR by a warmup factor below 1 may
    still go under it, as it would have without the reduction.

    Deterministic given the optimizer's state, so ranks holding the same state
    (DDP replicas) end with identical rates.
    """
    for group in optimizer.param_groups:
        group["lr"] = _scaled(group["lr"], factor, floor)
        for key in _GROUP_KEYS:
            if key in group:
                group[key] = _scaled(group[key], factor, 0.0 if key == "min_lr" else floor)
    if scheduler is not None:
        _scale_scheduler(scheduler, factor, floor)
    return current_learning_rates(optimizer)


def _scale_scheduler(scheduler: Any, factor: float, floor: float) -> None:
    for attribute in ("base_lrs", "max_lrs"):
        values = getattr(scheduler, attribute, None)
        if isinstance(values, list):
            setattr(scheduler, attribute, [_scaled(v, factor, floor) for v in values])
    # What get_last_lr() reports should match the optimizer right away.
    if isinstance(getattr(scheduler, "_last_lr", None), list) and hasattr(scheduler, "optimizer"):
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    for child in getattr(scheduler, "_schedulers", ()) or ():
        _scale_scheduler(child, factor, floor)


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
