"""The sharded layout (rankscope.mixin.layout): the same rules as one server, split by what each rule reads.

Every alert lands on the global server with the meaning, labels and texts it has on one server; every
recording rule lands on exactly one server; whatever a global rule reads is recorded there or federated
from the shards; a shard's rules read only what a shard holds. The committed prometheus/sharded/ is the
command's output byte for byte.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml
from rankscope.mixin import cli, rules
from rankscope.mixin.config import Tunables
from rankscope.mixin.layout import Selector, fresh, is_shard_local, selectors, split, view_name

from tests.support import REPO, binary

TUNINGS = [Tunables(), Tunables(rate_window="5s", imbalance_for="5s", nonfinite_for="0s", hang_action="")]


def _freshened(t: Tunables) -> dict[str, str]:
    """The global server reads a transient shard record's fresh samples only (rankscope.mixin.layout.fresh): within
    two of its group's evaluations and one federation scrape (5 s). The performance group runs every 30 s where
    its alerts' `for`s allow it (the shipped ones do), every other group every 5 s."""
    performance = 30 if t.imbalance_for == "10m" else 5
    return {
        name: fresh(name, 2 * (performance if area.name == "performance" else 5) + 5)
        for area in rules.areas(t)
        for name in area.transient + area.shard_evaluated
    }


def _rules(groups: dict) -> list[dict]:
    return [rule for group in groups.values() for rule in group["rules"]]


def _words(expr: str) -> str:
    return " ".join(expr.replace("(", " ( ").replace(")", " ) ").split())


@pytest.mark.parametrize("t", TUNINGS)
def test_every_alert_lands_on_the_global_server_as_on_one_server(t: Tunables) -> None:
    layout = split(t)
    on_global = {rule["alert"]: rule for rule in _rules(layout.global_groups) if "alert" in rule}
    assert not [rule for rule in _rules(layout.shard_groups) if "alert" in rule]
    single = {rule["alert"]: rule for area in rules.areas(t) for rule in area.rules(t) if "alert" in rule}
    inline = rules.shard_expressions(t)
    freshened = _freshened(t)
    for alert in rules.alerts(t):
        written = alert.to_rule(t)
        assert on_global[alert.name] == {**written, "expr": rules.inlined(written["expr"], freshened)}
        # One server computes the shard records where the global server reads them: the same expression.
        assert {**on_global[alert.name], "expr": ""} == {**single[alert.name], "expr": ""}
        one_server = dataclasses.replace(alert, expr=rules.inlined(alert.expr, inline)).to_rule(t)
        assert _words(one_server["expr"]) == _words(single[alert.name]["expr"])
    assert sorted(on_global) == sorted(alert.name for alert in rules.alerts(t))


@pytest.mark.parametrize("t", TUNINGS)
def test_every_recording_rule_lands_on_exactly_one_server_unchanged_in_the_same_group(t: Tunables) -> None:
    layout = split(t)
    placed = [
        (group["name"], rule["record"], rule["expr"])
        for groups in (layout.shard_groups, layout.global_groups)
        for group in groups.values()
        for rule in group["rules"]
        if "record" in rule
    ]
    # As written, but for two things: a shard reads its own view of a run-level record under the view's name, and
    # the global server reads a transient shard record's fresh samples only.
    views = {name: view_name(name) for area in rules.areas(t) for name in area.shard_views}
    freshened = _freshened(t)
    on_shard = {record for groups in (layout.shard_groups,) for group in groups.values() for record in
                (rule["record"] for rule in group["rules"])}  # fmt: skip
    expected = []
    for area in rules.areas(t):
        for rule in area.module.records(t):
            if rule["record"] in views:
                expected.append((area.group, views[rule["record"]], _with_views(rule["expr"], views)))
        for rule in area.sharded_records(t):
            if rule["record"] in on_shard:
                expected.append((area.group, rule["record"], _with_views(rule["expr"], views)))
            else:
                expected.append((area.group, rule["record"], rules.inlined(rule["expr"], freshened)))
    assert sorted(placed) == sorted(expected)
    # One server records the same, less the shard records (read inline there), the shards' views and the records
    # only the global server's sharded forms read.
    single = {rule["record"] for area in rules.areas(t) for rule in area.records(t)}
    global_only = {rule["record"] for area in rules.areas(t) for rule in area.global_records(t)}
    assert single == (
        {record for _, record, _ in placed} - set(rules.shard_expressions(t)) - set(views.values()) - global_only
    )
    assert set(rules.shard_expressions(t)) <= layout.shard_records


def _with_views(expr: str, views: dict[str, str]) -> str:
    for name, view in views.items():
        expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", view, expr)
    return expr


def test_no_server_records_a_per_rank_ratio_that_only_alerts_read() -> None:
    # Recording a ratio for each of 4096 ranks writes 12 k samples per evaluation, more than the two alerts that
    # compare the same ratios with their lines cost (benchmarks.scale): one server computes them inside the alerts,
    # a shard inside the records of the ranks over a line.
    t = Tunables()
    single = {rule["record"] for area in rules.areas(t) for rule in area.records(t)}
    ratios = {
        "run_rank:rankscope_step_duration_seconds:mean",
        "run_rank:rankscope_data_wait_seconds:slow_share",
        "run_rank:rankscope_data_wait_seconds:step_share",
    }
    assert not single & ratios
    assert not split(t).shard_records & ratios
    assert {
        "run_rank:rankscope_data_wait_seconds:over_line",
        "run_rank:rankscope_step_duration_seconds:mean_over_line",
    } <= (split(t).shard_records)
    read = {s.name for area in rules.areas(t) for rule in area.rules(t) for s in selectors(rule["expr"])}
    assert not read & ratios
    assert {"rankscope_step_duration_seconds_count", "rankscope_data_wait_seconds_bucket"} <= read


def test_an_inlined_record_keeps_its_parentheses_and_a_read_with_matchers_or_a_range_is_refused() -> None:
    inline = {"a:b:c": "x\n/\ny"}
    assert rules.inlined("max by (r) (a:b:c) > 1", inline) == "max by (r) (\n  x\n  /\n  y\n) > 1"
    assert rules.inlined("a:b:c > 1 or a:b:cd", inline) == "(\n  x\n  /\n  y\n) > 1 or a:b:cd"
    for expr in ('a:b:c{rank="0"}', "rate(a:b:c[5m])"):
        with pytest.raises(ValueError, match="only a plain read can be inlined"):
            rules.inlined(expr, inline)


def test_promtool_unit_tests_of_the_shard_records_pass() -> None:
    tests = REPO / "prometheus" / "tests" / "sharded" / "shard_test.yml"
    result = subprocess.run([binary("promtool"), "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("t", TUNINGS)
def test_whatever_a_global_rule_reads_is_recorded_there_or_federated(t: Tunables) -> None:
    layout = split(t)
    recorded = {rule["record"] for rule in _rules(layout.global_groups) if "record" in rule}
    for rule in _rules(layout.global_groups):
        for read in selectors(rule["expr"]):
            if read.recorded and read.name in recorded:
                continue
            assert any(f.covers(read) for f in layout.federated), f"{rule} reads {read}, not federated"
    # Nothing the global server records is federated (it would collide with the shards' copies).
    assert not [f for f in layout.federated if f.name in recorded]


@pytest.mark.parametrize("t", TUNINGS)
def test_a_shard_evaluates_only_what_its_own_ranks_decide(t: Tunables) -> None:
    layout = split(t)
    assert layout.shard_records, "the per-rank reductions are the shards' work"
    views = {view_name(name) for area in rules.areas(t) for name in area.shard_views}
    for rule in _rules(layout.shard_groups):
        read = selectors(rule["expr"])
        # Its own view of a run (over its ranks), and a record gated on that view, are a shard's by design: the
        # gate only decides when a rank's series is recorded, never its value.
        declared = {name for area in rules.areas(t) for name in area.shard_evaluated}
        assert is_shard_local(rule["expr"]) or rule["record"] in views | declared or {s.name for s in read} & views
        assert all(not s.recorded or s.name in layout.shard_records for s in read), rule
    # No view of a run leaves its shard.
    assert not {s.name for s in layout.federated} & views
    # The run's median compute time and the hang suspects compare ranks of every shard: global.
    on_global = {rule.get("record") for rule in _rules(layout.global_groups)}
    assert {"run:rankscope_compute_duration_seconds:median", "run_rank:rankscope_phase:hang_suspect"} <= on_global


def test_federated_selectors_keep_the_rules_matchers_so_few_series_per_rank_cross() -> None:
    federated = {str(s) for s in split(Tunables()).federated}
    # Histograms cross as each node's rates of the buckets the rules read (one rank per node), never whole.
    assert "run_node:rankscope_step_duration_seconds_bucket:rate" in federated
    assert (
        not {"rankscope_step_duration_seconds_bucket", 'rankscope_step_duration_seconds_bucket{local_rank="0"}'}
        & federated
    )
    # What the rules sum, average or take the highest of over a run's ranks crosses as each node's part, and what
    # they compare with a line per rank as the rank's ratio (issue 32): never as every rank's series.
    names = {s.name for s in split(Tunables()).federated}
    summed = ("samples_total", "tokens_total", "model_flops_total", "peak_flops_per_second", "grad_norm",
              "nonfinite_steps_total", "host_memory_used_ratio", "last_checkpoint_timestamp_seconds")  # fmt: skip
    per_rank_ratios = ("data_wait_seconds_bucket", "data_wait_seconds_count", "data_wait_seconds_sum",
                       "device_memory_bytes", "run_info")  # fmt: skip
    assert not names & {f"rankscope_{name}" for name in summed + per_rank_ratios}
    # Nor does any rank's series that the rules read over a window: each node's rates cross instead.
    assert (
        not {"rankscope_step_duration_seconds_sum", 'rankscope_step_duration_seconds_sum{local_rank="0"}'} & federated
    )
    assert "run_node:rankscope_step_duration_seconds_sum:hang_rate" in federated
    assert {"run_node:rankscope_samples:rate", "run_node:rankscope_grad_norm:max"} <= federated
    # What the rules compare with a line per rank crosses only for the ranks over it, and the hang suspects' phases
    # and counts only while a run may be hung: a healthy run federates none of them.
    assert {
        "run_rank:rankscope_data_wait_seconds:over_line",
        "run_rank:rankscope_step_duration_seconds:mean_over_line",
        "run_rank:rankscope_phase:hang_candidate",
        "run_rank:up:down",
    } <= federated
    not_crossing = {"run_rank:rankscope_data_wait_seconds:slow_share", "run_rank:rankscope_step_duration_seconds:mean",
                    "run_rank:rankscope_run_info:last_seen_timestamp_seconds", "rankscope_collectives_total",
                    "rankscope_phase", "rankscope_previous_process_vanished_timestamp_seconds", "up"}  # fmt: skip
    assert not not_crossing & federated
    assert "run_rank:rankscope_compute_duration_seconds_sum:rate" in federated


def test_a_record_that_carries_its_own_value_forward_is_a_shards_when_it_reads_only_the_shards_series() -> None:
    layout = split(Tunables())
    # What a target served last is read from the target's own series: the shard that scrapes it keeps it.
    assert "run_rank:rankscope_run_info:last_seen_timestamp_seconds" in layout.shard_records
    # Whether a rank finished is matched on (run_id, rank), which a shard cannot see whole: a shard keeps it for
    # its own ranks only because the liveness area says so (SHARD_EVALUATED; rankscope.mixin.layout says what a
    # shard then misses), and the global server reads it fresh.
    assert "run_rank:rankscope_run_finished:finished_timestamp_seconds" in layout.shard_records
    assert not is_shard_local(
        next(
            r["expr"]
            for g in layout.shard_groups.values()
            for r in g["rules"]
            if r["record"].endswith(":finished_timestamp_seconds")
        )
    )


@pytest.mark.parametrize(
    ("expr", "local"),
    [
        ("sum by (run_id, node, rank) (rate(x[2m]))", True),
        ("max by (run_id, node) (x) > 0.85", True),
        ('rate(x_bucket{le="0.1"}[2m]) / ignoring (le) rate(x_count[2m])', True),
        ("(up == 0) * on (job, instance) group_left (run_id) y", True),
        ("sum by (run_id) (x)", False),
        ("sum(x)", False),
        ("sum(x) by (node)", True),
        ("x unless on (run_id) y", False),
        ("sum without (node) (x)", False),
        ("topk by (run_id) (1, x)", False),
    ],
)
def test_a_rule_is_a_shards_only_when_no_grouping_crosses_nodes(expr: str, local: bool) -> None:
    assert is_shard_local(expr) is local


def test_selectors_are_read_as_written_and_strings_durations_and_functions_are_not_series() -> None:
    expr = (
        'label_replace(min by (run_id) (a_total{local_rank="0", le = "0.1"}[5m] offset 30m) < 1e-07, "signal", '
        '"scale", "", "") or max_over_time(timestamp(run:b:c)[30m:]) and on (run_id) time() - d'
    )
    assert selectors(expr) == {
        Selector("a_total", ('le="0.1"', 'local_rank="0"')),
        Selector("run:b:c"),
        Selector("d"),
    }
    assert Selector("a").covers(Selector("a", ('le="0.1"',))) and not Selector("a", ('le="1"',)).covers(Selector("a"))


def test_number_literals_in_any_case_are_not_series() -> None:
    # PromQL reads Inf and NaN in any case; the data-wait share's `% +Inf` was taken for a series named Inf.
    assert selectors("(rate(a_sum[2m]) / rate(b_sum[2m])) % +Inf > NaN or c * nan") == {
        Selector("a_sum"),
        Selector("b_sum"),
        Selector("c"),
    }


def test_the_committed_sharded_layout_is_the_commands_output_byte_for_byte(tmp_path) -> None:
    assert cli.main(["--layout", "sharded", "--out", str(tmp_path)]) == 0
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(REPO) for p in (REPO / "prometheus" / "sharded").rglob("*") if p.is_file())
    assert written == committed
    for relative in written:
        assert (tmp_path / relative).read_bytes() == (REPO / relative).read_bytes(), f"{relative} is stale"
    assert cli.main(["--layout", "sharded", "--check", "--out", str(REPO)]) == 0
    # A single-layout run writes nothing of the sharded layout (its output is unchanged).
    single = tmp_path / "single"
    assert cli.main(["--out", str(single)]) == 0
    assert not (single / "prometheus" / "sharded").exists()


def test_the_shard_count_sets_the_configs_and_bad_counts_fail_in_one_line(tmp_path) -> None:
    assert cli.main(["--layout", "sharded", "--shards", "3", "--out", str(tmp_path)]) == 0
    out = tmp_path / "prometheus" / "sharded"
    assert sorted(p.name for p in (out / "shard").glob("prometheus-*.yml")) == [f"prometheus-{i}.yml" for i in range(3)]
    job = yaml.safe_load((out / "shard" / "prometheus-2.yml").read_text())["scrape_configs"][0]
    assert [r.get("modulus") for r in job["relabel_configs"]][0] == 3 and job["relabel_configs"][1]["regex"] == "2"
    federate = yaml.safe_load((out / "global" / "federate.yml").read_text())["scrape_configs"][0]
    assert len(federate["static_configs"][0]["targets"]) == 3 and federate["honor_labels"] is True
    # A shard's recording arrives without a job label and must not get the federation job's.
    (relabel,) = federate["metric_relabel_configs"]
    assert (relabel["regex"], relabel["target_label"], relabel["replacement"]) == (federate["job_name"], "job", "")
    argv = [sys.executable, "-m", "rankscope.mixin.cli", "--layout", "sharded", "--shards", "0", "--out", str(tmp_path)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "rankscope-mixin: --shards must be at least 1, got 0"
    ]


def test_promtool_accepts_every_generated_config_and_rule_file_of_both_layouts() -> None:
    """Plain Prometheus configs and rule groups: what a remote ruler (Mimir, Cortex, Thanos) loads too."""
    out = REPO / "prometheus" / "sharded"
    for config in [out / "global" / "prometheus.yml", *sorted((out / "shard").glob("prometheus-*.yml"))]:
        result = subprocess.run([binary("promtool"), "check", "config", str(config)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    rule_files = [*sorted((REPO / "prometheus" / "rules").glob("*.yml")), *sorted(out.glob("*/rules/*.yml"))]
    result = subprocess.run(
        [binary("promtool"), "check", "rules", *map(str, rule_files)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _intervals(groups: list[dict]) -> dict[str, str]:
    return {group["name"].removeprefix("rankscope."): group.get("interval", "") for group in groups}


@pytest.mark.parametrize(
    ("settings", "performance", "others"),
    [
        ({}, "30s", ""),  # shipped: every performance alert waits 10 minutes or more
        ({"slow_interval": "15s"}, "15s", ""),
        ({"slow_interval": ""}, "", ""),
        ({"imbalance_for": "5m"}, "30s", ""),  # exactly ten times the slow interval
        ({"imbalance_for": "4m"}, "", ""),  # less: the straggler page would wait more than a tenth of its `for`
        ({"evaluation_interval": "10s"}, "30s", "10s"),
        ({"evaluation_interval": "1m"}, "1m", "1m"),  # never faster than every other group
    ],
)
def test_the_performance_group_is_evaluated_every_slow_interval_where_each_of_its_alerts_waits_ten_times_as_long(
    settings: dict[str, str], performance: str, others: str
) -> None:
    t = Tunables(**settings)
    single = _intervals(rules.groups(t))
    layout = split(t)
    for intervals in (
        single,
        _intervals(list(layout.shard_groups.values())),
        _intervals(list(layout.global_groups.values())),
    ):
        assert intervals.pop("performance") == performance
        assert set(intervals.values()) == {others}
    committed = yaml.safe_load((REPO / "prometheus" / "rules" / "performance.yml").read_text())["groups"][0]
    assert committed["interval"] == "30s"
