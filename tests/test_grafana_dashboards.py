"""The Grafana dashboards and provisioning: generated, consistent with the metric contract, valid PromQL.

Grafana itself cannot run here; the end-to-end test runs every panel query
against a live Prometheus. These tests check everything that needs no data.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from rankscope.contract import METRICS, PHASES
from rankscope.mixin import cli, promql
from rankscope.mixin.config import Tunables
from rankscope.mixin.dashboards import generate
from rankscope.mixin.dashboards.panels import DATASOURCE_UID, GPU_ONLY_METRICS
from rankscope.mixin.dashboards.queries import (
    DASHBOARDS_DIR,
    REQUIRES_GPU_TAG,
    dashboards,
    metric_names,
    panel_queries,
    substitute,
)
from rankscope_trainer.metrics import TRAINER_METRICS

REPO = Path(__file__).resolve().parent.parent
PROVISIONING = REPO / "grafana" / "provisioning"

#: Series Prometheus makes itself (alert state, scrape health).
BUILTIN_SERIES = {"ALERTS", "ALERTS_FOR_STATE", "up", "scrape_duration_seconds", "scrape_samples_scraped"}
VARIABLES = {"run", "rank"}
GRAFANA_BUILTINS = {"__rate_interval"}


def _panels(board: dict) -> list[dict]:
    found = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels") or [])
        else:
            found.append(panel)
    return found


def _all_exprs(board: dict) -> list[str]:
    exprs = [target["expr"] for panel in _panels(board) for target in panel["targets"]]
    return exprs + [ann["expr"] for ann in board["annotations"]["list"] if "expr" in ann]


def _recording_rules() -> set[str]:
    names = set()
    for path in sorted((REPO / "prometheus" / "rules").glob("*.yml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names.update(rule["record"] for rule in group.get("rules", []) if "record" in rule)
    return names


@pytest.fixture(scope="module")
def boards() -> list[dict]:
    found = dashboards()
    assert {b["title"] for b in found} == {
        "rankscope / Run overview",
        "rankscope / Ranks",
        "rankscope / Model and data",
    }
    return found


def test_committed_dashboards_equal_the_generator_output():
    rendered = generate.render()
    committed = {path.name: path.read_text() for path in DASHBOARDS_DIR.glob("*.json")}
    assert set(committed) == set(rendered), "run `make dashboards` and commit grafana/dashboards/"
    stale = [name for name in rendered if committed[name] != rendered[name]]
    assert not stale, f"stale dashboards {stale}: run `make dashboards` and commit the result"


def test_the_mixin_check_reports_a_stale_dashboard(tmp_path, capsys):
    assert cli.main(["--out", str(tmp_path)]) == 0
    assert cli.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "grafana" / "dashboards" / "ranks.json").write_text("{}\n")
    assert cli.main(["--out", str(tmp_path), "--check"]) == 1
    assert "ranks.json" in capsys.readouterr().err


def test_every_metric_a_dashboard_names_is_in_the_contract_or_a_recording_rule(boards):
    specs = [*METRICS.values(), *TRAINER_METRICS]
    known = {name for spec in specs for name in spec.series_names} | _recording_rules() | BUILTIN_SERIES
    unknown = sorted(
        {
            (b["title"], name)
            for b in boards
            for expr in _all_exprs(b)
            for name in metric_names(expr)
            if name not in known
        }
    )
    assert not unknown, f"metrics not in rankscope.contract, rankscope_trainer.metrics nor prometheus/rules: {unknown}"


def test_the_metric_name_extractor_finds_names_and_skips_labels_and_functions():
    expr = (
        'histogram_quantile(0.9, sum by (le, rank) (rate(rankscope_step_duration_seconds_bucket{run_id="$run"}'
        "[$__rate_interval]))) / on (rank) group_left level:compute:mean or vector(0) > 1e5"
    )
    assert metric_names(expr) == {"rankscope_step_duration_seconds_bucket", "level:compute:mean"}


def test_every_panel_has_a_unit_and_a_title(boards):
    for board in boards:
        for panel in _panels(board):
            assert panel.get("title"), f"{board['title']}: a panel has no title"
            unit = panel["fieldConfig"]["defaults"].get("unit")
            assert unit, f"{board['title']} / {panel['title']}: no unit"


def test_every_dashboard_has_the_run_and_rank_variables_and_uses_no_other(boards):
    for board in boards:
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert set(variables) == VARIABLES, board["title"]
        assert variables["run"]["query"] == "label_values(rankscope_run_info, run_id)"
        assert variables["rank"]["multi"] and variables["rank"]["includeAll"]
        for expr in _all_exprs(board):
            used = set(re.findall(r"\$\{?(\w+)", expr))
            assert used <= VARIABLES | GRAFANA_BUILTINS, f"{board['title']}: {expr} uses {used}"


def test_rates_use_grafanas_rate_interval(boards):
    for board in boards:
        for expr in _all_exprs(board):
            for window in re.findall(r"(?:rate|increase|changes)\([^\[]*\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", f"{board['title']}: {expr}"


def test_firing_alerts_and_control_actions_are_annotations(boards):
    for board in boards:
        exprs = [ann.get("expr", "") for ann in board["annotations"]["list"]]
        assert any('ALERTS{alertstate="firing"' in e for e in exprs), board["title"]
        assert any("rankscope_control_actions_total" in e for e in exprs), board["title"]


def test_every_query_uses_the_provisioned_datasource(boards):
    provisioned = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = provisioned["datasources"]
    assert source["uid"] == DATASOURCE_UID
    for board in boards:
        refs = [v["datasource"] for v in board["templating"]["list"]]
        refs += [a["datasource"] for a in board["annotations"]["list"]]
        for panel in _panels(board):
            refs += [panel["datasource"], *(t["datasource"] for t in panel["targets"])]
        assert all(ref == {"type": "prometheus", "uid": source["uid"]} for ref in refs), board["title"]


def test_datasource_time_interval_matches_the_prometheus_scrape_interval():
    provisioned = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    prometheus = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())
    scrape = prometheus.get("global", {}).get("scrape_interval", "1m")
    assert provisioned["datasources"][0]["jsonData"]["timeInterval"] == scrape


def test_the_dashboard_provider_loads_the_directory_compose_mounts():
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "rankscope.yml").read_text())["providers"][0]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts


def test_exactly_the_panels_that_read_gpu_metrics_are_tagged_requires_gpu(boards):
    tagged = 0
    for board in boards:
        for panel in _panels(board):
            reads_gpu = any(metric_names(t["expr"]) & GPU_ONLY_METRICS for t in panel["targets"])
            assert (REQUIRES_GPU_TAG in panel.get("tags", [])) == reads_gpu, f"{board['title']} / {panel['title']}"
            tagged += reads_gpu
    assert tagged >= 4


def test_panel_queries_lists_every_target_with_variables_filled_in(boards):
    queries = panel_queries(run="demo-run", rank="1", rate_interval="20s")
    assert len(queries) == sum(len(p["targets"]) for b in boards for p in _panels(b))
    assert {q.dashboard for q in queries} == {b["title"] for b in boards}
    for query in queries:
        assert "$" not in query.expr, query
        assert 'run_id="demo-run"' in query.expr or "ALERTS" in query.expr, query
    gpu = {q.panel for q in queries if q.requires_gpu}
    assert "GPU utilisation" in gpu and "Loss" not in gpu


def test_the_phase_timeline_names_every_phase_of_the_contract(boards):
    (ranks,) = [b for b in boards if b["title"] == "rankscope / Ranks"]
    (panel,) = [p for p in _panels(ranks) if p["type"] == "state-timeline"]
    assert [t["expr"] for t in panel["targets"]] == ['rankscope_phase{run_id="$run", rank=~"$rank"}']
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    assert mapping["type"] == "value"
    assert {int(value): result["text"] for value, result in mapping["options"].items()} == dict(enumerate(PHASES))


def test_a_phase_appended_to_the_contract_reaches_the_timeline(monkeypatch):
    monkeypatch.setattr(generate, "PHASES", (*PHASES, "new_phase"))
    board = json.loads(generate.render()["ranks.json"])
    (panel,) = [p for p in _panels(board) if p["type"] == "state-timeline"]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    assert mapping["options"][str(len(PHASES))]["text"] == "new_phase"


def test_substitute_fills_both_variable_syntaxes_and_rejects_unknown_ones():
    assert substitute('x{rank=~"${rank}", run_id="$run"}[$__rate_interval]', run="r", rank="0|1") == (
        'x{rank=~"0|1", run_id="r"}[1m]'
    )
    with pytest.raises(ValueError, match=r"\$node"):
        substitute('x{node="$node"}', run="r")


def test_every_panel_and_annotation_query_is_valid_promql(boards, tmp_path):
    # promtool parses each expression as a recording rule; a syntax error names the rule.
    exprs = [substitute(e, run="r", rank=".*", rate_interval="1m") for b in boards for e in _all_exprs(b)]
    records = [{"record": f"dashboard:query:{i}", "expr": expr} for i, expr in enumerate(exprs)]
    rules = {"groups": [{"name": "dashboards", "rules": records}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- thresholds and text come from the rules' Tunables ------------------------------------------------
# rankscope.mixin.config.Tunables is the one source of every alert threshold and `for`; the
# dashboards draw the alerts' lines and quote them from it. These panels show an alert's numbers:
# (tunables drawn as threshold lines, tunables quoted in the description).
PANEL_TUNABLES = {
    "Gradient norm": (
        ("grad_norm_vanishing", "grad_norm_explosion"),
        ("grad_norm_explosion", "grad_explosion_for", "grad_norm_vanishing", "grad_vanishing_for"),
    ),
    "Imbalance (slowest / median rank compute time)": (
        ("imbalance_ratio",),
        ("imbalance_ratio", "imbalance_for", "imbalance_severity"),
    ),
    "Communication and data-wait share": (("comm_share",), ("comm_share", "comm_for")),
    "Loss rate of change": (
        (),
        ("loss_change_window", "loss_plateau_improvement", "loss_plateau_for", "loss_plateau_severity"),
    ),
    "Host memory used": (("host_memory_ratio",), ("host_memory_ratio", "host_memory_for")),
    "Straggler": (("imbalance_ratio",), ("imbalance_ratio", "imbalance_for", "imbalance_severity")),
    "Compute time over median, per rank": (("imbalance_ratio",), ()),
    "Data wait per rank (p90)": (("data_wait_p90_seconds",), ("data_wait_p90_seconds", "data_loader_for")),
    "Data-wait share per rank": (("data_wait_share",), ("data_wait_share", "data_loader_for")),
    "Goodput": (("goodput_ratio",), ("goodput_ratio", "goodput_window", "goodput_for")),
    "Time in the current phase per rank": (
        ("hang_floor_seconds",),
        ("hang_floor_seconds", "hang_step_multiple", "hang_severity"),
    ),
}


def _quoted(name: str, value: object) -> str:
    """A tunable as the dashboards (and the alerts' descriptions) write it."""
    if isinstance(value, str):
        return value
    if name.endswith(("_ratio", "_share", "_improvement")) and 0 < value < 1:
        return f"{value:.0%}"
    return promql.num(value)


def dashboard_drift(boards: list[dict], t) -> list[str]:  # noqa: ANN001 - the generator's Tunables
    """Where the dashboards' alert lines and quoted numbers differ from `t`."""
    problems = []
    seen = set()
    for board in boards:
        for panel in _panels(board):
            title = panel["title"]
            steps = (panel["fieldConfig"]["defaults"].get("thresholds") or {}).get("steps") or []
            lines = sorted(step["value"] for step in steps if step.get("value") is not None)
            if title not in PANEL_TUNABLES:
                if lines:
                    problems.append(f"{title}: threshold lines {lines} that no tunable accounts for")
                continue
            seen.add(title)
            drawn, quoted = PANEL_TUNABLES[title]
            want = sorted(getattr(t, name) for name in drawn)
            if lines != want:
                problems.append(f"{title}: threshold lines {lines}, Tunables has {want} ({', '.join(drawn)})")
            for name in quoted:
                text = _quoted(name, getattr(t, name))
                if not re.search(rf"(?<![\w.]){re.escape(text)}(?![\w%])", panel.get("description", "")):
                    problems.append(f"{title}: the description does not say {text} ({name})")
    problems += [f"{title}: no such panel" for title in sorted(set(PANEL_TUNABLES) - seen)]
    return problems


def test_the_dashboards_draw_and_quote_the_alerts_tunables(boards):
    assert dashboard_drift(boards, Tunables()) == []


def test_the_dashboard_check_catches_a_threshold_that_drifted(boards):
    # A copy of the committed dashboards with the host-memory line moved by hand.
    edited = copy.deepcopy(boards)
    (panel,) = [p for b in edited for p in _panels(b) if p["title"] == "Host memory used"]
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [step["value"] for step in steps] == [None, 0.85]
    steps[1]["value"] = 0.8
    panel["description"] = panel["description"].replace("85%", "80%")
    assert dashboard_drift(edited, Tunables()) == [
        "Host memory used: threshold lines [0.8], Tunables has [0.85] (host_memory_ratio)",
        "Host memory used: the description does not say 85% (host_memory_ratio)",
    ]


def test_a_changed_tunable_reaches_the_generated_dashboards():
    changed_t = replace(Tunables(), host_memory_ratio=0.8, imbalance_ratio=1.3)
    boards = [json.loads(text) for name, text in generate.render(changed_t).items() if name != "model-and-data.json"]
    (memory,) = [p for b in boards for p in _panels(b) if p["title"] == "Host memory used"]
    assert memory["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == 0.8
    assert "above 80% for 1m" in memory["description"]
    changed = dashboard_drift(boards, Tunables())
    assert {problem.split(":")[0] for problem in changed} >= {
        "Host memory used",
        "Straggler",
        "Imbalance (slowest / median rank compute time)",
    }


def test_panels_read_the_series_the_rules_record_by_the_generators_names(boards):
    rules = promql
    exprs = {t["expr"] for b in boards for p in _panels(b) for t in p["targets"]}
    for series in (
        rules.STRAGGLER,
        rules.IMBALANCE,
        rules.COMM_SHARE,
        rules.SAMPLES_RATE,
        rules.LOSS_CHANGE,
        *rules.STEP_QUANTILES.values(),
    ):
        assert any(series in expr for expr in exprs), series
