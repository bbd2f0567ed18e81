"""The fault campaign's table: what each arm of `python -m benchmarks.campaign --json FILE` reported, as rows of
cells. The campaign prints them in a terminal; the run report (`rankscope-report --campaign FILE`) shows the same
rows as a section. One source for both, so the two never say different things.

FILE is the campaign's own JSON (docs/campaign.md): `arms` (one summary per arm: wall time, goodput from the
ledger and from the ground truth, time to target, final validation loss, false alarms, per-fault outcomes),
`goals`, `failed`, `target_loss`, `operator_delay`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rankscope.report.errors import ReportError
from rankscope.report.html import Note, Paragraph, Section, Table

__all__ = [
    "ARM_HEADERS",
    "EQUAL_SPEED_TITLE",
    "FAULT_HEADERS",
    "arm_rows",
    "campaign_section",
    "equal_speed_rows",
    "fault_rows",
    "fmt",
    "problem_lines",
    "read_campaign",
    "steps_to_target",
]

ARM_HEADERS = ("arm", "wall", "tail", "goodput", "(truth)", "to target", "final val", "vs free", "false alarms")
FAULT_HEADERS = ("fault", "alert (rank)", "detect", "action -> outcome", "act", "cost", "(steps)", "redone")
EQUAL_SPEED_TITLE = "time to target at equal step time (its wall time over the arm's median step)"


def fmt(value: float | None, spec: str, unit: str = "", scale: float = 1.0) -> str:
    """`value` (times `scale`) in `spec`, then `unit`; "-" where there is none."""
    return "-" if value is None else f"{value * scale:{spec}}{unit}"


def steps_to_target(seconds_to_target: float | None, median_step_seconds: float | None) -> float | None:
    """An arm's time to target in its own median steps' time: the same on a machine uniformly faster or slower, so
    arms run an hour apart compare (the machine's speed drifts between them)."""
    if seconds_to_target is None or not median_step_seconds:
        return None
    return seconds_to_target / median_step_seconds


def _fault_free(arms: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((a for a in arms if a.get("name") == "fault-free"), None)


def arm_rows(arms: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row per arm, under ARM_HEADERS; "vs free" is its final validation loss against the fault-free run's."""
    ff = _fault_free(arms)
    ff_loss = ff.get("final_val_loss") if ff else None
    rows = []
    for arm in arms:
        loss = arm.get("final_val_loss")
        versus = loss / ff_loss - 1 if loss and ff_loss else None
        rows.append([
            str(arm["name"]), fmt(arm["wall_seconds"], ".0f", " s"), fmt(arm.get("tail_seconds"), ".0f", " s"),
            fmt(arm.get("goodput_ledger"), ".1%"), fmt(arm.get("goodput_truth"), ".1%"),
            fmt(arm.get("seconds_to_target"), ".0f", " s"), fmt(loss, ".4f"), fmt(versus, "+.1%"),
            str(len(arm.get("false_alarms") or [])),
        ])  # fmt: skip
    return rows


def equal_speed_rows(arms: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """[arm, its median step, its time to target in steps' time, against the fault-free run's, the step whose
    validation first reached the target]; none where the fault-free run has no time to target or no median step (a
    record from before the campaign kept it)."""
    ff = _fault_free(arms)
    ff_steps = steps_to_target(ff.get("seconds_to_target"), ff.get("median_step_seconds")) if ff else None
    if ff_steps is None:
        return []
    rows = []
    for arm in arms:
        steps = steps_to_target(arm.get("seconds_to_target"), arm.get("median_step_seconds"))
        versus = steps / ff_steps - 1 if steps is not None and arm is not ff else None
        rows.append([str(arm["name"]), fmt(arm.get("median_step_seconds"), ".1f", " ms", 1000), fmt(steps, ",.0f"),
                     "" if versus is None else f"{versus:+.1%}", fmt(arm.get("target_step"), ",.0f")])  # fmt: skip
    return rows


def fault_rows(arm: Mapping[str, Any]) -> list[list[str]]:
    """One row per fault of a faulted arm, under FAULT_HEADERS."""
    rows = []
    for fault in arm.get("faults") or []:
        named = f"{fault['alert']} ({fault.get('alert_rank', '')})" if fault.get("alert") else "none"
        acted = f"{fault['action']} -> {fault.get('outcome', '')}" if fault.get("action") else "-"
        rows.append([
            f"{fault['kind']} @ {fault['at_step']}", named, fmt(fault.get("detect_seconds"), ".1f", " s"), acted,
            fmt(fault.get("action_seconds"), ".1f", " s"), fmt(fault.get("cost_seconds"), ".0f", " s"),
            fmt(fault.get("cost_steps"), ".0f"), str(fault.get("steps_retrained", 0)),
        ])  # fmt: skip
    return rows


def problem_lines(arms: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every false alarm and everything lost, one line each, arm by arm."""
    lines = []
    for arm in arms:
        lines += [f"false alarm ({arm['name']}): {alarm}" for alarm in arm.get("false_alarms") or []]
        lines += [f"lost ({arm['name']}): {item}" for item in arm.get("lost") or []]
    return lines


def read_campaign(path: Path) -> dict[str, Any]:
    """The campaign's --json file; ReportError naming the problem where it is not one."""
    try:
        payload = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"cannot read the campaign {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"the campaign {path} is not JSON: {exc}") from None
    arms = payload.get("arms") if isinstance(payload, dict) else None
    if not isinstance(arms, list) or not arms:
        raise ReportError(f"the campaign {path} has no arms: not the file `python -m benchmarks.campaign --json` wrote")
    for arm in arms:
        if not isinstance(arm, dict) or not isinstance(arm.get("name"), str) or "wall_seconds" not in arm:
            raise ReportError(f"the campaign {path}: an arm without a name or a wall time: {str(arm)[:80]}")
    return payload


def campaign_section(path: Path) -> Section:
    """The report's section of the campaign in `path`: the arms, time to target at equal step time, each faulted
    arm's faults, the goals. ReportError in one line where the file is not a campaign's, or holds a figure that
    cannot be shown (a field missing, a number that is not one)."""
    payload = read_campaign(path)
    try:
        return _section(payload, path)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ReportError(f"the campaign {path}: cannot show its figures ({type(exc).__name__}: {exc})") from None


def _section(payload: Mapping[str, Any], source: Path) -> Section:
    arms = payload["arms"]
    target = payload.get("target_loss")
    intro = (f"From {source}. " + (f"Target validation loss {target:.4f} (the fault-free run's at 90 % of its "
             "steps). " if isinstance(target, int | float) else "")
             + f"Operator delay (loop off) {fmt(payload.get('operator_delay'), '.0f', ' s')}.")  # fmt: skip
    section = Section("campaign", "Fault campaign", [Paragraph(intro), Table(ARM_HEADERS, arm_rows(arms))])
    equal = equal_speed_rows(arms)
    if equal:
        section.blocks.append(Table(("arm", "median step", "steps' time to target", "vs fault-free",
                                     "target first at step"), equal,
                                    caption=EQUAL_SPEED_TITLE))  # fmt: skip
    for arm in arms:
        if arm.get("faults"):
            section.blocks.append(Table(FAULT_HEADERS, fault_rows(arm), caption=f"loop {arm['name']}: per fault"))
    goals = [g for g in payload.get("goals") or [] if isinstance(g, dict)]
    if goals:
        rows = [["met" if g.get("met") else "NOT met", str(g.get("goal", "")), str(g.get("figure", ""))] for g in goals]
        section.blocks.append(Table(("", "goal (the loop-on arm)", "figure"), rows, caption="goals"))
    for line in problem_lines(arms) + [f"FAILED {line}" for line in payload.get("failed") or []]:
        section.blocks.append(Note(line))
    return section
