"""rankscope_trainer.logbook: per-step records resolved in one go, events, and a readable progress line."""

from __future__ import annotations

import json
import logging
import time
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


class _Loop:
    def checkpoint(self, reason: str) -> bool:
        return True

    def request_stop(self, reason: str) -> None:
        pass


def test_a_pause_is_logged_at_its_own_time_with_the_step_and_reason_status_gives(tmp_path: Path, monkeypatch) -> None:
    """A pause holds the boundary until resume: the log must not stamp it with the resume's time."""
    import threading

    import requests
    from rankscope import Monitor, MonitorConfig, RankIdentity
    from rankscope.control import ControlChannel, ControlConfig

    from tests.support import wait_for

    monkeypatch.setenv("RANKSCOPE_CONTROL_TOKEN", "logbook-token")
    monitor = Monitor(MonitorConfig(probes=()), RankIdentity.from_env({}, run_id="unit"), device="cpu")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    channel = ControlChannel(ControlConfig(port=0, pause_heartbeat_seconds=0.05, lr_cooldown_seconds=3600.0),
                             monitor, optimizer=optimizer)  # fmt: skip
    log = ProgressLog(str(tmp_path / "log.jsonl"), enabled=True, max_steps=100, samples_per_step=1)

    def post(action: str, reason: str) -> None:
        response = requests.post(channel.url + "/v1/actions", json={"action": action, "reason": reason},
                                 headers={"Authorization": "Bearer logbook-token"}, timeout=5)  # fmt: skip
        assert response.status_code == 202, response.text

    def boundary(step: int) -> None:  # what the reference loop does at every boundary
        channel.at_step_boundary(step, _Loop())
        log.actions(channel.queue.snapshot()["recent"])

    try:
        post("reduce_lr", "first cut")
        boundary(3)
        post("reduce_lr", "too soon")  # refused by the cooldown: logged with its outcome, not only applied ones
        boundary(4)
        post("pause", "look at the loss")
        loop = threading.Thread(target=boundary, args=(5,))
        loop.start()
        wait_for(lambda: channel.snapshot.read()["paused"], timeout=30, what="the channel to pause")
        time.sleep(0.5)  # held paused for a while: the gap the old log lost
        post("resume", "go on")
        loop.join(timeout=30)
        assert not loop.is_alive()
    finally:
        channel.close()
        monitor.close()
    actions = [r for r in _records(tmp_path / "log.jsonl") if r["type"] == "action"]
    status = {r["id"]: r for r in channel.queue.snapshot()["recent"]}
    # (the first reduce_lr settles once a step shows its effect: no step runs here)
    settled = [r for r in actions if r["reason"] != "operator:first cut"]
    assert [(r["action"], r["result"], r["step"], r["reason"]) for r in settled] == [
        ("reduce_lr", "refused_cooldown", 4, "operator:too soon"),
        ("pause", "applied", 5, "operator:look at the loss"), ("resume", "applied", 5, "operator:go on"),
    ]  # fmt: skip
    for record in actions:  # the step and time /v1/status reports
        assert record["step"] == status[record["id"]]["step"]
        assert record["time"] == round(status[record["id"]]["settled_at"], 3)
    pause, resume = actions[-2:]
    assert resume["time"] - pause["time"] >= 0.5
