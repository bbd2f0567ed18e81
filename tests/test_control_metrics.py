"""record_checkpoint: the checkpoint metrics of the contract, with a bounded reason label."""

from __future__ import annotations

import pytest
from rankscope import Monitor, MonitorConfig, NullMonitor, RankIdentity
from rankscope.control import record_checkpoint
from rankscope.control.metrics import checkpoint_reason_label


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("alert:HighLoss", "alert"),
        ("operator:before upgrade", "operator"),
        ("interval", "interval"),
        ("stop:operator:done", "stop"),
        ("final", "final"),
        ("whatever the user typed", "other"),
    ],
)
def test_the_reason_label_is_the_kind_before_the_colon(reason, label):
    assert checkpoint_reason_label(reason) == label


def test_a_checkpoint_is_counted_timed_and_stamped():
    identity = RankIdentity.from_env({}, run_id="unit")
    monitor = Monitor(MonitorConfig(probes=()), identity, device="cpu")
    record_checkpoint(monitor, "alert:HighLoss", 0.3, finished_at=1234.0)
    labels = identity.labels()
    get = monitor.registry.get_sample_value
    assert get("rankscope_checkpoints_total", {**labels, "reason": "alert"}) == 1
    assert get("rankscope_checkpoint_duration_seconds_count", labels) == 1
    assert get("rankscope_checkpoint_duration_seconds_sum", labels) == pytest.approx(0.3)
    assert get("rankscope_last_checkpoint_timestamp_seconds", labels) == 1234.0


def test_without_a_monitor_nothing_is_recorded_and_nothing_fails():
    record_checkpoint(NullMonitor(), "final", 1.0)
    record_checkpoint(None, "final", 1.0)


@pytest.mark.integration
def test_the_pages_count_a_stop_as_the_loop_contract_says(control_job):
    # Issue 33: docs/loop-contract.md said every rank counts a stop in rankscope_control_actions_total; only rank 0
    # does (it counts every action once, so that a sum over ranks, as the dashboards and the report take, is the
    # number of actions). Every rank counts the checkpoint it wrote for the stop. The docs now say what the
    # pages of a real 2-rank torchrun job show.
    import re
    import time

    from tests.support import REPO, sample_value, samples

    job = control_job()
    job.wait_ready()
    posted = time.time()
    job.post_action("stop")
    assert job.wait_exit() == 0  # the job leaves at once (channel.close()): its pages are in rank<r>.metrics.txt
    exited = time.time()
    pages = {rank: samples((job.out / f"rank{rank}.metrics.txt").read_text()) for rank in (0, 1)}
    stop = {"action": "stop", "source": "operator", "result": "applied"}
    assert sample_value(pages[0], "rankscope_control_actions_total", **stop) == 1
    # The rules' guards read when rank 0 applied it (a restarted process's counter is born at the old value).
    applied_at = sample_value(pages[0], "rankscope_control_last_applied_timestamp_seconds", action="stop")
    assert applied_at is not None and posted <= applied_at <= exited
    for name in ("rankscope_control_actions_total", "rankscope_control_last_applied_timestamp_seconds"):
        assert not [found for found, _ in pages[1] if found == name]
    assert all(sample_value(page, "rankscope_checkpoints_total", reason="stop") == 1 for page in pages.values())

    contract = (REPO / "docs" / "loop-contract.md").read_text()
    end_of_run = contract[contract.index("## The end of the run") :]
    end_of_run = " ".join(end_of_run[: end_of_run.index("\n## ", 1) if "\n## " in end_of_run else None].split())
    assert re.search(r"rank 0's page counts it in `rankscope_control_actions_total", end_of_run), end_of_run
    assert re.search(r"every rank's page counts the checkpoint .*`rankscope_checkpoints_total\{reason=\"stop\"\}`",
                     end_of_run), end_of_run  # fmt: skip
