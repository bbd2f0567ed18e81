"""The divergence replay (benchmarks.campaign.replay): a logged loss replayed through the shipped rules by promtool
names a leap within seconds and neither a spike nor a loss that stays where it was."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.campaign.replay import REPO, main, replay, rollbacks_served, scrapes, step_counts

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


def test_a_restart_is_a_gap_in_the_scrapes_and_a_hang_holds_the_last_steps_values(tmp_path: Path) -> None:
    records = [
        {"type": "start", "time": 100.0},
        {"type": "train", "step": 1, "loss": 1.0, "time": 100.2},
        {"type": "train", "step": 2, "loss": 2.0, "time": 110.5},  # then hung
        {"type": "start", "time": 120.0},  # the restarted process (its target was down since the last step)
        {"type": "train", "step": 2, "loss": 3.0, "time": 125.0},
    ]
    start, losses, steps = scrapes(records)
    assert start == 101.0 and len(losses) == len(steps) == 25
    assert losses[:9] == [1.0] * 9 and [round(x, 6) for x in steps[:9]] == [-0.8] * 9  # 101..109 s: step 1's values
    assert losses[10:19] == [2.0] * 9 and steps[10] == 9.5  # 111..119 s: the hung step's values, held
    assert losses[19:24] == [None] * 5 and steps[19:24] == [None] * 5  # 120..124 s: restarting
    assert losses[24] == 3.0
    counts = step_counts(records, start, len(losses))  # each process counts its own steps, held through a hang
    assert counts[0] == 1.0 and counts[9] == 1.0 and counts[10] == 2.0 and counts[18] == 2.0
    assert counts[19] == 0.0 and counts[24] == 1.0


def test_the_alert_ends_with_an_applied_rollback_and_the_replay_serves_its_time(tmp_path: Path) -> None:
    before = _noisy(2.0)
    log = _log(tmp_path / "log.jsonl", lambda t: before(t) if t < 600 or t >= 690 else 10.0, 800, fault_at=600.0)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records.insert(0, {"type": "start", "time": 1000.0})
    records.append({"type": "action", "action": "rollback", "result": "applied", "time": 1690.0})
    records.append({"type": "action", "action": "rollback", "result": "refused_cooldown", "time": 1700.0})
    log.write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["time"])))
    records.append({"type": "start", "time": 1750.0})  # a restarted process serves none until its own rollback
    records.append({"type": "action", "action": "rollback", "result": "applied", "time": 1780.0})
    served = rollbacks_served(records, 1001.0, 800)  # (count, time of the last) on promtool's clock
    assert served[688] is None and served[689] == (1.0, 689.0) and served[748] == (1.0, 689.0)  # a refusal: none
    assert served[749] is None and served[778] is None  # the restarted process has served none yet
    assert served[779] == (1.0, 779.0) and served[-1] == (1.0, 779.0)  # its counter is born at 1 again
    result = replay(log, RULES)
    # Firing from the leap until the rollback: its 2m median holds the 90 s of 10 until 2 minutes after they began.
    assert len(result.firing) == 1, result.lines(300)
    first, last = result.firing[0]
    assert result.start + last - 1000.0 == 689.0, result.lines(300)


def test_a_hung_run_whose_last_loss_was_high_fires_nothing(tmp_path: Path) -> None:
    before = _noisy(2.0)
    records = [{"type": "start", "time": 1000.0}]
    records += [{"type": "train", "step": i + 1, "loss": before(i / 10), "time": 1000.0 + i / 10} for i in range(6000)]
    records.append({"type": "train", "step": 6001, "loss": 20.0, "time": 1600.0})  # its last batch, then hung
    records.append({"type": "start", "time": 1900.0})
    records += [
        {"type": "train", "step": 6001 + i, "loss": before(i / 10), "time": 1905.0 + i / 10} for i in range(1200)
    ]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert replay(log, RULES).firing == []


def test_a_log_without_steps_and_a_missing_rules_directory_fail_in_one_line(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "log.jsonl"
    empty.write_text(json.dumps({"type": "start", "time": 1.0}) + "\n")
    assert main([str(empty), "--rules", str(RULES)]) == 2
    assert capsys.readouterr().err.strip() == f"replay: error: {empty}: no training steps in the log"
    assert main([str(empty), "--rules", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"replay: error: {tmp_path / 'hangs.yml'} does not exist"
    missing = tmp_path / "nowhere.jsonl"
    assert main([str(missing), "--rules", str(RULES)]) == 2
    assert capsys.readouterr().err.strip() == f"replay: error: {missing} does not exist"
