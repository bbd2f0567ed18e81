import inspect
import re

import pytest
from rankscope import Monitor, MonitorConfig, NullMonitor
from rankscope.contract import IDENTITY_LABELS, METRICS, MetricKind, metric

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
            # Few buckets: each is a series per rank (at most 100 series per rank, benchmarks/README.md).
            assert list(spec.buckets) == sorted(spec.buckets) and 2 <= len(spec.buckets) <= 8
        else:
            assert spec.buckets == ()


def test_step_time_buckets_span_milliseconds_to_minutes():
    buckets = metric("step_duration_seconds").buckets
    assert buckets[0] <= 0.03 and buckets[-1] >= 60


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


# --- an open contract: a loop's own metrics ------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (("team_examples", MetricKind.COUNTER, "Examples."), "counters, and only counters, end in _total"),
        (("team_depth_total", MetricKind.GAUGE, "Depth."), "counters, and only counters, end in _total"),
        (("team_load_percent", MetricKind.GAUGE, "Load."), "use a _ratio in 0..1, not a percentage"),
        (("team_wait", MetricKind.GAUGE, "Wait.", {"unit": "seconds"}), "the name must end in its unit, _seconds"),
        (("team_wait_ms", MetricKind.GAUGE, "Wait.", {"unit": "ms"}), "unit 'ms' is not a base unit"),
        (("team_loss", MetricKind.GAUGE, "Loss.", {"labels": ("step",)}), "label 'step' would be unbounded"),
        (("team_loss", MetricKind.GAUGE, "Loss.", {"labels": ("rank",)}), "label 'rank' is reserved"),
        (("team_len", MetricKind.HISTOGRAM, "Length.", {"buckets": (4, 2)}), "strictly increasing buckets"),
        (("2fast", MetricKind.GAUGE, "Bad."), "does not start with a digit"),
        (("team_loss", MetricKind.GAUGE, " "), "help text is required"),
    ],
)
def test_a_metric_that_breaks_the_conventions_is_refused_in_one_line(spec, problem):
    from rankscope import MetricSpec

    name, kind, text, *extra = spec
    with pytest.raises(ValueError, match=re.escape(problem)) as caught:
        MetricSpec(name, kind, text, **(extra[0] if extra else {}))
    assert str(caught.value).startswith(f"metric {name!r}: ") and "\n" not in str(caught.value)


def test_a_loops_own_metrics_are_recorded_and_served_like_the_contracts(tmp_path):
    import urllib.request

    from rankscope import MetricSpec, Monitor, MonitorConfig, RankIdentity

    from tests.support import promtool_problems, sample_value, samples

    mine = [
        MetricSpec("team_examples_seen_total", MetricKind.COUNTER, "Examples the loop read.", labels=("split",)),
        MetricSpec(
            "team_batch_length_tokens",
            MetricKind.HISTOGRAM,
            "Tokens per batch.",
            unit="tokens",
            buckets=(64, 256, 1024),
        ),  # fmt: skip
        MetricSpec("team_kl_ratio", MetricKind.GAUGE, "KL to the reference policy.", unit="ratio"),
    ]
    config = MonitorConfig(host="127.0.0.1", base_port=0, probes=(), page_cache_seconds=0)
    monitor = Monitor(config, RankIdentity("own", 0, 0, 1, "n"), device="cpu", extra_metrics=mine)
    monitor.start()
    try:
        monitor.inc("team_examples_seen_total", 32, split="train")
        monitor.observe("team_batch_length_tokens", 300)
        monitor.set("team_kl_ratio", 0.02)
        monitor.set("loss", 1.5, split="train")  # the contract's still by its short name
        page = urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=10).read().decode()
    finally:
        monitor.close()
    assert promtool_problems(page) == ""
    found = samples(page)
    assert sample_value(found, "team_examples_seen_total", split="train", rank="0", run_id="own") == 32
    assert sample_value(found, "team_batch_length_tokens_bucket", le="1024.0") == 1
    assert sample_value(found, "team_kl_ratio") == 0.02
    assert sample_value(found, "rankscope_loss", split="train") == 1.5
    with pytest.raises(ValueError, match="declared twice"):
        Monitor(config, RankIdentity("own", 0, 0, 1, "n"), device="cpu", extra_metrics=[metric("loss")])


def test_the_batch_cost_metrics_help_says_how_they_are_recorded():
    # The help text is each metric's documentation on every page: it must name the call and setting that exist.
    sequence, peak = metric("sequence_length_max_tokens"), metric("step_peak_device_memory_bytes")
    assert "Monitor.step(max_seq_len=...)" in sequence.help
    for cls in (Monitor, NullMonitor):
        assert "max_seq_len" in inspect.signature(cls.step).parameters, cls
    assert "metrics.step_peak_memory" in peak.help and "absent on CPU" in peak.help
    assert MonitorConfig().step_peak_memory is False
    assert (sequence.kind, sequence.unit) == (MetricKind.GAUGE, "tokens")
    assert (peak.kind, peak.unit) == (MetricKind.GAUGE, "bytes")


def test_a_summary_has_sum_and_count_series_and_no_buckets_for_rules_and_panels_alike():
    from rankscope.mixin.dashboards.panels import m
    from rankscope.mixin.promql import metric_name

    for name_of in (metric_name, m):
        assert name_of("checkpoint_duration_seconds", "sum") == "rankscope_checkpoint_duration_seconds_sum"
        with pytest.raises(ValueError, match="is a summary, it has no _bucket series"):
            name_of("checkpoint_duration_seconds", "bucket")
        with pytest.raises(ValueError, match="is a gauge, it has no _sum series"):
            name_of("paused", "sum")
