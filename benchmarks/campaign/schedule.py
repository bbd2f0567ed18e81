"""The campaign's faults: what each one is, which alert must name it, and when it is injected.

A schedule is a list of :class:`Fault` in step order. Steps, not seconds: every arm injects the same fault at
the same step, whatever its own pace. The steps are laid out from a measured step time (the fault-free run's)
so that each fault's effect is over before the next one starts: each kind says how long it needs
(:meth:`Kind.span_seconds`), in the slower of the two arms (the operator's delay included).

Faults are injected by the trainer (`faults.schedule` entries, once per job: trainer/rankscope_trainer/faults.py)
or by the runner itself (`kill -9` of a rank, a preemption: SIGTERM to the job, then the job started again).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from rankscope.hang_threshold import duration_seconds
from rankscope.mixin.config import Tunables

__all__ = ["FULL_KINDS", "KINDS", "QUICK_KINDS", "Fault", "Kind", "build_schedule"]


@dataclass(frozen=True)
class Kind:
    """One kind of fault a real run meets."""

    name: str
    """Short name, used in tables and fault ids."""
    what: str
    """One line for the table."""
    alert: str | None
    """The alert that must name it (None: none may fire, the fault is one the loop must not mistake)."""
    names_rank: bool
    """Whether that alert carries the faulty rank's `rank` label (a run-level alert does not)."""
    also: tuple[str, ...] = ()
    """Other alerts the fault explains (not false alarms while it lasts), e.g. a hang's stalled run."""
    effect_seconds: float = 30.0
    """How long its effect lasts once it is acted on (the loop's action, the restart, the recovery)."""
    detect_seconds: float = 15.0
    """How long from the injection to the alert at 1 s intervals with the shipped rules (`for` included)."""
    needs_operator: bool = True
    """Whether it lasts until somebody acts (then the loop-off arm waits the operator's delay)."""
    restarts: int = 0
    """torchrun restarts it spends (a hang's restart, a killed rank)."""
    by_runner: bool = False
    """Injected by the runner (a signal), not by the trainer's fault switches."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """The trainer's `faults.schedule` entry, less `at_step` (and `rank`, set per fault)."""
    lasts_steps: int = 0
    """For faults with an end (`until_step`): how many steps they last."""
    slowdown: float = 1.0
    """How many times slower its steps are while it lasts (a straggler)."""
    alert_for_seconds: float = 0.0
    """For a fault over a window of steps: how long it must last for its alert to fire at all (the alert's `for`)."""

    def span_seconds(self, operator_delay: float, step_seconds: float) -> float:
        """Time to leave before the next fault: detection, the slower arm's answer, the effect, and margin."""
        answer = operator_delay if self.needs_operator and self.alert else 0.0
        lasting = self.lasts_steps * step_seconds
        if self.slowdown > 1:  # its steps are made to last past its detection (build_schedule): then the effect
            return lasting + self.effect_seconds + 20.0
        return max(lasting, self.detect_seconds + answer) + self.effect_seconds + 20.0


#: The faults of a full campaign, in the order they are played. `for` durations are the shipped ones
#: (rankscope.mixin.config.Tunables): a straggler must outlast the imbalance alert's 10 minutes.
KINDS: tuple[Kind, ...] = (
    Kind("nonfinite", "3 steps of NaN loss on rank 0", "RankscopeNonFiniteSteps", False,
         trainer={"kind": "nonfinite", "steps": 3}, detect_seconds=5, needs_operator=False),
    Kind("slow_checkpoint", "one checkpoint 15 s slower", None, False,
         trainer={"kind": "slow_checkpoint", "seconds": 15.0}, detect_seconds=0, needs_operator=False,
         effect_seconds=30),
    Kind("hang_data", "rank 1's data loader never delivers", "RankscopeRankHung", True,
         also=("RankscopeRunStalled",), trainer={"kind": "hang", "where": "data"}, detect_seconds=12,
         restarts=1, effect_seconds=60),
    # The learning rate 10x too high, kept in every checkpoint after it: the loss does not come back by itself
    # (at the schedule's converged step 10x held the model at chance for minutes; 4x raised the loss for two
    # minutes and it came back). The shipped action rolls back to a checkpoint from before the spike (its
    # lookback: the loss's smoothing and the alert's `for`); with --set divergence_action=reduce_lr the rate is
    # halved instead, again while it diverges.
    Kind("diverge", "the learning rate 10x too high (kept in checkpoints)", "RankscopeLossDiverging", False,
         trainer={"kind": "diverge", "lr_factor": 10.0}, detect_seconds=240, effect_seconds=300),
    # A node's memory, not a rank's: the alert names the node (both ranks share this machine's).
    Kind("memory", "host memory grows on rank 1", "RankscopeHostMemoryHigh", False,
         trainer={"kind": "memory_balloon"}, detect_seconds=90, effect_seconds=30, lasts_steps=0),
    # Twice its step time: the imbalance rule compares the slowest rank's compute time with the other ranks' median.
    Kind("straggler", "rank 1 slowed to twice its step time, then normal", "RankscopeRankImbalance", True,
         trainer={"kind": "straggler", "mode": "sleep"}, detect_seconds=660, needs_operator=False,
         effect_seconds=30, alert_for_seconds=duration_seconds(Tunables().imbalance_for)),
    Kind("hang_collective", "rank 1 leaves the all-reduce out and waits elsewhere", "RankscopeRankHung", True,
         also=("RankscopeRunStalled",), trainer={"kind": "hang", "where": "collective"}, detect_seconds=12,
         restarts=1, effect_seconds=60),
    # torchrun restarts the group within seconds; the killed rank's next process names it (rankscope.exits).
    Kind("kill9", "rank 1 killed with SIGKILL", "RankscopeRankVanished", True, by_runner=True, detect_seconds=30,
         needs_operator=False, restarts=1, effect_seconds=60),
    Kind("preempt", "SIGTERM to the job, then started again", None, False, by_runner=True, detect_seconds=0,
         needs_operator=False, effect_seconds=60),
    # A broken shard: scrambled captions for as long as the alert takes to see them and a minute more (sized in
    # batches by build_schedule); a halved rate cannot fix the data, the rollback skips what it trained of it.
    Kind("poison", "a stretch of scrambled captions (the loss diverges)", "RankscopeLossDiverging", False,
         trainer={"kind": "poison"}, detect_seconds=240, effect_seconds=120),
)  # fmt: skip
#: The full campaign: one fault of each kind a real run meets.
FULL_KINDS = tuple(kind.name for kind in KINDS)
#: `--quick`: one fault of three kinds (a training fault, a hang, one the loop must not mistake for a hang).
QUICK_KINDS = ("nonfinite", "hang_data", "slow_checkpoint")


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule."""

    id: str
    kind: Kind
    at_step: int
    rank: int
    until_step: int = 0

    def trainer_entry(self) -> dict[str, Any] | None:
        """The trainer's `faults.schedule` entry (None for a fault the runner injects)."""
        if self.kind.by_runner:
            return None
        entry = dict(self.kind.trainer)
        entry["at_step" if entry["kind"] != "poison" else "at_batch"] = self.at_step
        if entry["kind"] not in ("diverge", "slow_checkpoint", "poison"):
            entry["rank"] = self.rank
        if self.until_step:
            entry["until_step"] = self.until_step
        return entry

    def describe(self) -> str:
        return f"{self.kind.name} @ step {self.at_step}" + (f" (rank {self.rank})" if self.kind.names_rank else "")


def build_schedule(
    kinds: tuple[str, ...], *, step_seconds: float, operator_delay: float, seed: int, warmup_steps: int,
    memory: dict[str, Any] | None = None, straggler_seconds: float | None = None,
) -> list[Fault]:  # fmt: skip
    """The faults of `kinds`, in that order, each placed after the previous one's span; a seeded jitter of up
    to a tenth of a span moves each start, so faults do not sit on checkpoint or log boundaries by design."""
    by_name = {kind.name: kind for kind in KINDS}
    unknown = [name for name in kinds if name not in by_name]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    rng = random.Random(seed)
    faults: list[Fault] = []
    step = warmup_steps
    for name in kinds:
        kind = by_name[name]
        if kind.name == "memory" and memory:
            kind = Kind(**{**kind.__dict__, "trainer": {**kind.trainer, **memory}})
        if kind.name == "straggler":
            # Slowed long enough for the shipped 10-minute `for` (and a minute more), then normal again.
            extra = straggler_seconds if straggler_seconds is not None else step_seconds
            slowdown = (step_seconds + extra) / step_seconds
            lasting = math.ceil((kind.detect_seconds + 60) / (step_seconds + extra))
            kind = Kind(**{**kind.__dict__, "lasts_steps": lasting, "slowdown": slowdown,
                           "trainer": {**kind.trainer, "seconds": extra}})  # fmt: skip
        if kind.name == "poison":
            # Long enough to matter: 400 batches (13 s) were over, and shrugged off, before the rule could see them.
            batches = math.ceil((kind.detect_seconds + 60) / step_seconds)
            kind = Kind(**{**kind.__dict__, "lasts_steps": batches, "trainer": {**kind.trainer, "batches": batches}})
        span = kind.span_seconds(operator_delay, step_seconds) / step_seconds
        at = step + rng.randint(0, max(1, int(span / 10)))
        until = at + kind.lasts_steps if kind.lasts_steps and kind.name != "poison" else 0  # poison: its batches
        if kind.name == "memory":
            until = at + math.ceil((kind.detect_seconds + operator_delay + 30) / step_seconds)
        faults.append(Fault(f"{name}-{len(faults) + 1}", kind, at, rank=0 if name == "nonfinite" else 1,
                            until_step=until))  # fmt: skip
        step = at + math.ceil(span)
    return faults
