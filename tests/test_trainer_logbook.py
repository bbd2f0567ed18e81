"""rankscope_trainer.logbook: per-step records resolved in one go, events, and a readable progress line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from rankscope_trainer.logbook import ProgressLog


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_steps_are_written_at_the_flush_with_their_own_values(tmp_path: Path, caplog) -> None:
    log = ProgressLog(str(tmp_path / "run" / "log.jsonl"), enabled=True, max_steps=100, samples_per_step=64)
    for step, loss in [(1, 2.5), (2, 2.0), (3, float("nan"))]:
        log.record_step(step, torch.tensor(loss), torch.tensor([0.25, 0.5]), lr=1e-3 * step)
    assert not (tmp_path / "run" / "log.jsonl").exists()  # nothing resolved before the flush
    with caplog.at_level(logging.INFO, logger="rankscope_trainer"):
        log.flush()
    records = _records(tmp_path / "run" / "log.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["loss"] == 2.5 and records[1]["acc_t2i"] == 0.5 and records[2]["lr"] == 0.003
    assert records[2]["loss"] is None  # NaN is not JSON
    line = caplog.records[-1].getMessage()
    assert line.startswith("step 3/100 | loss 2.2500 | acc i2t 0.250 t2i 0.500")
    assert "ms/step" in line and "samples/s" in line and "ETA" in line


def test_events_are_written_at_once(tmp_path: Path) -> None:
    log = ProgressLog(str(tmp_path / "log.jsonl"), enabled=True, max_steps=10, samples_per_step=1)
    log.event("checkpoint", step=4, reason="interval")
    assert _records(tmp_path / "log.jsonl")[0] | {"time": 0} == {
        "type": "checkpoint", "step": 4, "reason": "interval", "time": 0,
    }  # fmt: skip


def test_ranks_other_than_zero_keep_no_log(tmp_path: Path) -> None:
    log = ProgressLog(str(tmp_path / "log.jsonl"), enabled=False, max_steps=10, samples_per_step=1)
    log.record_step(1, torch.tensor(1.0), torch.tensor([0.0, 0.0]), lr=0.1)
    log.flush()
    log.event("start", step=0)
    assert not (tmp_path / "log.jsonl").exists()
