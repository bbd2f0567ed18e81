"""prometheus/: the configuration, the generated rules and their promtool unit tests.

Everything is checked with the real `promtool` (Debian package `prometheus`, installed by
scripts/bootstrap.sh); a missing binary is a failure, not a skip.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import subprocess
import sys
import urllib.parse
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml
from rankscope import contract
from rankscope.contract import IDENTITY_LABELS, METRICS, MetricKind
from rankscope.control import catalog
from rankscope.mixin import cli, config, promql
from rankscope.mixin import rules as mixin_rules
from rankscope.mixin.config import Tunables

from tests.support import fetch, stop_process, tail, torchrun, wait_for

REPO = Path(__file__).resolve().parent.parent
PROM = REPO / "prometheus"
RULES = PROM / "rules"
RULE_FILES = sorted(RULES.glob("*.yml"))
UNIT_TEST_FILES = sorted((PROM / "tests").glob("*_test.yml"))
RUNBOOK = REPO / "docs" / "runbook.md"


def promtool(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not on PATH: run scripts/bootstrap.sh (Debian package 'prometheus')")
    return subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{' '.join(result.args)} failed:\n{result.stdout}\n{result.stderr}"


def _rules(kind: str) -> list[dict]:
    """Every rule of `kind` ("alert" or "record") in the rule files (the alert group starts with recording
    rules of its own: per-run values its alerts read)."""
    documents = [yaml.safe_load(path.read_text()) for path in RULE_FILES]
    return [rule for document in documents for group in document["groups"] for rule in group["rules"] if kind in rule]


ALERT_RULES = _rules("alert")
RECORDING_RULES = _rules("record")
RECORDED = {rule["record"] for rule in RECORDING_RULES}


@functools.cache
def _unit_tests() -> list[dict]:
    return [case for path in UNIT_TEST_FILES for case in yaml.safe_load(path.read_text())["tests"]]


# --- files and configuration --------------------------------------------------------------


def test_committed_rule_files_equal_the_generator_output():
    for name, text in mixin_rules.render(Tunables()).items():
        assert (RULES / name).read_text() == text, f"{name} is stale: run rankscope-mixin"
    assert {p.name for p in RULE_FILES} == set(mixin_rules.render(Tunables()))


def generate(out: Path, *settings: str) -> Path:
    """Run the mixin command into `out` with `settings` (NAME=VALUE); its rule directory."""
    assert cli.main(["--out", str(out), *(f"--set={setting}" for setting in settings)]) == 0
    return out / "prometheus" / "rules"


def test_every_rule_group_is_an_area_file_with_its_own_promtool_tests():
    # One group per file, named after its area; each area's test file loads the rule files.
    for path in RULE_FILES:
        (group,) = yaml.safe_load(path.read_text())["groups"]
        assert group["name"] == f"rankscope.{path.stem}"
        tests = PROM / "tests" / f"{path.stem}_test.yml"
        assert tests.is_file(), f"no promtool tests for {group['name']}: {tests}"
        assert "../rules/*.yml" in yaml.safe_load(tests.read_text())["rule_files"]


def test_the_groups_are_ordered_after_the_groups_they_read():
    # promtool evaluates the groups in group_eval_order (then the groups not listed): each test file lists groups
    # in the generator's order. A new area's group need not be listed in the other areas' files: none reads it.
    order = [group["name"] for group in mixin_rules.groups(Tunables())]
    for path in [*UNIT_TEST_FILES, RECOVERY_UNIT_TESTS]:
        listed = yaml.safe_load(path.read_text()).get("group_eval_order", [])
        assert listed == [name for name in order if name in listed], f"{path.name}: {listed}, generator: {order}"
        assert listed[:1] == order[:1], f"{path.name}: list the groups from the first, {order[0]}"


def test_promtool_accepts_the_compose_configuration_and_its_rule_files():
    result = promtool("check", "config", PROM / "prometheus.yml")
    assert_ok(result)
    assert f"{len(RULE_FILES)} rule files found" in result.stdout


def test_promtool_accepts_the_rule_files():
    assert_ok(promtool("check", "rules", *RULE_FILES))


def test_promtool_unit_tests_pass():
    assert_ok(promtool("test", "rules", *UNIT_TEST_FILES))


def test_every_rankscope_scrape_job_honors_the_exporters_labels():
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["rankscope"]["honor_labels"] is True
    assert {"prometheus", "alertmanager"} <= set(jobs)
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    for example in ("file_sd.yml", "kubernetes_pods.yml"):
        for job in yaml.safe_load((PROM / "examples" / example).read_text()):
            assert job["honor_labels"] is True, example


def test_the_scrape_examples_are_valid_prometheus_configuration(tmp_path):
    # A full configuration around the example jobs, with the file_sd glob pointed at the example
    # target file so promtool validates that too. Debian's Prometheus is built without Kubernetes
    # discovery, so the pod job is checked (relabelling included) with its discovery swapped for
    # a static target.
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    file_sd = yaml.safe_load((PROM / "examples" / "file_sd.yml").read_text())
    file_sd[0]["file_sd_configs"][0]["files"] = [str(PROM / "examples" / "targets" / "*.json")]
    pods = yaml.safe_load((PROM / "examples" / "kubernetes_pods.yml").read_text())
    assert [sd["role"] for sd in pods[0].pop("kubernetes_sd_configs")] == ["pod"]
    pods[0]["static_configs"] = [{"targets": ["10.0.0.1:9400"]}]
    config["scrape_configs"] = file_sd + pods
    config["rule_files"] = [str(path) for path in RULE_FILES]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = promtool("check", "config", path)
    assert_ok(result)


def test_the_target_file_example_has_the_identity_labels_the_trainer_writes():
    groups = json.loads((PROM / "examples" / "targets" / "rankscope-demo.json").read_text())
    assert groups
    for group in groups:
        assert len(group["targets"]) == 1 and re.match(r"^[\w.-]+:94\d\d$", group["targets"][0])
        assert set(group["labels"]) == set(IDENTITY_LABELS)


def test_the_podmonitor_example_keeps_identity_labels_and_rank_ports_only():
    monitor = yaml.safe_load((PROM / "examples" / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True
    keep = [r for r in endpoint["relabelings"] if r["action"] == "keep"]
    assert keep[0]["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    assert re.fullmatch(keep[0]["regex"], "rankscope-3") and not re.fullmatch(keep[0]["regex"], "http")


# --- rules against the metric contract ----------------------------------------------------

_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
#: Range and subquery brackets ([5m], [30m:1m]): their durations are not names.
_RANGE = re.compile(r"\[[0-9a-z:]*\]")


def _names_in(expr: str) -> set[str]:
    return set(_IDENT.findall(_RANGE.sub("", _QUOTED.sub("", expr))))


def _series_names() -> set[str]:
    return {series for spec in METRICS.values() for series in spec.series_names}


@pytest.mark.parametrize("rule", ALERT_RULES + RECORDING_RULES, ids=lambda r: r.get("alert") or r["record"])
def test_every_metric_a_rule_reads_exists_in_the_contract_or_is_recorded(rule):
    names = _names_in(rule["expr"])
    unknown = {n for n in names if n.startswith("rankscope_") and n not in _series_names()}
    assert not unknown, f"not in rankscope.contract: {sorted(unknown)}"
    unrecorded = {n for n in names if ":" in n and n not in RECORDED}
    assert not unrecorded, f"no recording rule produces {sorted(unrecorded)}"


def test_the_name_check_sees_histogram_series_and_ignores_label_values():
    names = _names_in('sum(rate(rankscope_step_duration_seconds_bucket{split="rankscope_fake"}[2m]))')
    assert "rankscope_step_duration_seconds_bucket" in names and "rankscope_fake" not in names
    subquery = _names_in("max_over_time(timestamp(rankscope_run_info)[30m:1m]) or max_over_time(up[30m:])")
    assert subquery == {"max_over_time", "timestamp", "rankscope_run_info", "or", "up"}
    assert "rankscope_step_duration_seconds_bucket" in _series_names()


@pytest.mark.parametrize("record", sorted(RECORDED))
def test_recorded_series_are_named_level_metric_operation_after_a_contract_metric(record):
    level, metric, operation = record.split(":")
    assert level in ("run", "run_node", "run_rank") and operation
    bases = {spec.name for spec in METRICS.values()} | _series_names()
    bases |= {spec.name.removesuffix("_total") for spec in METRICS.values() if spec.kind is MetricKind.COUNTER}
    assert metric in bases


def _contract_metrics_read() -> set[str]:
    """The contract metrics (family names) that some rule reads."""
    family = {series: spec.name for spec in METRICS.values() for series in spec.series_names}
    return {family[n] for rule in ALERT_RULES + RECORDING_RULES for n in _names_in(rule["expr"]) if n in family}


@pytest.mark.parametrize("metric_name", sorted(_contract_metrics_read()))
def test_every_metric_a_rule_reads_is_looked_up_in_the_contract(metric_name, monkeypatch):
    # A name typed out in the generator would survive its metric leaving the contract; a looked-up one fails.
    monkeypatch.delitem(contract.METRICS, metric_name)
    with pytest.raises(KeyError, match=metric_name.removeprefix("rankscope_")):
        mixin_rules.render(Tunables())


def test_a_metric_renamed_in_the_contract_breaks_generation(tmp_path):
    # The installed generator, run as a user runs it, after rankscope_grad_norm is renamed in the contract.
    rename = (
        "import sys, dataclasses; from rankscope import contract\n"
        "spec = contract.METRICS.pop('rankscope_grad_norm')\n"
        "contract.METRICS['rankscope_gradient_norm'] = dataclasses.replace(spec, name='rankscope_gradient_norm')\n"
        "from rankscope.mixin import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", rename, "--out", str(tmp_path / "rules")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "grad_norm" in result.stderr, result.stderr
    assert not (tmp_path / "rules").exists()


def test_no_alert_reads_a_series_more_than_two_recording_levels_above_the_scraped_data():
    # A remote ruler (vmalert) sees a recorded series one evaluation after it wrote it: each level is a delay.
    depth = promql.recording_depth(mixin_rules.recording_rules(Tunables()))  # in the groups' order
    assert max(depth.values()) <= 3
    deep = {rule["alert"]: promql.expression_depth(rule["expr"], depth) for rule in ALERT_RULES}
    assert max(deep.values()) <= 2, deep
    # Every alert but the rank-down one reads whether its run has ended (level 2); that one reads what each target
    # served last, carried forward by a recording that reads scraped series and itself (level 1).
    assert {name for name, level in deep.items() if level != 2} == {"RankscopeRankDown"}
    assert deep["RankscopeRankDown"] == 1


def test_the_plateau_alerts_are_tickets_without_an_action_that_read_only_run_level_series():
    # A plateau is a person's call (no trainer action, no page), and at thousands of ranks the rules that
    # find it must cost a few series per run: no scraped (per-rank) series is read over their long windows. The
    # time of the last applied control action is not per rank: rank 0 serves it, once per job (the plateau's
    # rollback clause).
    once_per_job = {promql.metric_name("control_last_applied_timestamp_seconds")}
    alerts = {rule["alert"]: rule for rule in ALERT_RULES}
    change = next(rule for rule in RECORDING_RULES if rule["record"] == promql.LOSS_CHANGE)
    for rule in (alerts["RankscopeLossPlateau"], alerts["RankscopeValLossPlateau"], change):
        assert rule.get("labels", {"severity": "ticket"}) == {"severity": "ticket"}, rule
        assert not {n for n in _names_in(rule["expr"]) if n.startswith("rankscope_")} - once_per_job, rule


def test_the_depth_check_rejects_a_series_read_before_it_is_recorded():
    with pytest.raises(ValueError, match="run:rankscope_loss:smoothed"):
        promql.recording_depth([{"record": "run:x:min", "expr": "min_over_time(run:rankscope_loss:smoothed[5m])"}])


# --- alert conventions --------------------------------------------------------------------


def _runbook_anchors() -> list[str]:
    # GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens.
    headings = re.findall(r"^#{2,3} (.+)$", RUNBOOK.read_text(), flags=re.M)
    return [re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings]


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r["alert"])
def test_every_alert_has_severity_summary_description_and_its_own_runbook_section(rule):
    labels, annotations = rule["labels"], rule["annotations"]
    assert labels["severity"] in config.SEVERITIES
    assert labels.get("action", "checkpoint") in config.ACTIONS
    assert annotations["summary"] and "{{" not in annotations["summary"]
    assert "$labels.run_id" in annotations["description"]
    url, _, anchor = annotations["runbook_url"].partition("#")
    assert url.endswith("docs/runbook.md") and anchor == rule["alert"].lower()
    assert _runbook_anchors().count(anchor) == 1


def test_the_runbook_has_no_section_for_an_alert_that_does_not_exist():
    alerts = {rule["alert"].lower() for rule in ALERT_RULES}
    assert set(_runbook_anchors()) - alerts == {"severities"}


# --- the runbook and prometheus/README.md quote the Tunables: checked against them ---------------
# Tunables (exporter/rankscope/mixin/rules.py) is the one source of every threshold, window and `for`. The
# runbook stays prose, so it is not generated: every number it quotes is checked here instead, and so
# is the alert table of prometheus/README.md. Which tunables an alert uses is found by changing each
# one and seeing which generated alerts change.

README = PROM / "README.md"
#: Tunables no alert section needs to quote: the rate window of every rule, the URL, the group interval, the
#: device-memory kind (quoted as a label matcher), the severities (each section's "Severity `...`") and the
#: actions (each section's "action `...`", checked against the rule's label).
UNQUOTED = {"rate_window", "runbook_url", "evaluation_interval", "slow_interval", "device_memory_kind"} | {
    f.name for f in fields(Tunables) if f.name.endswith(("_severity", "_action"))
}
_AMOUNT = re.compile(r"(?<![\w.`])(\d+(?:\.\d+)?(?:e[-+]?\d+)?)\s*(%|ms|s|m|h|x)?(?![\w`])")
_UNITS = {"%": ("number", 0.01), "x": ("number", 1), None: ("number", 1), "ms": ("seconds", 0.001),
          "s": ("seconds", 1), "m": ("seconds", 60), "h": ("seconds", 3600)}  # fmt: skip


def _amounts(text: str) -> list[tuple[str, float]]:
    """The amounts a text quotes, in base units: ("number", 0.85) for "85 %", ("seconds", 600) for "10m"."""
    found = []
    for value, unit in _AMOUNT.findall(text):
        kind, scale = _UNITS[unit or None]
        found.append((kind, float(value) * scale))
    return found


def _as_amount(name: str, value: object) -> tuple[str, float]:
    """A tunable's value as an amount: durations and *_seconds fields in seconds, other numbers as they are."""
    if isinstance(value, str):
        return "seconds", sum(float(n) * _UNITS[u][1] for n, u in re.findall(r"(\d+)(ms|s|m|h)", value))
    return ("seconds" if name.endswith("_seconds") else "number"), float(value)


def _variant(t, name: str):  # noqa: ANN001, ANN202 - the generator's Tunables
    """`t` with field `name` changed to another valid value."""
    value = getattr(t, name)
    if name == "data_wait_p90_seconds":
        candidates = [b for b in contract.metric("data_wait_seconds").buckets if b != value]
    elif isinstance(value, str):
        candidates = ["7m", "8m", "reserved", "info", "ticket", *config.ACTIONS, ""]
    else:
        candidates = [value * 1.5, value * 0.5, value + 1]  # + 1: a tunable that is 0 by default
    for candidate in (c for c in candidates if c != value):
        try:
            return replace(t, **{name: candidate})
        except ValueError:
            continue
    raise AssertionError(f"no valid variant of {name}={value!r}")


@functools.cache
def _tunables_used() -> dict[str, list[str]]:
    """Alert name -> the tunables whose change changes its generated rule (expression, `for` or text)."""
    t = Tunables()
    base = {a.name: a.to_rule(t) for a in mixin_rules.alerts(t)}
    used: dict[str, list[str]] = {name: [] for name in base}
    for f in fields(Tunables):
        if f.name == "runbook_url":
            continue
        variant = _variant(t, f.name)
        for alert in mixin_rules.alerts(variant):
            if alert.to_rule(t) != base[alert.name]:
                used[alert.name].append(f.name)
    return used


def _sections(text: str) -> dict[str, str]:
    """Runbook heading -> its text."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def runbook_drift(text: str, t) -> list[str]:  # noqa: ANN001 - the generator's Tunables
    """Where the runbook differs from the alerts generated from `t`: each section states its alert's severity
    and action, and quotes every tunable the alert uses as `name` (value), with its value (a `for` of 0s is
    written "no `for`")."""
    problems = []
    sections = _sections(text)
    for rule in mixin_rules.alerts(t):
        section = sections.get(rule.name, "")
        said = re.findall(r"Severity\s+`(\w+)`", section)
        if said != [rule.severity]:
            problems.append(f"{rule.name}: the runbook says severity {said}, the rule {rule.severity}")
        acts = re.findall(r"action\s+`(\w+)`", section)
        if acts != ([rule.action] if rule.action else []):
            problems.append(f"{rule.name}: the runbook says action {acts}, the rule {rule.action or 'none'}")
    for alert, names in _tunables_used().items():
        section = sections.get(alert, "")
        for name in names:
            value = getattr(t, name)
            if name in UNQUOTED:
                continue
            if name.endswith("_for") and value == "0s":
                if "no `for`" not in section:
                    problems.append(f"{alert}: {name} is 0s; the runbook should say no `for`")
                continue
            quotes = re.findall(rf"`{name}`\s*\(([^;)]*)", section)
            if not quotes:
                problems.append(f"{alert}: the runbook does not quote `{name}` ({value})")
            for quoted in quotes:
                want = _as_amount(name, value)
                got = _amounts(quoted)
                if len(got) != 1 or got[0][0] != want[0] or not math.isclose(got[0][1], want[1]):
                    problems.append(f"{alert}: the runbook says `{name}` ({quoted.strip()}), Tunables has {value}")
    return problems


def readme_table_drift(text: str, t) -> list[str]:  # noqa: ANN001 - the generator's Tunables
    """Where prometheus/README.md's alert table differs from the alerts generated from `t`: one row per alert
    with its `for`, severity and action, and every amount in its condition one of the alert's tunables."""
    rows = {
        m[0]: [c.strip() for c in m[1:]] for m in re.findall(r"^\| `(\w+)` \|(.*)\|(.*)\|(.*)\|(.*)\|$", text, re.M)
    }
    problems = []
    for alert in mixin_rules.alerts(t):
        if alert.name not in rows:
            problems.append(f"{alert.name}: no row in the alert table")
            continue
        condition, for_, severity, action = rows.pop(alert.name)
        if _as_amount("for", for_ if for_ != "0" else "0s") != _as_amount("for", alert.for_):
            problems.append(f"{alert.name}: the table says for {for_}, the rule {alert.for_}")
        if (severity, action) != (alert.severity, alert.action):
            problems.append(f"{alert.name}: the table says {severity}/{action or '-'}, the rule "
                            f"{alert.severity}/{alert.action or '-'}")  # fmt: skip
        allowed = [_as_amount(name, getattr(t, name)) for name in _tunables_used()[alert.name]]
        for kind, amount in _amounts(condition):
            if not any(kind == k and math.isclose(amount, v) for k, v in allowed):
                problems.append(f"{alert.name}: the table's condition {condition!r} quotes {amount:g} ({kind}), "
                                "which is none of the alert's tunables")  # fmt: skip
    problems += [f"{name}: a row for an alert that does not exist" for name in rows]
    return problems


def test_the_runbook_quotes_every_tunable_its_alerts_use_with_its_value():
    assert runbook_drift(RUNBOOK.read_text(), Tunables()) == []


def test_the_runbook_check_catches_a_number_that_drifted():
    text = RUNBOOK.read_text()
    assert "`host_memory_ratio` (85 %)" in text and "`stall_seconds` (600 s)" in text
    drifted = text.replace("`host_memory_ratio` (85 %)", "`host_memory_ratio` (80 %)")
    assert runbook_drift(drifted, Tunables()) == [
        "RankscopeHostMemoryHigh: the runbook says `host_memory_ratio` (80 %), Tunables has 0.85"
    ]
    # ... and tunables changed without the runbook following them.
    changed = replace(Tunables(), stall_seconds=900.0, comm_severity="page")
    assert runbook_drift(text, changed) == [
        "RankscopeCommOverheadHigh: the runbook says severity ['ticket'], the rule page",
        "RankscopeRunStalled: the runbook says `stall_seconds` (600 s), Tunables has 900.0",
    ]


def test_every_tunable_an_alert_uses_is_found():
    used = _tunables_used()
    assert used["RankscopeHostMemoryHigh"] == [
        "host_memory_ratio", "host_memory_for", "host_memory_severity", "memory_action"
    ]  # fmt: skip
    # Its rates' window is in the per-rank shares it reads (recorded: run_rank:rankscope_data_wait_seconds:*).
    assert set(used["RankscopeDataLoaderBottleneck"]) == {
        "data_wait_p90_seconds", "data_wait_share", "data_loader_for", "data_loader_severity"
    }  # fmt: skip
    # Every alert's severity is a tunable of its own.
    assert all(any(name.endswith("_severity") for name in names) for names in used.values()), used


def test_the_readme_alert_table_matches_the_generated_alerts():
    assert readme_table_drift(README.read_text(), Tunables()) == []


def test_the_readme_table_check_catches_a_number_that_drifted():
    text = README.read_text()
    row = "| `RankscopeRankImbalance` | straggler ratio > 1.5 (names the rank) | 10m | page | |"
    assert row in text
    drifted = text.replace(row, row.replace("> 1.5", "> 1.3").replace("10m", "5m"))
    assert readme_table_drift(drifted, Tunables()) == [
        "RankscopeRankImbalance: the table says for 5m, the rule 10m",
        "RankscopeRankImbalance: the table's condition 'straggler ratio > 1.3 (names the rank)' quotes 1.3 "
        "(number), which is none of the alert's tunables",
    ]


def test_alerts_that_name_a_rank_keep_the_rank_label_and_name_it():
    for rule in ALERT_RULES:
        if "$labels.rank" in rule["annotations"]["description"]:
            # The rank can only be templated if the expression keeps it.
            assert "rank" in rule["expr"], rule["alert"]


# --- unit-test coverage -------------------------------------------------------------------


@pytest.mark.parametrize("alert", [rule["alert"] for rule in ALERT_RULES])
def test_every_alert_has_unit_tests_showing_it_firing_and_silent(alert):
    cases = [c for test in _unit_tests() for c in test.get("alert_rule_test", []) if c["alertname"] == alert]
    assert any(c.get("exp_alerts") for c in cases), f"no promtool case shows {alert} firing"
    assert any(not c.get("exp_alerts") for c in cases), f"no promtool case shows {alert} silent"


@pytest.mark.parametrize("record", sorted(RECORDED))
def test_every_recording_rule_has_unit_tests_showing_it_present_and_absent(record):
    pattern = re.compile(rf"(?<![\w:]){re.escape(record)}(?![\w:])")
    cases = [c for test in _unit_tests() for c in test.get("promql_expr_test", []) if pattern.search(c["expr"])]
    assert any(c.get("exp_samples") for c in cases), f"no promtool case shows {record} with a value"
    assert any(not c.get("exp_samples") for c in cases), f"no promtool case shows {record} absent"


def _unit_tests_beside(rules: Path, tests: list[Path]) -> subprocess.CompletedProcess[str]:
    """promtool's unit tests `tests`, copied to a `tests/` beside the rule directory `rules` (they read
    ../rules/*.yml, as in prometheus/), run against the rules there."""
    (rules.parent / "tests").mkdir()
    copies = [rules.parent / "tests" / path.name for path in tests]
    for path, copy in zip(tests, copies, strict=True):
        shutil.copy(path, copy)
    return promtool("test", "rules", *copies)


def _run_unit_tests_against(variant: Tunables, alert: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """promtool's tests for `alert`, run against rules generated from `variant`."""
    for name, text in mixin_rules.render(variant).items():
        (tmp_path / "rules").mkdir(parents=True, exist_ok=True)
        (tmp_path / "rules" / name).write_text(text)
    mentioning = [path for path in UNIT_TEST_FILES if f"alertname: {alert}\n" in path.read_text()]
    assert mentioning, f"no unit test file mentions {alert}"
    return _unit_tests_beside(tmp_path / "rules", mentioning)


def _changed_alert(variant: Tunables) -> str:
    changed = [
        a.name for a, b in zip(mixin_rules.alerts(Tunables()), mixin_rules.alerts(variant), strict=True) if a != b
    ]
    assert len(changed) == 1, changed
    return changed[0]


FOR_FIELDS = [f.name for f in fields(Tunables) if f.name.endswith("_for") and getattr(Tunables(), f.name) != "0s"]


@pytest.mark.parametrize("name", FOR_FIELDS)
def test_a_for_one_evaluation_shorter_makes_its_unit_tests_fail(name, tmp_path):
    # The unit tests evaluate every minute (a `for` under a minute: every 5 s, training_latency_test.yml); each
    # alert's tests must pin its `for` exactly.
    default = getattr(Tunables(), name)
    minutes, seconds = re.fullmatch(r"(\d+)m", default), re.fullmatch(r"(\d+)s", default)
    assert minutes or (seconds and int(seconds.group(1)) % 5 == 0 and int(seconds.group(1)) < 60), (
        f"{name}: defaults are whole minutes, or multiples of 5 s under one, so the tests can pin them"
    )
    shorter = f"{int(minutes.group(1)) - 1}m" if minutes else f"{int(seconds.group(1)) - 5}s"
    variant = config.apply_overrides(Tunables(), [f"{name}={shorter}"])
    result = _run_unit_tests_against(variant, _changed_alert(variant), tmp_path)
    assert result.returncode != 0, f"tests still pass with {name}={shorter}:\n{result.stdout}"


def test_one_more_allowed_non_finite_step_makes_its_unit_tests_fail(tmp_path):
    variant = config.apply_overrides(Tunables(), ["nonfinite_steps=3"])
    assert _run_unit_tests_against(variant, _changed_alert(variant), tmp_path).returncode != 0
    variant = config.apply_overrides(Tunables(), ["nonfinite_steps=1"])
    assert _run_unit_tests_against(variant, _changed_alert(variant), tmp_path / "fewer").returncode != 0


# --- overrides (how the end-to-end tests get fast rules) --------------------------------------


def test_overrides_reach_the_generated_rules_and_the_variant_is_valid(tmp_path):
    out = generate(tmp_path, "imbalance_ratio=1.3", "*_for=2s", "rate_window=10s")
    files = sorted(out.glob("*.yml"))
    rules = [rule for path in files for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
    alerts = [rule for rule in rules if "alert" in rule]
    imbalance = next(rule for rule in alerts if rule["alert"] == "RankscopeRankImbalance")
    assert "straggler_ratio > 1.3\n" in imbalance["expr"]
    assert {rule.get("for") for rule in alerts} == {"2s"}
    assert "[10s]" in (out / "performance.yml").read_text()
    assert_ok(promtool("check", "rules", *files))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("imbalance_ratio=abc", "imbalance_ratio must be a number"),
        ("imbalance_ratio=0.9", "imbalance_ratio must be > 1"),
        ("host_memory_ratio=85", "host_memory_ratio must be between 0 and 1"),
        ("host_memory_for=5 minutes", "host_memory_for must be a Prometheus duration"),
        ("no_such_knob=1", "no tunable matches 'no_such_knob'"),
        ("imbalance_ratio", "--set expects NAME=VALUE"),
        ("device_memory_kind=free", "device_memory_kind must be allocated, reserved or peak"),
        ("data_wait_p90_seconds=0.2", "data_wait_p90_seconds must be a bucket boundary of rankscope_data_wait_seconds"),
        ("comm_severity=urgent", "comm_severity must be one of page, ticket, info"),
        ("loss_plateau_improvement=1", "loss_plateau_improvement must be between 0 and 1"),
        ("loss_change_window=30 minutes", "loss_change_window must be a Prometheus duration"),
        (
            "divergence_action=checkpoint",
            'divergence_action must be one of rollback, reduce_lr, "" (no action) (the actions',
        ),
        ("nonfinite_action=stop", 'nonfinite_action must be one of reduce_lr, rollback, "" (no action) (the actions'),
        (
            "memory_action=reduce_lr",
            'memory_action must be one of checkpoint, reduce_micro_batch, "" (no action) (the actions',
        ),
        ("slow_step_action=rollback", 'slow_step_action must be one of "" (no action), reduce_micro_batch'),
        ("slow_step_seconds=0", "slow_step_seconds must be > 0"),
    ],
)
def test_a_bad_override_fails_with_one_line_naming_the_setting(override, message, capsys, tmp_path):
    assert cli.main(["--out", str(tmp_path), "--set", override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


# --- the recovery actions an alert can ask for (exporter/rankscope/control/catalog.py) ----------------------
# Each `*_action` tunable picks the `action` label of its alerts among the catalog's actions for them.

#: The rules with every recovery action chosen that is not the default, and their unit tests.
RECOVERY_OVERRIDES = [
    "divergence_action=rollback",
    "nonfinite_action=rollback",
    "memory_action=reduce_micro_batch",
    "slow_step_action=reduce_micro_batch",
]
RECOVERY_UNIT_TESTS = PROM / "tests" / "variants" / "recovery_actions_test.yml"


def test_each_action_tunable_offers_the_catalog_actions_of_its_alerts_and_sets_only_their_label():
    assert {name: config.action_choices(name) for name in config.ACTION_TUNABLES} == {
        # "" on every one: any alert may be left to the on-call person (the campaign's loop-off arm).
        "memory_action": ["checkpoint", "reduce_micro_batch", ""],
        "divergence_action": ["rollback", "reduce_lr", ""],
        "nonfinite_action": ["reduce_lr", "rollback", ""],
        "slow_step_action": ["", "reduce_micro_batch"],
        "hang_action": ["restart", ""],
    }
    # ACTION_TUNABLES names exactly the alerts whose rule each tunable changes.
    used = _tunables_used()
    for name, choice in config.ACTION_TUNABLES.items():
        assert {alert for alert, names in used.items() if name in names} == set(choice.alerts), name


@pytest.mark.parametrize(("name", "action"), [(n, a) for n in config.ACTION_TUNABLES for a in config.action_choices(n)])
def test_every_action_the_catalog_allows_reaches_its_alerts_label_and_text(name, action):
    variant = config.apply_overrides(Tunables(), [f"{name}={action}"])
    summary, description = config.effect(action) if action else ("", "")
    carrying = [alert for alert in mixin_rules.alerts(variant) if alert.name in config.ACTION_TUNABLES[name].alerts]
    assert len(carrying) == len(config.ACTION_TUNABLES[name].alerts)
    for alert in carrying:
        assert alert.action == action, alert.name
        assert summary in alert.summary and description in alert.description.lower(), alert.name


def test_the_choices_follow_the_catalog(monkeypatch):
    # No second list: an action the catalog stops offering an alert is refused for it.
    offered = tuple(spec for spec in catalog.CATALOG if spec.name != "rollback")
    monkeypatch.setattr(catalog, "CATALOG", offered)
    assert config.action_choices("divergence_action") == ["reduce_lr", ""]
    with pytest.raises(
        ValueError, match=r'^divergence_action must be one of reduce_lr, "" \(no action\) \(the actions'
    ):
        config.apply_overrides(Tunables(), ["divergence_action=rollback"])


def test_rules_generated_with_the_recovery_actions_are_valid_and_carry_them(tmp_path):
    out = generate(tmp_path, *RECOVERY_OVERRIDES)
    assert_ok(promtool("check", "rules", *sorted(out.glob("*.yml"))))
    assert_ok(_unit_tests_beside(out, [RECOVERY_UNIT_TESTS]))
    # The same cases against the shipped rules (reduce_lr, checkpoint, no action) fail: they pin the labels.
    shipped = _unit_tests_beside(generate(tmp_path / "shipped"), [RECOVERY_UNIT_TESTS])
    assert shipped.returncode != 0 and 'action="reduce_lr"' in shipped.stdout + shipped.stderr


# --- a real Prometheus, a real 2-rank run ----------------------------------------------------


def _query(url: str, expr: str) -> list[dict]:
    body = json.loads(fetch(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.integration
def test_a_real_prometheus_with_these_rules_names_the_straggler_of_a_real_run_then_sees_its_ranks_go_down(
    tmp_path, free_port, free_port_block
):
    # The shipped configuration and rules; only intervals, windows, `for`s and addresses changed
    # (as the end-to-end tests do). The job's rank 1 sleeps 20 ms in every step's compute.
    base = free_port_block(2)
    out = generate(tmp_path, "rate_window=5s", "*_for=0s")
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(out / "*.yml")]
    del config["alerting"]
    config["scrape_configs"] = [job for job in config["scrape_configs"] if job["job_name"] == "rankscope"]
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port, prom_log, job_log, out = free_port(), tmp_path / "prometheus.log", tmp_path / "torchrun.log", tmp_path / "job"
    out.mkdir()
    url = f"http://127.0.0.1:{port}"
    exe = shutil.which("prometheus") or pytest.fail("prometheus is not on PATH: run scripts/bootstrap.sh")
    with prom_log.open("w") as log:
        prometheus = subprocess.Popen(
            [
                exe,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    job = None

    def diagnose() -> str:
        seen = {expr: _query(url, expr) for expr in ("up", "ALERTS", promql.COMPUTE_BUSY)}
        return f"prometheus saw {json.dumps(seen)}\n--- prometheus log\n{tail(prom_log)}\n--- job log\n{tail(job_log)}"

    try:
        wait_for(lambda: fetch(f"{url}/-/ready") is not None, 30, "prometheus to be ready", lambda: tail(prom_log))
        job = torchrun(
            2,
            ["tests/jobs/exporter_job.py", "--base-port", str(base), "--out", str(out)]
            + ["--steps", "600", "--slow-rank", "1", "--slow-seconds", "0.02"],
            master_port=free_port(),
            extra_env={"RANKSCOPE_RUN_ID": "rules-it"},
            log=job_log,
        )

        # While a rank has not yet stepped inside the rate window its compute rate is 0 and the other one
        # looks slow, so wait for the slow rank to be named (the event), not for the first series.
        def ranks_named(expr: str) -> list[dict] | None:
            found = _query(url, expr)
            return found if [s["metric"]["rank"] for s in found] == ["1"] else None

        # Until rank 0 has a rate of its own, rank 1 is the only series and its own median (ratio 1): wait for
        # the ratio against both ranks (the clean-clone CI once read the lone series).
        def straggler_named() -> list[dict] | None:
            found = ranks_named(f'{promql.STRAGGLER}{{run_id="rules-it"}}')
            return found if found and float(found[0]["value"][1]) > 1 else None

        wait_for(straggler_named, 120, "rank 1 named the straggler, above the median", diagnose)
        firing = 'ALERTS{alertname="RankscopeRankImbalance", alertstate="firing", run_id="rules-it"}'
        alert = wait_for(lambda: ranks_named(firing), 60, "the imbalance alert on rank 1", diagnose)
        assert alert[0]["metric"]["severity"] == "page"

        wait_for(lambda: all((out / f"rank{r}.ready").exists() for r in (0, 1)), 120, "the job's steps", diagnose)
        (out / "stop").touch()
        assert job.wait(timeout=60) == 0, tail(job_log)
        down = 'ALERTS{alertname="RankscopeRankDown", alertstate="firing", run_id="rules-it"}'
        alerts = wait_for(lambda: len(_query(url, down)) == 2 and _query(url, down), 30, "rank-down alerts", diagnose)
        assert sorted(a["metric"]["rank"] for a in alerts) == ["0", "1"]
    finally:
        if job is not None:
            (out / "stop").touch()
            stop_process(job)
        stop_process(prometheus)
