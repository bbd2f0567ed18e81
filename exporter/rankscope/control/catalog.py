"""Every control action, declared once: its name, parameters and bounds, limits, and who may ask for it.

The control endpoint's checks (`actions`, `alerts`), the CLI's commands (`rankscope.cli`), the
cooldowns and caps (`limits`), the OpenAPI document and the rule pack's `action` labels and
Alertmanager route are built from this table or tested against it; the channel holds one behaviour per name. Adding an
action is a row here plus its behaviour in `ControlChannel`.

No torch here: `rankscope-ctl` and the rule pack (`rankscope.mixin`) import it. Which alert asks for
which action is the rule pack's to say (`rankscope.mixin.config.ACTION_TUNABLES`): no alert is named here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CATALOG", "RESULTS", "ActionSpec", "Parameter", "action_spec", "check_result", "parameter_owners"]


@dataclass(frozen=True)
class Parameter:
    """One parameter of an action: a number in an open or closed range."""

    name: str
    help: str
    minimum: float
    maximum: float
    integer: bool = False
    exclusive: bool = True
    """Whether the bounds themselves are excluded."""
    default_setting: str = ""
    """The ControlConfig field that gives its value when a request leaves it out ("" = no default)."""
    flag: str = ""
    """Its rankscope-ctl option ("" = --name with dashes)."""

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def bounds_text(self) -> str:
        if self.exclusive:
            return f"between {self.minimum:g} and {self.maximum:g} (exclusive)"
        return f"between {self.minimum:g} and {self.maximum:g}"

    def check(self, value: Any) -> float | int | None:
        """The value as a number if it is one in range, else None (the caller words the error)."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None
        if not math.isfinite(number):
            return None
        inside = self.minimum < number < self.maximum if self.exclusive else self.minimum <= number <= self.maximum
        if not inside:
            return None
        if self.integer:
            return int(number) if number == int(number) else None
        return number


@dataclass(frozen=True)
class ActionSpec:
    """One action the control endpoint accepts."""

    name: str
    command: str
    """Its rankscope-ctl subcommand."""
    help: str
    """One line, for the CLI and the OpenAPI document."""
    parameters: tuple[Parameter, ...] = ()
    cooldown_steps: str = ""
    cooldown_seconds: str = ""
    cap: str = ""
    """ControlConfig fields of its limits ("" = none)."""
    immediate: bool = False
    """Carried out at once from rank 0's endpoint thread, never at a step boundary (a hung rank never
    reaches one): it must never enter the boundary exchange."""

    def parameter(self, name: str) -> Parameter | None:
        return next((p for p in self.parameters if p.name == name), None)


LR_FACTOR = Parameter(
    "lr_factor",
    "multiply every learning rate by this",
    minimum=0.0,
    maximum=1.0,
    default_setting="lr_factor",
    flag="--factor",
)


def _count(name: str, help: str, minimum: int = 0, **settings: Any) -> Parameter:
    """A parameter that counts steps or batches: a whole number, its bounds included."""
    return Parameter(name, help, minimum=minimum, maximum=10**12, integer=True, exclusive=False, **settings)


RESTORE_AFTER_STEPS = _count(
    "restore_after_steps",
    "give the rate back this many steps after the reduction (0: keep it for the rest of the run); a later "
    "reduction with its own return moves the return of both to its own; a rollback keeps the rates it loads",
    default_setting="lr_restore_after_steps",
)
BEFORE_STEP = _count(
    "before_step",
    "roll back to the newest checkpoint written before this step (default: the step at the alert's startsAt, "
    "or the current step)",
    minimum=1,
    flag="--before-step",
)
SKIP_BATCHES = _count(
    "skip_batches",
    "batches of data to skip after the checkpoint (default: those trained since it, or up to the incident if "
    "that is later, plus control.rollback_margin_batches, and then what the loop, reading ahead, finds bad); "
    "given, it is taken as is",
)
INCIDENT_LOOKBACK = Parameter(
    "incident_lookback_seconds",
    "the incident began this many seconds before the alert's startsAt, the time it fired (a smoothed signal "
    "crosses its line after the fault began, and fires its `for` later): roll back to before then (an alert's "
    "annotation; ignored with before_step)",
    minimum=0,
    maximum=86400,
    exclusive=False,
)
ROLLBACK_LR_FACTOR = Parameter(
    "lr_factor",
    "after rolling back, also multiply every learning rate by this (default: unchanged)",
    minimum=0.0,
    maximum=1.0,
    flag="--factor",
)

CATALOG: tuple[ActionSpec, ...] = (
    ActionSpec(
        "checkpoint",
        "checkpoint",
        "write a checkpoint at the next step boundary",
        cooldown_steps="checkpoint_cooldown_steps",
        cooldown_seconds="checkpoint_cooldown_seconds",
    ),
    ActionSpec(
        "reduce_lr",
        "reduce-lr",
        "multiply every learning rate by a factor, for good or for a number of steps",
        parameters=(LR_FACTOR, RESTORE_AFTER_STEPS),
        cooldown_steps="lr_cooldown_steps",
        cooldown_seconds="lr_cooldown_seconds",
        cap="lr_max_reductions",
    ),
    ActionSpec(
        "rollback",
        "rollback",
        "load the newest checkpoint before the incident on every rank, then skip the data that followed it",
        parameters=(BEFORE_STEP, SKIP_BATCHES, INCIDENT_LOOKBACK, ROLLBACK_LR_FACTOR),
        cooldown_steps="rollback_cooldown_steps",
        cooldown_seconds="rollback_cooldown_seconds",
        cap="rollback_max",
    ),
    ActionSpec(
        "reduce_micro_batch",
        "reduce-micro-batch",
        "halve the micro-batch and double gradient accumulation on every rank (same global batch)",
        cooldown_steps="micro_batch_cooldown_steps",
        cooldown_seconds="micro_batch_cooldown_seconds",
        cap="micro_batch_max_reductions",
    ),
    ActionSpec("pause", "pause", "hold every rank at the next step boundary"),
    ActionSpec("resume", "resume", "continue a paused job"),
    ActionSpec("stop", "stop", "checkpoint, then leave the loop on every rank"),
    ActionSpec(
        "restart",
        "restart",
        "at once, without a step boundary: write every rank's stacks, then exit every rank with status 75 so that "
        "torchrun --max-restarts restarts the group from its newest checkpoint",
        cooldown_seconds="restart_cooldown_seconds",
        cap="restart_max",
        immediate=True,
    ),
)

#: Outcomes: the `result` label of rankscope_control_actions_total and `status` of a settled action.
RESULTS: dict[str, str] = {
    "applied": "every rank carried it out and its effect happened",
    "noop": "nothing to do (resume while running, pause while paused)",
    "refused_cooldown": "the same action was applied too recently",
    "refused_cap": "the action's cap (e.g. lr_max_reductions) is reached",
    "refused_floor": "reduce_lr with every learning rate already at its floor",
    "refused_unavailable": "the loop cannot do it in its state: no checkpoint before the incident (rollback), "
    "a micro-batch that cannot be halved (reduce_micro_batch), no restart left (restart); nothing changed",
    "unsupported": "the loop does not implement this action (its handler has no such method); nothing changed",
    "overridden": "carried out, but its effect did not happen (e.g. the loop overwrote a reduced learning rate)",
    "failed": "some rank raised while carrying it out, or the loop reported it not done",
    "duplicate": "an alert (fingerprint, startsAt) already received",
    "ignored": "a resolved alert, or one without an `action` label",
}


def check_result(result: str) -> str:
    """`result`, if it is one of RESULTS; else ValueError (an outcome nobody documented is a bug here)."""
    if result not in RESULTS:
        raise ValueError(f"control result {result!r} is not one of rankscope.control.catalog.RESULTS")
    return result


def action_spec(name: str) -> ActionSpec | None:
    return next((spec for spec in CATALOG if spec.name == name), None)


def parameter_owners(name: str) -> list[str]:
    """The actions that take a parameter called `name`."""
    return [spec.name for spec in CATALOG if spec.parameter(name) is not None]
