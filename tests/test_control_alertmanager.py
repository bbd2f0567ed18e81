"""A real Alertmanager delivers an `action=reduce_lr` alert to a real 2-rank job's control endpoint.

The repo's alertmanager/alertmanager.yml is used as it is, except for the
trainer's address, the token file's path and short intervals on the trainer
route, so Alertmanager repeats its notification every couple of seconds. The
learning rate must halve once, on both ranks, however often it is repeated.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.support import REPO, binary, fetch, running_alertmanager, sample_value, samples, tail, wait_for

pytestmark = pytest.mark.integration

ALERT_NAME = "RankscopeLossPlateau"


def _alertmanager_config(job, path) -> None:
    config = yaml.safe_load((REPO / "alertmanager" / "alertmanager.yml").read_text())
    receiver = next(r for r in config["receivers"] if r["name"] == "trainer-control")
    webhook = receiver["webhook_configs"][0]
    webhook["url"] = f"{job.url}/v1/alerts"
    webhook["http_config"]["authorization"]["credentials_file"] = str(job.out / "token")
    route = next(r for r in config["route"]["routes"] if r["receiver"] == "trainer-control")
    route.update({"group_wait": "0s", "group_interval": "1s", "repeat_interval": "2s"})
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture
def job(control_job):
    # No cooldown and no cap: only idempotency may keep a repeated alert from acting again.
    running = control_job({"lr_cooldown_seconds": 0.0, "lr_cooldown_steps": 0, "lr_max_reductions": 0})
    running.wait_ready()
    return running


@pytest.fixture
def alertmanager(job, tmp_path, free_port):
    _alertmanager_config(job, tmp_path / "alertmanager.yml")
    with running_alertmanager(tmp_path / "alertmanager.yml", tmp_path, free_port()) as url:
        yield url, tmp_path / "alertmanager.log"


def webhook_notifications(url: str) -> tuple[float, float]:
    """(sent, failed) webhook notifications, from Alertmanager's own metrics."""
    page = samples(fetch(f"{url}/metrics"))
    sent = sample_value(page, "alertmanager_notifications_total", integration="webhook") or 0
    failed = sample_value(page, "alertmanager_notifications_failed_total", integration="webhook") or 0
    return sent, failed


def test_an_alert_repeated_by_alertmanager_halves_the_learning_rate_once_on_both_ranks(job, alertmanager):
    url, log = alertmanager
    subprocess.run(
        [
            binary("amtool"),
            "alert",
            "add",
            f"alertname={ALERT_NAME}",
            "action=reduce_lr",
            "run_id=control-test",
            "severity=info",
            "--annotation=summary=loss stopped improving",
            f"--alertmanager.url={url}",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    # The first delivery and at least two repeats of the same alert (same fingerprint and startsAt).
    wait_for(lambda: webhook_notifications(url)[0] >= 3, 60, "three webhook notifications", lambda: tail(log))
    assert webhook_notifications(url)[1] == 0, tail(log)

    applied = [r for r in job.status()["recent"] if r["action"] == "reduce_lr"]
    assert [(r["status"], r["source"], r["reason"]) for r in applied] == [("applied", "alert", f"alert:{ALERT_NAME}")]
    step = applied[0]["step"]
    for rank in (0, 1):
        assert job.step_record(rank, step)["lr"] == pytest.approx([0.05])
        reductions = [r["step"] for r in job.steps(rank) if "reduce_lr" in r.get("applied", [])]
        assert reductions == [step], f"rank {rank} reduced at steps {reductions}"
        assert job.steps(rank)[-1]["lr"] == pytest.approx([0.05])
    page = samples(fetch(f"http://127.0.0.1:{job.ready(0)['metrics_port']}/metrics"))
    count = sample_value
    assert count(page, "rankscope_control_actions_total", action="reduce_lr", source="alert", result="applied") == 1
    assert count(page, "rankscope_control_actions_total", action="reduce_lr", source="alert", result="duplicate") >= 2

    job.post_action("stop", reason="test over")
    assert job.wait_exit() == 0
