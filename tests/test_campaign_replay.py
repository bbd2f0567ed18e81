"""The divergence replay (benchmarks.campaign.replay): a logged loss replayed through the shipped rules by promtool
names a leap within seconds and neither a spike nor a loss that stays where it was."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.campaign.replay import REPO, main, replay, scrapes

RULES = REPO / "prometheus" / "rules"


def _log(path: Path, loss_at, seconds: int, fault_at: float | None = None) -> Path:
    """Ten steps a second for `seconds`, each logging `loss_at(t)` (t from 0), and a fault record at `fault_at`."""
    records = []
    for i in range(seconds * 10):
        t = i / 10
        records.append({"type": "train", "step": i + 1, "loss": loss_at(t), "time": 1000.0 + t})
        if fault_at is not None and t == fault_at:
            records.append({"type": "fault", "kind": "diverge", "name": "diverge-here", "time": 1000.0 + t})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _noisy(level: float):
    return lambda t: level * (1 + 0.1 * math.sin(7 * t))


def test_a_leap_fires_within_half_a_minute_and_is_named_for_its_fault(tmp_path: Path) -> None:
    before = _noisy(2.0)
    log = _log(tmp_path / "log.jsonl", lambda t: before(t) if t < 600 else 10.0, 720, fault_at=600.0)
    result = replay(log, RULES)
    assert len(result.firing) == 1, result.firing
    first, _ = result.firing[0]
    # 20 s for the recent quartile to be over its line, 15 s of `for`; the median alone would need over a minute.
    assert 600 < result.start + first - 1000.0 <= 640, result.lines(300)
    assert "diverge-here" in result.lines(300)[0]


def test_a_spike_of_ten_seconds_and_a_steady_noisy_loss_never_fire(tmp_path: Path, capsys) -> None:
    steady = _noisy(2.0)
    log = _log(tmp_path / "log.jsonl", lambda t: 20.0 if 400 <= t < 410 else steady(t), 700)
    assert replay(log, RULES).firing == []
    assert main([str(log), "--rules", str(RULES)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "false alarms: 0"


def test_a_firing_stretch_far_from_any_fault_is_a_false_alarm_and_the_exit_status_says_so(tmp_path: Path) -> None:
    before = _noisy(2.0)
    log = _log(tmp_path / "log.jsonl", lambda t: before(t) if t < 600 else 10.0, 720)  # the same leap, no fault
    assert main([str(log), "--rules", str(RULES)]) == 1


def test_a_restart_is_a_gap_in_the_scrapes_not_the_last_loss_held(tmp_path: Path) -> None:
    records = [{"type": "train", "step": 1, "loss": 1.0, "time": 100.2}, {"type": "train", "step": 2, "loss": 3.0,
               "time": 120.5}]  # fmt: skip
    start, values = scrapes(records)
    assert start == 101.0
    assert values[:5] == [1.0] * 5 and values[5:20] == [None] * 15 and len(values) == 20


def test_a_log_without_steps_and_a_missing_rules_directory_fail_in_one_line(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "log.jsonl"
    empty.write_text(json.dumps({"type": "start", "time": 1.0}) + "\n")
    assert main([str(empty), "--rules", str(RULES)]) == 2
    assert capsys.readouterr().err.strip() == f"replay: error: {empty}: no training steps in the log"
    assert main([str(empty), "--rules", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"replay: error: {tmp_path / 'training.yml'} does not exist"
