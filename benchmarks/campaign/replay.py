"""Replay a campaign run's logged training losses through a loss alert, as promtool evaluates it.

    python -m benchmarks.campaign.replay WORKDIR/on/log.jsonl [...] [--rules prometheus/rules] [--alert NAME]

The trainer logs rank 0's loss at every step. Each second (the campaign's scrape and evaluation interval) becomes
one scrape of what rank 0 served: `rankscope_loss{split="train"}`, `rankscope_last_step_timestamp_seconds` and
`rankscope_steps_total`, holding the last step's values (through a hang too, as a hung rank serves them), or none
from a process's last step to the next process's start (a restart: the target is down), and its applied rollbacks
(the log's action records), counted and timed as the control channel serves them. promtool then evaluates the
rule files the alert needs (`RULE_FILES`: `RankscopeLossDiverging`, the default, or `RankscopeLossPlateau`) over
it at the same interval, and every second at which the alert was firing is read back from its report. The firing
stretches are printed against the run's faults: one that begins within `--attribution` seconds of a fault names
it; any other is a false alarm.

This is a stand-in for the rank-averaged loss (rank 0's alone) on the rules as generated, not a copy of them:
what a rule change would have done on runs already made, before a campaign runs it.
"""

from __future__ import annotations

import argparse
import bisect
import math
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.campaign.runlog import read_records

__all__ = ["Replay", "firing_seconds", "replay", "rollbacks_served", "step_counts", "scrapes"]

ALERT = "RankscopeLossDiverging"
#: The alerts the replay can evaluate, and the rule files (of the generated rules) each needs: its own, and those
#: recording what it reads.
RULE_FILES = {
    "RankscopeLossDiverging": ("hangs.yml", "training.yml"),
    "RankscopeLossPlateau": ("hangs.yml", "training.yml", "performance.yml", "liveness.yml", "convergence.yml"),
}
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Replay:
    start: float
    """Unix time of the first scrape."""
    faults: list[tuple[str, float]]
    """(fault name, Unix time it was played), first play of each."""
    firing: list[tuple[int, int]]
    """(first, last) second after `start` of each stretch the alert was firing."""

    def lines(self, attribution: float) -> list[str]:
        out = []
        for first, last in self.firing:
            at = self.start + first
            cause = [(name, at - played) for name, played in self.faults if 0 <= at - played <= attribution]
            what = f"{cause[-1][0]} +{cause[-1][1]:.0f} s" if cause else "FALSE ALARM"
            out.append(f"  firing {first:6d}-{last:6d} s  ({last - first + 1:4d} s)  {what}")
        return out


def _starts(records: list[dict[str, Any]]) -> list[float]:
    """When each process began (its `start` record), in order."""
    return sorted(r["time"] for r in records if r.get("type") == "start")


def _process_start(starts: list[float], t: float) -> float:
    """When the process serving at `t` began (-inf before the first)."""
    index = bisect.bisect_right(starts, t)
    return starts[index - 1] if index else -math.inf


def scrapes(records: list[dict[str, Any]]) -> tuple[float, list[float | None], list[float | None]]:
    """(time of the first scrape, then one value a second of the loss and of the last step's time, the latter
    from the first scrape): what rank 0 served. Between two steps, and through a hang, the last step's values
    (the gauges hold); none from a process's last record to the next process's start record (a restart: its
    target is down)."""
    train = [(r["time"], r["loss"]) for r in records if r.get("type") == "train"]
    if not train:
        raise ValueError("no training steps in the log")
    times = [t for t, _ in train]
    starts = _starts(records)
    first = float(int(times[0]) + 1)
    losses: list[float | None] = []
    steps: list[float | None] = []
    t = first
    while t <= times[-1]:
        i = bisect.bisect_right(times, t) - 1
        restarted = bisect.bisect_right(starts, t) > bisect.bisect_right(starts, times[i])
        losses.append(None if restarted else train[i][1])
        steps.append(None if restarted else times[i] - first)
        t += 1.0
    return first, losses, steps


def rollbacks_served(records: list[dict[str, Any]], first: float, count: int) -> list[tuple[float, float] | None]:
    """What rank 0 served at each of `count` scrapes a second from `first`, as its process served them: the count of
    its applied rollbacks (`rankscope_control_actions_total{action="rollback", result="applied"}`) and the time of
    the last (`rankscope_control_last_applied_timestamp_seconds{action="rollback"}`), counted from `first`
    (promtool's clock starts at 0). None before a process's first one; gone with the process (a restarted one
    has none until its own, and counts from its own start)."""
    starts = _starts(records)
    applied = sorted(
        r["time"] for r in records if r.get("type") == "action" and r.get("action") == "rollback"
        and r.get("result") == "applied"
    )  # fmt: skip
    out: list[tuple[float, float] | None] = []
    for i in range(count):
        t = first + i
        began = _process_start(starts, t)
        upto = bisect.bisect_right(applied, t)
        done = upto - bisect.bisect_left(applied, began)
        out.append((float(done), applied[upto - 1] - first) if done > 0 else None)
    return out


def step_counts(records: list[dict[str, Any]], first: float, count: int) -> list[float | None]:
    """What rank 0 served at each of `count` scrapes a second from `first` as `rankscope_steps_total`: the steps its
    process has trained (a restarted one counts from its own start)."""
    starts = _starts(records)
    trained = sorted(r["time"] for r in records if r.get("type") == "train")
    out: list[float | None] = []
    for i in range(count):
        t = first + i
        began = _process_start(starts, t)
        out.append(float(bisect.bisect_right(trained, t) - bisect.bisect_left(trained, began)))
    return out


def _series_values(values: list[float | None]) -> str:
    """promtool's notation: a value per interval, `stale` where a scrape first failed, `_` after."""
    out, previous = [], 0.0
    for value in values:
        if value is None:
            out.append("_" if previous is None else "stale")
        else:
            out.append(repr(float(value)))
        previous = value
    return " ".join(out)


def _duration(text: str) -> int:
    """promtool's eval time (e.g. 1h2m3s) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([hms])", text))


def firing_seconds(report: str, alert: str = ALERT) -> list[int]:
    """The eval times at which promtool got the alert firing where the test expected none."""
    seconds = []
    for block in re.split(r"\n\s*alertname: ", report)[1:]:
        head, _, rest = block.partition("\n")
        match = re.match(rf"{alert}, time: (\S+?),", head)
        if match and "Labels:" in rest.split("got:", 1)[-1]:
            seconds.append(_duration(match.group(1)))
    return sorted(seconds)


def _stretches(seconds: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in seconds:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def replay(log: Path, rules_dir: Path, promtool: str = "promtool", alert: str = ALERT) -> Replay:
    records = read_records(log)
    start, values, last_steps = scrapes(records)
    served = [None if loss is None else rollbacks for loss, rollbacks in
              zip(values, rollbacks_served(records, start, len(values)), strict=True)]  # fmt: skip
    counted = step_counts(records, start, len(values))
    steps_total = [None if loss is None else count for loss, count in zip(values, counted, strict=True)]
    faults: dict[str, float] = {}
    for r in records:
        if r.get("type") == "fault":
            faults.setdefault(r["name"], r["time"])
    target = 'run_id="replay", rank="0", local_rank="0", node="n0", job="rankscope", instance="n0:9400"'
    labels = f'{target}, split="train"'
    test = {
        # The hang group records how old the run's last step is, which the alert reads.
        "rule_files": [str((rules_dir / name).resolve()) for name in RULE_FILES[alert]],
        "evaluation_interval": "1s",
        "tests": [
            {
                "interval": "1s",
                "input_series": [
                    {"series": f"rankscope_loss{{{labels}}}", "values": _series_values(values)},
                    {
                        "series": f"rankscope_last_step_timestamp_seconds{{{target}}}",
                        "values": _series_values(last_steps),
                    },
                    {
                        "series": f'rankscope_control_actions_total{{{target}, action="rollback", result="applied"}}',
                        "values": _series_values([None if r is None else r[0] for r in served]),
                    },
                    {
                        "series": f'rankscope_control_last_applied_timestamp_seconds{{{target}, action="rollback"}}',
                        "values": _series_values([None if r is None else r[1] for r in served]),
                    },
                    {"series": f"rankscope_steps_total{{{target}}}", "values": _series_values(steps_total)},
                ],
                "alert_rule_test": [
                    {"alertname": alert, "eval_time": f"{s}s", "exp_alerts": []} for s in range(len(values))
                ],
            }
        ],
    }
    with tempfile.TemporaryDirectory(prefix="rankscope-replay-") as tmp:
        path = Path(tmp) / "replay_test.yml"
        path.write_text(yaml.safe_dump(test, width=1 << 30))
        done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, check=False)
    report = done.stdout + done.stderr
    # A rule file it cannot find is only a warning to promtool, and every expectation of silence then holds.
    if "no file match" in report or done.returncode != 0 and f"alertname: {alert}" not in report:
        raise RuntimeError(f"promtool could not run the replay: {report.strip()[:500]}")
    firing = _stretches(firing_seconds(report, alert))
    return Replay(start, sorted(faults.items(), key=lambda item: item[1]), firing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.campaign.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="a campaign arm's log.jsonl")
    parser.add_argument("--rules", type=Path, default=REPO / "prometheus" / "rules", help="rules directory")
    parser.add_argument("--attribution", type=float, default=300.0, help="seconds after a fault that name it")
    parser.add_argument("--alert", choices=sorted(RULE_FILES), default=ALERT, help="the alert to replay")
    args = parser.parse_args(argv)
    promtool = shutil.which("promtool")
    if promtool is None:
        print("replay: error: promtool not found on PATH", file=sys.stderr)
        return 2
    for name in RULE_FILES[args.alert]:
        if not (args.rules / name).exists():
            print(f"replay: error: {args.rules / name} does not exist", file=sys.stderr)
            return 2
    false_alarms = 0
    for log in args.logs:
        if not log.is_file():  # read_records would read a missing log as an empty one
            print(f"replay: error: {log} does not exist", file=sys.stderr)
            return 2
        try:
            result = replay(log, args.rules, promtool, args.alert)
        except (OSError, ValueError, RuntimeError) as exc:
            print(f"replay: error: {log}: {exc}", file=sys.stderr)
            return 2
        print(f"{log}: faults at " + ", ".join(f"{n} +{t - result.start:.0f} s" for n, t in result.faults))
        lines = result.lines(args.attribution)
        print("\n".join(lines) if lines else "  never firing")
        false_alarms += sum("FALSE ALARM" in line for line in lines)
    print(f"false alarms: {false_alarms}")
    return 1 if false_alarms else 0


if __name__ == "__main__":
    sys.exit(main())
