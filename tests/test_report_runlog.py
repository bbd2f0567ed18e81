"""rankscope.report.runlog: the trainer's JSONL run log, read for the report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rankscope.report.errors import ReportError
from rankscope.report.runlog import read_run_log


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_steps_of_one_flush_are_spread_evenly_since_the_previous_flush(tmp_path) -> None:
    records = [{"type": "start", "step": 0, "time": 100.0}]
    records += [{"type": "train", "step": s, "loss": 1.0 / s, "acc_i2t": 0.1, "acc_t2i": 0.2, "lr": 1e-3,
                 "time": 110.0 if s <= 10 else 130.0} for s in range(1, 21)]  # fmt: skip
    records.append({"type": "val", "step": 20, "loss": 0.5, "acc_i2t": 0.3, "acc_t2i": 0.4, "time": 131.0})
    log = read_run_log(_write(tmp_path, [json.dumps(r) for r in records]))
    train = log.train()
    assert list(train["step"]) == list(range(1, 21))
    assert np.allclose(train["time"][:10], 100.0 + np.arange(1, 11))  # 10 steps over 100..110 s
    assert np.allclose(train["time"][10:], 110.0 + 2 * np.arange(1, 11))  # 10 steps over 110..130 s
    assert log.val()["loss"].tolist() == [0.5] and log.span == (100.0, 131.0)


def test_non_finite_numbers_written_as_null_read_as_nan(tmp_path) -> None:
    log = read_run_log(_write(tmp_path, ['{"type": "train", "step": 1, "loss": null, "lr": 1e-3, "time": 1.0}']))
    assert np.isnan(log.train()["loss"][0]) and np.isnan(log.train()["acc_i2t"][0])


def test_a_half_written_last_line_of_a_live_run_is_left_out(tmp_path) -> None:
    log = read_run_log(_write(tmp_path, ['{"type": "start", "step": 0, "time": 1.0}', '{"type": "train", "st']))
    assert [r["type"] for r in log.records] == ["start"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            ["not json", '{"type": "start", "time": 1}'],
            r"log.jsonl:1: not a JSON object \(is this a rankscope run log\?\)",
        ),
        (['{"step": 1}', '{"type": "start"}'], r'log.jsonl:1: a record must be a JSON object with a "type"'),
        (["[1, 2]", '{"type": "start"}'], r'log.jsonl:1: a record must be a JSON object with a "type"'),
    ],
)
def test_a_line_that_is_not_a_record_is_named_by_its_number(tmp_path, lines: list[str], message: str) -> None:
    with pytest.raises(ReportError, match=message):
        read_run_log(_write(tmp_path, lines))


def test_a_missing_or_binary_log_is_one_line(tmp_path) -> None:
    with pytest.raises(ReportError, match=r"cannot read run log .*nope.jsonl: No such file or directory"):
        read_run_log(tmp_path / "nope.jsonl")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ReportError, match="is not text"):
        read_run_log(binary)


def _flush(steps: range, time: float) -> list[dict]:
    return [{"type": "train", "step": s, "loss": 2.0 - s / 100, "lr": 1e-3, "time": time} for s in steps]


def _hung_and_restarted(tmp_path):
    """10 steps a flush, one flush every 10 s; a 30 s hang after step 30; the restarted group resumes from
    step 20 (its start record at 170 s) and flushes at 180 s; then a 40 s stretch without a step (180..220 s)."""
    records = [{"type": "start", "step": 0, "time": 100.0}]
    records += _flush(range(1, 11), 110.0) + _flush(range(11, 21), 120.0) + _flush(range(21, 31), 130.0)
    records += [{"type": "resume", "step": 20, "time": 168.0}, {"type": "start", "step": 20, "time": 170.0}]
    records += _flush(range(21, 31), 180.0) + _flush(range(31, 41), 230.0)
    return read_run_log(_write(tmp_path, [json.dumps(r) for r in records]))


def test_no_step_is_spread_into_a_hang_a_restart_or_any_stretch_without_steps(tmp_path) -> None:
    train = _hung_and_restarted(tmp_path).train()
    times = train["time"]
    assert np.allclose(times[:30], 100.0 + np.arange(1, 31))  # the normal flushes: spread evenly, as before
    assert not ((times > 130.0) & (times < 170.0)).any(), "steps drawn inside the hang and the restart"
    assert (times[30:40] > 170.0).all() and times[39] == 180.0  # the new incarnation's steps after its start
    assert not ((times > 180.0) & (times < 220.0)).any(), "steps drawn inside 40 s without a step"
    assert np.allclose(times[40:], 221.0 + np.arange(10))  # at the run's own pace (1 s a step), up to the flush
    # Each stretch that trained is a segment of its own: the plot breaks the line between them.
    assert list(np.unique(train["segment"], return_index=True)[1]) == [0, 30, 40]


def test_the_per_step_loss_line_breaks_where_no_step_trained(tmp_path) -> None:
    from rankscope.report.sections import _log_series

    loss = _log_series(_hung_and_restarted(tmp_path))["loss"]
    breaks = np.flatnonzero(np.isnan(loss.v))
    assert len(breaks) == 2, "the line must break at the restart and at the 40 s without a step"
    for index in breaks:  # no drawn segment spans a stretch without steps
        assert loss.t[index - 1] <= 130.0 < 170.0 <= loss.t[index + 1] or (
            loss.t[index - 1] <= 180.0 < 220.0 <= loss.t[index + 1]
        )
    finite = np.isfinite(loss.v)
    assert np.diff(loss.t[finite][:30]).max() <= 1.0 + 1e-9
