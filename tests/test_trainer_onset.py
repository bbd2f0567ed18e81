"""rankscope_trainer.onset: where the loss left its level, so a rollback loads the newest checkpoint before it.

The trainer's use of it (every rank on the all-reduced losses, the checkpoint it then loads) is
tests/test_trainer_recovery.py's, under torchrun.
"""

from __future__ import annotations

import json
import lzma
import math
import random
from pathlib import Path

import pytest
import torch
from rankscope_trainer.onset import ONSET_FACTOR, LossHistory, excursion_start, rate_raised

WINDOW = 32


def _noisy(level: float, count: int, rng: random.Random) -> list[float]:
    """Step losses around `level`: a contrastive loss near convergence halves and doubles from batch to batch."""
    return [level * math.exp(rng.uniform(-0.7, 0.7)) for _ in range(count)]


@pytest.mark.parametrize("seed", range(20))
def test_a_lasting_rise_is_found_about_half_a_window_before_it(seed) -> None:
    rng = random.Random(seed)
    rise = rng.randrange(2 * WINDOW, 400)
    losses = _noisy(0.05, rise, rng) + _noisy(2.7, rng.randrange(WINDOW, 300), rng)
    start = excursion_start(losses, WINDOW)
    assert start is not None
    # Every step before the index trained before the rise, with a margin of about half a window.
    assert rise - WINDOW <= start < rise - WINDOW // 2 + 1, (rise, start)


@pytest.mark.parametrize("seed", range(20))
def test_noise_a_falling_loss_and_a_rise_that_ended_give_no_start(seed) -> None:
    rng = random.Random(seed)
    assert excursion_start(_noisy(0.05, 600, rng), WINDOW) is None
    falling = [2.7 * math.exp(-i / 80) * math.exp(rng.uniform(-0.3, 0.3)) for i in range(600)]
    assert excursion_start(falling, WINDOW) is None
    # A spike that came back: the loss is at its level now, nothing to undo.
    spike = _noisy(0.05, 200, rng) + _noisy(2.7, 100, rng) + _noisy(0.05, 100, rng)
    assert excursion_start(spike, WINDOW) is None


def test_a_converged_losss_heavy_tailed_noise_is_its_level_not_a_rise() -> None:
    """The fault campaign's loop-on arm at 4668335 (benchmarks/results): from the rollback's bound (step 13908) the
    converged loss went from 0.0001 to 0.13 from batch to batch, so windows' medians were over twice the first
    window's median for 88 steps before the learning-rate spike at step 14337. Measured from that median, the
    excursion began at 14272 and the rollback loaded step 13908, passing over the checkpoint of step 14274 written
    63 steps before the spike: 366 steps trained again for nothing."""
    record = Path(__file__).parents[1] / "benchmarks/results/campaign-4668335/on.json.xz"
    records = json.loads(lzma.decompress(record.read_bytes()))["records"]
    rollback = next(r for r in records if r["type"] == "rollback")
    losses = {r["step"]: r["loss"] for r in records if r["type"] == "train" and r["time"] < rollback["time"]}
    steps = [s for s in sorted(losses) if rollback["step"] < s <= rollback["rolled_back_from"]]
    spike = next(r["step"] for r in records if r["type"] == "fault" and r["kind"] == "diverge")
    start = excursion_start([losses[s] for s in steps], WINDOW)
    assert start is not None
    assert 14274 < steps[start] < spike, steps[start]


@pytest.mark.parametrize("seed", range(20))
def test_a_rise_out_of_heavy_tailed_noise_is_found_before_it(seed) -> None:
    rng = random.Random(seed)
    rise = rng.randrange(2 * WINDOW, 400)
    # Near convergence most batches' losses are tiny and a few are a hundred times more.
    noise = [0.001 * math.exp(rng.uniform(-2.5, 2.5)) * (100 if rng.random() < 0.1 else 1) for _ in range(rise)]
    losses = noise + _noisy(2.7, rng.randrange(WINDOW, 300), rng)
    start = excursion_start(losses, WINDOW)
    assert start is not None
    assert rise - WINDOW <= start < rise, (rise, start)


def test_a_rise_from_the_first_window_or_too_short_a_history_gives_no_start() -> None:
    # The level itself is the excursion's (a bound inside it): nothing rose above it.
    assert excursion_start([2.7] * 200, WINDOW) is None
    assert excursion_start([0.05] * (2 * WINDOW - 1) + [2.7], WINDOW) is None  # under two windows: no level
    assert excursion_start([0.0] * 100 + [2.7] * 100, WINDOW) is None  # a level of 0: no factor of it
    assert excursion_start([0.05] * 100, 0) is None


def test_non_finite_losses_count_as_over_the_level() -> None:
    losses = [0.05] * 100 + [math.nan, math.inf] * 50
    assert excursion_start(losses, WINDOW) == 100 - WINDOW // 2
    # ... and a non-finite level is none.
    assert excursion_start([math.nan] * 200, WINDOW) is None


def test_the_factor_is_a_factor_of_the_level() -> None:
    under = [1.0] * 100 + [ONSET_FACTOR * 0.99] * 100
    over = [1.0] * 100 + [ONSET_FACTOR * 1.01] * 100
    assert excursion_start(under, WINDOW) is None
    assert excursion_start(over, WINDOW) == 100 - WINDOW // 2


def test_the_history_keeps_the_last_steps_in_order_and_pads_to_its_capacity() -> None:
    history = LossHistory(8)
    steps, values = history.ordered(torch.device("cpu"))
    assert steps == [] and len(values) == 8 and bool(values.isnan().all())  # nothing recorded: all padding
    for step in range(1, 6):
        history.record(step, torch.tensor(step / 10))
    steps, values = history.ordered(torch.device("cpu"))
    assert steps == [1, 2, 3, 4, 5] and len(values) == 8
    assert values[:5].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5]) and bool(values[5:].isnan().all())
    for step in range(6, 20):  # wraps around: the newest eight, oldest first
        history.record(step, torch.tensor(step / 10))
    steps, values = history.ordered(torch.device("cpu"))
    assert steps == list(range(12, 20))
    assert values.tolist() == pytest.approx([s / 10 for s in range(12, 20)])
    history.clear()
    assert history.ordered(torch.device("cpu"))[0] == []
    history.record(40, torch.tensor(4.0))
    assert history.ordered(torch.device("cpu"))[0] == [40]


def test_a_history_of_no_capacity_keeps_nothing() -> None:
    history = LossHistory(0)
    history.record(1, torch.tensor(1.0))
    steps, values = history.ordered(torch.device("cpu"))
    assert steps == [] and len(values) == 0


def _state(*base_lrs: float) -> dict:
    return {"scheduler": {"base_lrs": list(base_lrs)}}


def test_a_raised_base_rate_is_raised_a_lowered_or_equal_one_is_not() -> None:
    assert not rate_raised(_state(1e-3, 1e-3), _state(1e-3, 1e-3))
    assert not rate_raised(_state(5e-4, 5e-4), _state(1e-3, 1e-3))  # reduce_lr halved it: a fine candidate
    assert rate_raised(_state(1e-2, 1e-3), _state(1e-3, 1e-3))  # one group raised is enough
    # What cannot be compared is not trusted: no scheduler state, another number of groups.
    assert rate_raised({}, _state(1e-3))
    assert rate_raised(_state(1e-3, 1e-3), _state(1e-3))
