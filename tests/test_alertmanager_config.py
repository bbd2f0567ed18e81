"""alertmanager/alertmanager.yml: validity, routes for every alert, and delivery by a real server.

Routes are checked with the real `amtool`; delivery and inhibition with the real Alertmanager
(Debian package `prometheus-alertmanager`, installed by scripts/bootstrap.sh) running this file
with only its webhook addresses pointed at a local sink. Missing binaries fail, they do not skip.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest
import requests
import yaml

from tests.support import WebhookSink, binary, running_alertmanager

REPO = Path(__file__).resolve().parent.parent
AM_DIR = REPO / "alertmanager"
CONFIG = AM_DIR / "alertmanager.yml"
ALERT_RULES = [
    rule
    for path in sorted((REPO / "prometheus" / "rules").glob("*.yml"))
    for group in yaml.safe_load(path.read_text())["groups"]
    for rule in group["rules"]
    if "alert" in rule  # each area's group also records the series its alerts read
]

#: Where each alert must go, in route order. Written out by hand (not derived from the config)
#: so that a routing change has to be made here too, on purpose.
EXPECTED_RECEIVERS = {
    "RankscopeHostMemoryHigh": "trainer-control,tickets",
    "RankscopeDeviceMemoryHigh": "trainer-control,tickets",
    "RankscopeLossDiverging": "trainer-control,tickets",
    "RankscopeLossPlateau": "tickets",
    "RankscopeValLossPlateau": "tickets",
    "RankscopeNonFiniteSteps": "trainer-control,pager",
    "RankscopeLossScaleCollapse": "tickets",
    "RankscopeCheckpointFailing": "pager",
    "RankscopeGradientExplosion": "tickets",
    "RankscopeGradientVanishing": "tickets",
    "RankscopeRankImbalance": "pager",
    "RankscopeDataLoaderBottleneck": "tickets",
    "RankscopeCommOverheadHigh": "tickets",
    "RankscopeSlowSteps": "tickets",
    "RankscopeRankHung": "trainer-control,pager",
    "RankscopeRunStalled": "pager",
    "RankscopeRankDown": "pager",
    "RankscopeRankVanished": "tickets",
    "RankscopeRunPaused": "null",
    "RankscopeGoodputLow": "tickets",
}


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("amtool"), *args], capture_output=True, text=True, timeout=60)


def routes_test(labels: dict[str, str], expected: str, config: Path = CONFIG) -> subprocess.CompletedProcess[str]:
    pairs = [f"{k}={v}" for k, v in labels.items()]
    return amtool("config", "routes", "test", f"--config.file={config}", f"--verify.receivers={expected}", *pairs)


# --- static checks --------------------------------------------------------------------------


def test_amtool_accepts_the_configuration():
    result = amtool("check-config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_commented_pagerduty_and_slack_examples_are_valid_when_uncommented(tmp_path):
    lines, out, prefix = CONFIG.read_text().splitlines(), [], None
    for line in lines:
        start = re.match(r"^(\s*)# (pagerduty_configs|slack_configs):", line)
        if start:
            prefix = start.group(1) + "# "
        if prefix and line.startswith(prefix) and (start or line.startswith(prefix + " ")):
            out.append(line.replace("# ", "", 1))
            continue
        prefix = None
        out.append(line)
    uncommented = tmp_path / "alertmanager.yml"
    uncommented.write_text("\n".join(out) + "\n")
    receivers = {r["name"]: r for r in yaml.safe_load(uncommented.read_text())["receivers"]}
    assert {"pagerduty_configs", "slack_configs"} <= set(receivers["pager"])
    assert "slack_configs" in receivers["tickets"]
    result = amtool("check-config", str(uncommented))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_routing_table_covers_every_alert_rule():
    assert set(EXPECTED_RECEIVERS) == {rule["alert"] for rule in ALERT_RULES}


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r["alert"])
def test_each_alert_reaches_exactly_the_receivers_its_labels_call_for(rule):
    labels = {"alertname": rule["alert"], "run_id": "demo", **rule["labels"]}
    result = routes_test(labels, EXPECTED_RECEIVERS[rule["alert"]])
    assert result.returncode == 0, f"{labels} went to {result.stdout.strip()!r}: {result.stderr}"


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"alertname": "Operator", "action": "stop", "severity": "info"}, "trainer-control"),
        ({"alertname": "Operator", "action": "pause", "severity": "page"}, "trainer-control,pager"),
        ({"alertname": "Typo", "action": "explode", "severity": "info"}, "null"),
        # The recovery actions the rules can be generated with (prometheus/README.md), at either severity.
        (
            {"alertname": "RankscopeLossDiverging", "action": "rollback", "severity": "ticket"},
            "trainer-control,tickets",
        ),
        ({"alertname": "RankscopeNonFiniteSteps", "action": "rollback", "severity": "page"}, "trainer-control,pager"),
        (
            {"alertname": "RankscopeDeviceMemoryHigh", "action": "reduce_micro_batch", "severity": "ticket"},
            "trainer-control,tickets",
        ),
        (
            {"alertname": "RankscopeSlowSteps", "action": "reduce_micro_batch", "severity": "page"},
            "trainer-control,pager",
        ),
        ({"alertname": "SomethingElse"}, "null"),
    ],
)
def test_only_known_actions_reach_the_trainer_and_unlabelled_alerts_notify_no_one(labels, expected):
    result = routes_test(labels, expected)
    assert result.returncode == 0, f"{labels} went to {result.stdout.strip()!r}"


def test_a_wrong_expectation_makes_the_route_test_fail():
    # The route test must be able to fail, or the cases above prove nothing.
    result = routes_test({"alertname": "RankscopeRankDown", "severity": "page"}, "trainer-control")
    assert result.returncode != 0


def test_alerts_are_grouped_by_run_and_name_and_the_trainer_gets_firing_alerts_with_a_token_file():
    config = yaml.safe_load(CONFIG.read_text())
    assert config["route"]["group_by"] == ["run_id", "alertname"]
    trainer_route = config["route"]["routes"][0]
    assert trainer_route["receiver"] == "trainer-control" and trainer_route["continue"] is True
    (hook,) = {r["name"]: r for r in config["receivers"]}["trainer-control"]["webhook_configs"]
    assert hook["url"].endswith("/v1/alerts") and hook["send_resolved"] is False
    token_file = hook["http_config"]["authorization"]["credentials_file"]
    assert (AM_DIR / f"{token_file}.example").is_file(), "ship an example next to the token file the config names"


# --- a real Alertmanager ----------------------------------------------------------------------


@dataclass
class RunningAlertmanager:
    url: str
    token: str
    sink: WebhookSink

    def post(self, *alerts: dict[str, str]) -> None:
        now = datetime.now(timezone.utc).isoformat()
        body = [{"labels": labels, "annotations": {"summary": "test"}, "startsAt": now} for labels in alerts]
        requests.post(f"{self.url}/api/v2/alerts", json=body, timeout=5).raise_for_status()

    def resolve(self, labels: dict[str, str]) -> None:
        """As Prometheus says an alert resolved: the same labels, ending now."""
        now = datetime.now(timezone.utc).isoformat()
        body = [{"labels": labels, "annotations": {"summary": "test"}, "endsAt": now}]
        requests.post(f"{self.url}/api/v2/alerts", json=body, timeout=5).raise_for_status()


@pytest.fixture
def alertmanager(tmp_path: Path, free_port: Callable[[], int]) -> Iterator[RunningAlertmanager]:
    """The repo's alertmanager.yml served by a real Alertmanager. Only the webhook addresses
    change (to a local sink); the routes' timings are the shipped ones."""
    sink = WebhookSink()
    config = yaml.safe_load(CONFIG.read_text())
    receivers = {r["name"]: r for r in config["receivers"]}
    receivers["trainer-control"]["webhook_configs"][0]["url"] = f"{sink.url}/v1/alerts"
    receivers["pager"]["webhook_configs"][0]["url"] = f"{sink.url}/pager"
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    token = secrets.token_urlsafe(24)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "control-token").write_text(token + "\n")  # surrounding whitespace is ignored
    try:
        with running_alertmanager(tmp_path / "alertmanager.yml", tmp_path, free_port()) as url:
            yield RunningAlertmanager(url, token, sink)
    finally:
        sink.close()


@pytest.mark.integration
def test_a_real_alertmanager_sends_an_action_alert_to_the_trainer_with_the_token_and_pages(alertmanager):
    labels = {"alertname": "RankscopeNonFiniteSteps", "run_id": "demo", "severity": "page", "action": "reduce_lr"}
    alertmanager.post(labels)
    to_trainer = alertmanager.sink.wait_for(lambda d: d.path == "/v1/alerts", timeout=20)
    assert to_trainer.authorization == f"Bearer {alertmanager.token}"
    assert to_trainer.body["version"] == "4" and to_trainer.body["status"] == "firing"
    (alert,) = to_trainer.body["alerts"]
    assert alert["status"] == "firing" and alert["labels"] == labels
    to_pager = alertmanager.sink.wait_for(lambda d: d.path == "/pager", timeout=20)
    assert to_pager.body["groupLabels"] == {"alertname": "RankscopeNonFiniteSteps", "run_id": "demo"}
    assert to_pager.authorization == ""  # the trainer's token goes to the trainer only


@pytest.mark.integration
def test_a_dead_rank_silences_stalled_and_imbalance_pages_of_its_own_run_only(alertmanager):
    page = {"severity": "page"}
    alertmanager.post(
        {"alertname": "RankscopeRankDown", "run_id": "r1", "rank": "1", **page},
        {"alertname": "RankscopeRunStalled", "run_id": "r1", **page},
        {"alertname": "RankscopeRankImbalance", "run_id": "r1", "rank": "0", **page},
        {"alertname": "RankscopeRunStalled", "run_id": "r2", **page},
    )
    deadline = time.monotonic() + 20
    while True:
        alerts = requests.get(f"{alertmanager.url}/api/v2/alerts", timeout=5).json()
        inhibited = {(a["labels"]["alertname"], a["labels"]["run_id"]) for a in alerts if a["status"]["inhibitedBy"]}
        if len(alerts) == 4 and len(inhibited) >= 2:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"alerts never settled: {json.dumps(alerts, indent=1)}")
        time.sleep(0.1)  # poll interval, not synchronisation
    assert inhibited == {("RankscopeRunStalled", "r1"), ("RankscopeRankImbalance", "r1")}
    # The page for the cause still goes out; the silenced ones never reach the pager.
    delivered = alertmanager.sink.wait_for(
        lambda d: d.path == "/pager" and d.body["groupLabels"]["alertname"] == "RankscopeRankDown", timeout=20
    )
    assert delivered.body["groupLabels"]["run_id"] == "r1"
    stalled_r2 = alertmanager.sink.wait_for(
        lambda d: d.path == "/pager" and d.body["groupLabels"] == {"alertname": "RankscopeRunStalled", "run_id": "r2"},
        timeout=20,
    )
    assert stalled_r2.body["status"] == "firing"
    paged = {
        (d.body["groupLabels"]["alertname"], d.body["groupLabels"]["run_id"]) for d in alertmanager.sink.deliveries
    }
    assert not paged & inhibited


def test_a_page_goes_out_before_the_next_evaluation_could_resolve_it_and_its_resolution_follows():
    # Prometheus sends a resolution one evaluation after the firing at the earliest: a page route waiting
    # longer than that never pages for an alert the trainer's action fixed at once.
    evaluation = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())["global"]["evaluation_interval"]
    page = next(r for r in yaml.safe_load(CONFIG.read_text())["route"]["routes"] if r["receiver"] == "pager")
    assert _seconds(page["group_wait"]) < _seconds(evaluation), (page, evaluation)
    (hook,) = {r["name"]: r for r in yaml.safe_load(CONFIG.read_text())["receivers"]}["pager"]["webhook_configs"]
    assert hook["send_resolved"] is True


def _seconds(duration: str) -> float:
    return sum(
        float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration)
    )


@pytest.mark.integration
def test_an_incident_the_loop_fixed_within_30s_still_pages_and_then_says_it_resolved(alertmanager):
    # A hang the trainer's restart fixed: the alert resolves seconds after it fired, well within the 30 s
    # the page route used to wait. The pager gets the page at once, then the resolved notice.
    labels = {"alertname": "RankscopeRankHung", "run_id": "demo", "severity": "page", "action": "restart"}
    alertmanager.post(labels)
    alertmanager.sink.wait_for(lambda d: d.path == "/v1/alerts", timeout=20)  # the trainer acts
    fired = alertmanager.sink.wait_for(lambda d: d.path == "/pager", timeout=20)
    assert fired.body["status"] == "firing"
    assert fired.body["groupLabels"] == {"alertname": "RankscopeRankHung", "run_id": "demo"}
    alertmanager.resolve(labels)
    resolved = alertmanager.sink.wait_for(lambda d: d.path == "/pager" and d.body["status"] == "resolved", timeout=90)
    (alert,) = resolved.body["alerts"]
    assert alert["status"] == "resolved" and alert["labels"] == labels
    pages = [d.body["status"] for d in alertmanager.sink.deliveries if d.path == "/pager"]
    assert pages == ["firing", "resolved"]
