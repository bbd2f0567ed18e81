"""reduce_lr: the optimizer's rates and the scheduler's references scale together."""

from __future__ import annotations

import math

import pytest
import torch
from rankscope.control.lr import can_reduce, current_learning_rates, scale_learning_rates


def make_optimizer(lrs=(0.1,)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def warmup_cosine(optimizer, warmup=5, total=50):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def run(optimizer, scheduler, steps):
    rates = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        rates.append(current_learning_rates(optimizer))
    return rates


@pytest.mark.parametrize(
    "make_scheduler",
    [
        warmup_cosine,
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5),
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=60),
        lambda opt: torch.optim.lr_scheduler.SequentialLR(
            opt,
            [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, 5), torch.optim.lr_scheduler.ExponentialLR(opt, 0.95)],
            milestones=[5],
        ),
    ],
    ids=["warmup_cosine", "cosine_annealing", "step", "one_cycle", "sequential"],
)
def test_the_scheduler_does_not_undo_a_reduction(make_scheduler):
    reference_opt, reduced_opt = make_optimizer((0.1, 0.02)), make_optimizer((0.1, 0.02))
    reference, reduced = make_scheduler(reference_opt), make_scheduler(reduced_opt)
    run(reference_opt, reference, 3)
    run(reduced_opt, reduced, 3)
    before = current_learning_rates(reduced_opt)
    after = scale_learning_rates(reduced_opt, reduced, 0.5)
    assert after == pytest.approx([lr * 0.5 for lr in before])
    for expected, got in zip(run(reference_opt, reference, 30), run(reduced_opt, reduced, 30), strict=True):
        assert got == pytest.approx([lr * 0.5 for lr in expected], rel=1e-6, abs=1e-12)


def test_get_last_lr_reports_the_reduced_rates_at_once():
    optimizer = make_optimizer()
    scheduler = warmup_cosine(optimizer)
    scale_learning_rates(optimizer, scheduler, 0.5)
    assert scheduler.get_last_lr() == current_learning_rates(optimizer)


def test_the_floor_bounds_the_reduction_and_never_raises_a_rate():
    optimizer = make_optimizer((0.1, 0.015, 0.001))
    assert scale_learning_rates(optimizer, None, 0.1, floor=0.01) == pytest.approx([0.01, 0.01, 0.001])


def test_can_reduce_is_false_once_every_rate_is_at_the_floor():
    optimizer = make_optimizer((0.01, 0.005))
    assert can_reduce(optimizer, 0.001)
    assert not can_reduce(optimizer, 0.01)


def test_tensor_learning_rates_are_scaled_in_place():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.1))
    lr_tensor = optimizer.param_groups[0]["lr"]
    scale_learning_rates(optimizer, None, 0.5)
    assert optimizer.param_groups[0]["lr"] is lr_tensor
    assert current_learning_rates(optimizer) == pytest.approx([0.05])
