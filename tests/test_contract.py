import re

import pytest

from exporter.contract import IDENTITY_LABELS, METRICS, MetricKind, metric

NAME = re.compile(r"^rankscope_[a-z0-9_]+$")
UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_watts", "_celsius", "_tokens", "_pixels", "_nats")


@pytest.mark.parametrize("spec", METRICS.values(), ids=lambda s: s.name)
def test_every_metric_follows_prometheus_naming(spec):
    assert NAME.match(spec.name)
    assert spec.help.strip()
    if spec.kind is MetricKind.COUNTER:
        assert spec.name.endswith("_total")
    else:
        assert not spec.name.endswith("_total")
    if spec.unit:
        assert spec.name.endswith("_" + spec.unit) or spec.name.endswith(UNIT_SUFFIXES)
    assert "percent" not in spec.name


@pytest.mark.parametrize("spec", METRICS.values(), ids=lambda s: s.name)
def test_labels_are_bounded_and_never_repeat_identity(spec):
    assert not set(spec.labels) & set(IDENTITY_LABELS)
    assert not {"step", "path", "message", "reason_text"} & set(spec.labels)


def test_histograms_have_increasing_buckets_and_others_have_none():
    for spec in METRICS.values():
        if spec.kind is MetricKind.HISTOGRAM:
            assert list(spec.buckets) == sorted(spec.buckets) and len(spec.buckets) >= 5
        else:
            assert spec.buckets == ()


def test_step_time_buckets_span_milliseconds_to_minutes():
    buckets = metric("step_duration_seconds").buckets
    assert buckets[0] <= 0.001 and buckets[-1] >= 120


def test_issue_required_metrics_are_declared():
    required = """step_duration_seconds data_wait_seconds comm_duration_seconds steps_total samples_total
    tokens_total loss grad_norm module_grad_norm update_ratio learning_rate device_memory_bytes
    host_memory_used_ratio nonfinite_steps_total loss_spikes_total global_step last_step_timestamp_seconds
    run_info monitor_errors_total""".split()
    for short in required:
        assert metric(short).name == "rankscope_" + short


def test_lookup_of_an_unknown_metric_names_it():
    with pytest.raises(KeyError, match="rankscope_nope"):
        metric("rankscope_nope")


def test_client_names_drop_the_suffix_prometheus_client_adds():
    assert metric("steps_total").client_name == "rankscope_steps"
    assert metric("run_info").client_name == "rankscope_run"
    assert metric("loss").client_name == "rankscope_loss"
