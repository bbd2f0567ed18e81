"""From the arms' raw records to the campaign's table: goodput two ways, time to target, per-fault detection
and cost, false alarms, nothing lost.

Ground truth, from outside the library (the run log's per-step records and the runner's clock):

- a step's time is from the record before it in the same incarnation (the previous step's end, a validation's
  or a checkpoint's end, or, for the first step, the `start` record the trainer writes when its set-up is
  done and its loop begins) to its own end;
- the steps that count are each step's last record (a restart, a resume or a rollback trains a step again,
  and only its last training is in the final model);
- a step that counts whose time is past the hang threshold, max(`hang_floor_seconds`, `hang_step_multiple` x the
  arm's median step), is a stall: a hang, as the hang alert and the ledger define it (rankscope.hang_threshold),
  not training, though it ended by itself (a paused machine, an I/O stall). An incarnation's first step, timed
  from its `start` record, is never a stall, as in the ledger;
- goodput is their time over the job's wall time: from the first rank 0 process's start (the OS's clock) to
  the run's end (the run log's last `finished` record). The linger and teardown after it, up to the last exit
  the runner saw (its clock), are reported beside as the tail: no bucket of the ledger's counts them either.

The ledger's goodput is (training - lost) / (every bucket but lost), as rankscope.goodput keeps it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from rankscope.hang_threshold import duration_seconds
from rankscope.mixin.config import Tunables

from .arm import ArmRecord
from .schedule import Fault

__all__ = ["ArmSummary", "FaultOutcome", "summarise", "target_loss"]

#: Goodput, ledger against ground truth, may differ by this share of the wall time.
GOODPUT_TOLERANCE = 0.02
#: An alert that starts this long after its fault's window still belongs to it (the `for` and an evaluation).
GRACE_SECONDS = 5.0
#: How long after a lasting fault stopped acting (its `fault_end`) its alert may still start: the shipped rules'
#: rates reach back `rate_window`, and a slow group is evaluated every `slow_interval`.
SETTLE_SECONDS = duration_seconds(Tunables().rate_window) + duration_seconds(Tunables().slow_interval) + GRACE_SECONDS
#: The run-level alert on goodput over the last `goodput_window` (under `goodput_ratio`).
GOODPUT_ALERT = "RankscopeGoodputLow"


@dataclass
class FaultOutcome:
    id: str
    kind: str
    at_step: int
    rank: int
    injected_at: float | None
    alert: str | None
    """The alert that named it (None: none did)."""
    alert_rank: str
    detect_seconds: float | None
    action: str
    outcome: str
    action_seconds: float | None
    """From the injection to the action applied on every rank."""
    cost_seconds: float | None
    """Its window's wall time over the fault-free run's for the same steps."""
    steps_retrained: int
    problems: list[str] = field(default_factory=list)
    cost_steps: float | None = None
    """The same in steps' time: its window's wall time over its arm's median step, less the fault-free run's over
    that arm's. A machine slower or faster throughout (one hour's arm against another's) changes cost_seconds by
    every step of the window, and this not at all."""


@dataclass
class ArmSummary:
    name: str
    wall_seconds: float
    tail_seconds: float
    """From the run's end (`finished`) to the last exit: the linger and the teardown."""
    goodput_truth: float
    goodput_ledger: float | None
    seconds_to_target: float | None
    final_val_loss: float | None
    final_val_step: int | None
    faults: list[FaultOutcome]
    false_alarms: list[str]
    lost: list[str]
    """What was lost: steps missing from the log, checkpoints that do not load, a job that did not finish."""
    stalled_seconds: float = 0.0
    """Steps that count, past the hang threshold (the ground truth's hang): a machine that stopped."""
    stalled_steps: int = 0
    stolen_seconds: float | None = None
    """CPU time the hypervisor took while the arm ran (ArmRecord.stolen_seconds)."""
    truth_buckets: dict[str, float] = field(default_factory=dict)
    """The ground truth's wall time by what the run log shows (truth_buckets())."""
    ledger_buckets: dict[str, float] = field(default_factory=dict)
    """The ledger's totals, by bucket."""
    median_step_seconds: float | None = None
    """The median time of a step (not an incarnation's first): the machine's speed over the arm."""
    target_step: int | None = None
    """The step whose validation first reached the target loss: how far training had to go, at any speed."""

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "faults": [f.__dict__ for f in self.faults]}


def _incarnations(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The run log cut at each `start` record (one list per launch or restart), each in time order."""
    parts: list[list[dict[str, Any]]] = []
    for record in records:
        if record.get("type") == "start" or not parts:
            parts.append([])
        parts[-1].append(record)
    return [sorted(part, key=lambda r: r["time"]) for part in parts]


@dataclass(frozen=True)
class _Training:
    step: int
    ended: float
    seconds: float
    """From the record before it in its incarnation (0 where there is none)."""
    first: bool
    """Its incarnation's first step, timed from the `start` record: never a hang (start-up, a checkpoint load)."""


def _trainings(records: list[dict[str, Any]]) -> list[_Training]:
    """Every training of every step, in each incarnation's time order."""
    found: list[_Training] = []
    for part in _incarnations(records):
        previous: dict[str, Any] | None = None
        for record in part:
            kind = record.get("type")
            if kind == "train":
                seconds = record["time"] - previous["time"] if previous is not None else 0.0
                first = previous is None or previous.get("type") == "start"
                found.append(_Training(int(record["step"]), record["time"], seconds, first))
            if kind in ("start", "train", "val", "checkpoint"):
                previous = record
    return found


def step_times(records: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """step -> (its last training's end, its duration), by the ground truth's rules (module docstring)."""
    return _by_step(_trainings(records))


def _by_step(trainings: list[_Training]) -> dict[int, tuple[float, float]]:
    return {t.step: (t.ended, t.seconds) for t in trainings}


def _stalls(trainings: list[_Training]) -> dict[int, float]:
    """step -> its time, for the steps that count whose time is past the hang threshold: max(floor, multiple x the
    arm's median step), with the shipped `hang_floor_seconds` and `hang_step_multiple`. Computed here, not with
    rankscope.hang_threshold, so that the ledger is checked against an independent reading: the ledger and the
    alert follow the recent mean step instead, and on the campaign's steps (tens of milliseconds) both are the
    floor."""
    tunables = Tunables()
    threshold = max(tunables.hang_floor_seconds, tunables.hang_step_multiple * (_median_step(trainings) or 0.0))
    last = {t.step: t for t in trainings}
    return {t.step: t.seconds for t in last.values() if not t.first and t.seconds > threshold}


def _median_step(trainings: list[_Training]) -> float | None:
    """The median time of every training but an incarnation's first (start-up, a checkpoint load)."""
    steady = [t.seconds for t in trainings if not t.first]
    return statistics.median(steady) if steady else None


def _truth_buckets(
    arm: ArmRecord, end: float, trainings: list[_Training], stalled: dict[int, float]
) -> dict[str, float]:
    """The ground truth's wall time to `end`, by what the run log shows: what the failed check prints beside the
    ledger's buckets, to say where the two part."""
    last = {t.step: t for t in trainings}
    buckets = {
        "steps kept": sum(t.seconds for t in last.values() if t.step not in stalled),
        "stalls": sum(stalled.values(), 0.0),
        "steps trained again": sum(t.seconds for t in trainings) - sum(t.seconds for t in last.values()),
        "checkpoint": 0.0,
        "validation": 0.0,
    }
    for part in _incarnations(arm.records):
        previous: float | None = None
        for record in part:
            kind = record.get("type")
            if kind in ("val", "checkpoint") and previous is not None:
                buckets["validation" if kind == "val" else "checkpoint"] += record["time"] - previous
            if kind in ("start", "train", "val", "checkpoint"):
                previous = record["time"]
    between = (end - arm.started_at) - sum(buckets.values())
    return {"start-up and restarts": between, **buckets}


def target_loss(fault_free: ArmRecord) -> tuple[float, int]:
    """The fault-free run's validation loss at 90 % of its steps (its last validation at or before), and
    that validation's step."""
    vals = [r for r in fault_free.records if r.get("type") == "val" and r.get("loss") is not None]
    cut = 0.9 * fault_free.max_steps
    before = [r for r in vals if r["step"] <= cut] or vals[:1]
    if not before:
        raise RuntimeError("the fault-free run logged no validation: no target loss")
    chosen = before[-1]
    return float(chosen["loss"]), int(chosen["step"])


def _final_val(arm: ArmRecord) -> tuple[float | None, int | None]:
    vals = [r for r in arm.records if r.get("type") == "val" and r.get("loss") is not None]
    if not vals:
        return None, None
    last = max(vals, key=lambda r: (r["step"], r["time"]))
    return float(last["loss"]), int(last["step"])


def _trainer_name(fault: Fault) -> str:
    """How the trainer names the fault in its records: by kind and step (poison: data batch), faults.FaultEvent."""
    entry = fault.trainer_entry() or {}
    return f"{entry.get('kind')}-{'batch' if entry.get('kind') == 'poison' else 'step'}{fault.at_step}"


def _injected_at(fault: Fault, arm: ArmRecord) -> float | None:
    """When the fault began: the trainer's `fault` record (written by the rank that fired it, before it acts),
    or the runner's own clock for the faults it plays."""
    for event in arm.runner_events:
        if event.get("id") == fault.id:
            return float(event["time"])
    fired = [r for r in arm.records if r.get("type") == "fault" and r.get("name") == _trainer_name(fault)]
    return min(float(r["time"]) for r in fired) if fired else None


def _stopped_at(fault: Fault, arm: ArmRecord) -> float | None:
    """When a fault that acts over a window of steps stopped acting (its last `fault_end` record), or None."""
    ended = [r["time"] for r in arm.records if r.get("type") == "fault_end" and r.get("name") == _trainer_name(fault)]
    return max(ended) if ended else None


def summarise(
    arm: ArmRecord,
    schedule: list[Fault],
    fault_free: ArmRecord | None,
    target: float | None,
    tunables: Tunables | None = None,
) -> ArmSummary:
    """The arm's figures; `tunables` are its rules' (the shipped ones by default), which judge its run-level alerts."""
    faults = schedule if arm.name != "fault-free" else []
    trainings = _trainings(arm.records)
    times = _by_step(trainings)
    ff_trainings = _trainings(fault_free.records) if fault_free is not None else []
    ff_times = _by_step(ff_trainings)
    speeds = (_median_step(trainings), _median_step(ff_trainings))
    finished = [r["time"] for r in arm.records if r.get("type") == "finished"]
    end = max(finished) if finished else arm.ended_at
    wall = end - arm.started_at
    stalled_steps = _stalls(trainings)
    stalled = sum(stalled_steps.values(), 0.0)
    productive = sum(duration for _, duration in times.values()) - stalled
    totals = arm.ledger.get("totals", {})
    ledger_wall = sum(v for k, v in totals.items() if k != "lost")
    ledger = (totals.get("training", 0.0) - totals.get("lost", 0.0)) / ledger_wall if ledger_wall else None

    injected = {fault.id: _injected_at(fault, arm) for fault in faults}
    windows = []
    alert_ends: dict[str, float] = {}
    stopped: dict[str, float | None] = {}
    for index, fault in enumerate(faults):
        end_step = faults[index + 1].at_step if index + 1 < len(faults) else arm.max_steps
        start = injected[fault.id]
        next_start = injected[faults[index + 1].id] if index + 1 < len(faults) else arm.ended_at
        windows.append((fault, start, next_start or arm.ended_at, end_step))
        # Its alert may come after the next fault began where its effect lasted into the next one's span (a
        # machine faster than the calibration runs a window of steps in less time than the alert's `for`).
        stopped[fault.id] = _stopped_at(fault, arm)
        ended = stopped[fault.id]
        alert_ends[fault.id] = max(windows[-1][2], ended + SETTLE_SECONDS if ended is not None else 0.0)

    redone = _redone(arm, windows)
    outcomes = [_outcome(arm, fault, start, (alert_ends[fault.id], stopped[fault.id]), end, end_step, times,
                         ff_times, redone, speeds) for fault, start, end, end_step in windows]  # fmt: skip
    false_alarms = _false_alarms(arm, [(fault, start, alert_ends[fault.id]) for fault, start, _, _ in windows],
                                 times, stalled_steps, tunables or Tunables())  # fmt: skip
    val_loss, val_step = _final_val(arm)
    to_target = target_step = None
    if target is not None:
        reached = sorted((r["time"], r.get("step")) for r in arm.records
                         if r.get("type") == "val" and r.get("loss") is not None and r["loss"] <= target)  # fmt: skip
        if reached:
            to_target, target_step = reached[0][0] - arm.started_at, reached[0][1]
    return ArmSummary(
        name=arm.name, wall_seconds=wall, tail_seconds=arm.ended_at - end,
        goodput_truth=productive / wall if wall > 0 else 0.0,
        goodput_ledger=ledger, stalled_seconds=stalled, stalled_steps=len(stalled_steps),
        stolen_seconds=arm.stolen_seconds, ledger_buckets=totals,
        truth_buckets=_truth_buckets(arm, end, trainings, stalled_steps),
        seconds_to_target=to_target, final_val_loss=val_loss, final_val_step=val_step,
        faults=outcomes, false_alarms=false_alarms, lost=_lost(arm, times), median_step_seconds=speeds[0],
        target_step=target_step,
    )  # fmt: skip


def _redone(arm: ArmRecord, windows: list[tuple[Fault, float | None, float, int]]) -> dict[str, int]:
    """Steps trained again (a resume or rollback went back over them), by the fault in whose time window the
    training happened again: a restart's resume trains steps from before its fault's own step."""
    seen: set[int] = set()
    counts: dict[str, int] = {}
    for record in sorted((r for r in arm.records if r.get("type") == "train"), key=lambda r: r["time"]):
        if record["step"] in seen:
            owner = next((f.id for f, start, end, _ in windows if start is not None and start <= record["time"] < end),
                         None)  # fmt: skip
            if owner is not None:
                counts[owner] = counts.get(owner, 0) + 1
        seen.add(record["step"])
    return counts


def _outcome(
    arm: ArmRecord, fault: Fault, start: float | None, until: tuple[float, float | None], end: float, end_step: int,
    times: dict[int, tuple[float, float]], ff_times: dict[int, tuple[float, float]], redone: dict[str, int],
    speeds: tuple[float | None, float | None],
) -> FaultOutcome:  # fmt: skip
    """`speeds`: the median step of the arm and of the fault-free run (cost_steps)."""
    kind = fault.kind
    alert_end, stopped = until  # to when its alert may start; when a fault over a window of steps stopped
    problems = []
    alert = None
    if start is None:
        problems.append("no record of its injection")
    elif kind.alert is not None:
        alert = next((a for a in arm.alerts if a["alertname"] == kind.alert and start - 1 <= a["start"] <= alert_end
                      and (not kind.names_rank or a["rank"] == str(fault.rank))), None)  # fmt: skip
        if alert is None:
            named = [f"{a['alertname']}{{rank={a['rank']}}}" for a in arm.alerts
                     if a["alertname"] == kind.alert and start - 1 <= a["start"] <= alert_end]  # fmt: skip
            problem = f"not named by {kind.alert}" + (f" with rank {fault.rank} (got {named})" if named else "")
            if stopped is not None and stopped - start < kind.alert_for_seconds:
                # A window of steps sized from the plan's calibration lasts less on a faster machine (docs/campaign.md).
                lasted, needed = stopped - start, kind.alert_for_seconds
                problem += f": it lasted {lasted:.0f} s, under its alert's `for` ({needed:.0f} s)"
            problems.append(problem)
    action, outcome, action_at = "", "", None
    if alert is not None and start is not None:
        acted = [r for r in arm.records if r.get("type") == "action" and r.get("time") and alert["start"] - 1
                 <= r["time"] <= end + GRACE_SECONDS and kind.alert in (r.get("reason") or "")]  # fmt: skip
        if acted:
            first = min(acted, key=lambda r: r["time"])
            action, outcome, action_at = first.get("action") or "", first.get("result") or "", first["time"]
    retrained = redone.get(fault.id, 0)
    cost = cost_steps = None
    a, b = fault.at_step - 1, end_step - 1
    # From the step before the fault as it first ended (a restart trains it again later: its last training
    # would start the window after the fault) to the window's last step as it last ended.
    before = min((r["time"] for r in arm.records if r.get("type") == "train" and r.get("step") == a), default=None)
    if before is not None and b in times and a in ff_times and b in ff_times:
        cost = (times[b][0] - before) - (ff_times[b][0] - ff_times[a][0])
        step, ff_step = speeds
        if step and ff_step:
            cost_steps = (times[b][0] - before) / step - (ff_times[b][0] - ff_times[a][0]) / ff_step
    return FaultOutcome(
        id=fault.id, kind=kind.name, at_step=fault.at_step, rank=fault.rank, injected_at=start,
        alert=alert["alertname"] if alert else None, alert_rank=alert["rank"] if alert else "",
        detect_seconds=alert["start"] - start if alert and start is not None else None,
        action=action, outcome=outcome, action_seconds=action_at - start if action_at and start else None,
        cost_seconds=cost, steps_retrained=retrained, problems=problems, cost_steps=cost_steps,
    )  # fmt: skip


def _false_alarms(
    arm: ArmRecord,
    windows: list[tuple[Fault, float | None, float]],
    times: dict[int, tuple[float, float]],
    stalled: dict[int, float],
    tunables: Tunables,
) -> list[str]:
    """Alerts no fault explains: outside every fault's window (to when its alert may come), or of a name its fault
    does not explain. A low-goodput alert judges the run's last `goodput_window`, the sum of every fault in it and
    none alone: it is explained where the ground truth's goodput over that window was under the rules' line too
    (within the ledger's tolerance)."""
    found = []
    for alert in arm.alerts:
        explained = any(
            start is not None and start - 1 <= alert["start"] <= end + GRACE_SECONDS
            and alert["alertname"] in (fault.kind.alert, *fault.kind.also)
            for fault, start, end in windows
        )  # fmt: skip
        if alert["alertname"] == GOODPUT_ALERT:
            window = duration_seconds(tunables.goodput_window)
            truth = _window_goodput(arm, times, stalled, alert["start"] - window, alert["start"])
            explained = truth < tunables.goodput_ratio + GOODPUT_TOLERANCE
        if not explained:
            at = alert["start"] - arm.started_at
            found.append(f"{alert['alertname']}{{rank={alert['rank']}}} at {at:.0f} s")
    return found


def _window_goodput(
    arm: ArmRecord, times: dict[int, tuple[float, float]], stalled: dict[int, float], start: float, end: float
) -> float:
    """The ground truth's goodput from `start` (the job's start where that is later) to `end`: the time of the
    steps that count, and did not stall, within it, over its length."""
    start = max(arm.started_at, start)
    if end <= start:
        return 1.0
    kept = sum(
        max(0.0, min(ended, end) - max(ended - seconds, start))
        for step, (ended, seconds) in times.items() if step not in stalled
    )  # fmt: skip
    return kept / (end - start)


def _lost(arm: ArmRecord, times: dict[int, tuple[float, float]]) -> list[str]:
    lost = []
    missing = [step for step in range(1, arm.max_steps + 1) if step not in times]
    if missing:
        lost.append(f"{len(missing)} step(s) missing from the run log (first {missing[:5]})")
    lost += [f"checkpoint does not load: {u}" for u in arm.unreadable_checkpoints]
    if not arm.checkpoints:
        lost.append("no checkpoint left at the end")
    if not arm.exit_codes or arm.exit_codes[-1] != 0:
        lost.append(f"the job did not end cleanly (exit codes {arm.exit_codes})")
    return lost
