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
