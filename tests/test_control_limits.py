"""Cooldowns (steps and seconds) and caps. The clock is a fake (FakeClock below) so time can be stepped."""

from __future__ import annotations

from rankscope.control import ControlConfig
from rankscope.control.limits import ActionLimits, Limit


class FakeClock:
    """Monotonic seconds that only move when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_actions_without_limits_always_pass():
    limits = ActionLimits({})
    limits.record("pause", 1)
    assert limits.check("pause", 1) is None


def test_a_step_cooldown_refuses_until_enough_steps_passed():
    limits = ActionLimits({"reduce_lr": Limit(cooldown_steps=10)})
    assert limits.check("reduce_lr", 5) is None
    limits.record("reduce_lr", 5)
    result, detail = limits.check("reduce_lr", 14)
    assert result == "refused_cooldown"
    assert detail == "reduce_lr applied at step 5; cooldown is 10 steps"
    assert limits.check("reduce_lr", 15) is None


def test_a_seconds_cooldown_refuses_until_enough_time_passed():
    clock = FakeClock()
    limits = ActionLimits({"checkpoint": Limit(cooldown_seconds=30)}, clock)
    limits.record("checkpoint", 1)
    clock.now += 29.5
    assert limits.check("checkpoint", 1000)[0] == "refused_cooldown"
    clock.now += 0.5
    assert limits.check("checkpoint", 1000) is None


def test_a_cap_refuses_once_reached_and_wins_over_the_cooldown():
    limits = ActionLimits({"reduce_lr": Limit(cooldown_steps=100, cap=2)})
    limits.record("reduce_lr", 1)
    limits.record("reduce_lr", 200)
    result, detail = limits.check("reduce_lr", 201)
    assert result == "refused_cap"
    assert detail == "reduce_lr reached its cap of 2 applications"
    assert limits.applied("reduce_lr") == 2


def test_limits_come_from_the_config():
    clock = FakeClock()
    config = ControlConfig(lr_cooldown_steps=3, lr_cooldown_seconds=0, lr_max_reductions=1, checkpoint_cooldown_steps=2)
    limits = ActionLimits.from_config(config, clock)
    limits.record("reduce_lr", 1)
    assert limits.check("reduce_lr", 100)[0] == "refused_cap"
    limits.record("checkpoint", 1)
    assert limits.check("checkpoint", 2)[0] == "refused_cooldown"
    assert limits.check("checkpoint", 3) is None
