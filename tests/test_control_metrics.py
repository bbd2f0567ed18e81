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
