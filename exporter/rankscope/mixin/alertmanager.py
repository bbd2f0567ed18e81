"""alertmanager/alertmanager.yml: the routes from the config (alerts that ask for an action go to the trainer,
then each severity to its receiver) and its inhibitions; the receivers are the deployment's own and written
out as they ship (webhook addresses of the compose stack, commented examples for PagerDuty and Slack)."""

from __future__ import annotations

from typing import Any

from rankscope.mixin import _yaml
from rankscope.mixin.config import ACTIONS as _ACTIONS
from rankscope.mixin.config import CONTROL_ROUTE, INHIBITIONS, SEVERITY_ROUTES, Severity, Tunables

FILE = "alertmanager.yml"

_INTRO = """\
# Alertmanager configuration for rankscope (checked by `amtool check-config`; routes are tested
# in tests/test_alertmanager_config.py with `amtool config routes test`).
#
# Where alerts go (see docs/runbook.md for what each alert means):
#   - an alert with an `action` label  -> the trainer's control endpoint (rank 0), which applies
#                                         the action on every rank at the same step;
{severities}# `continue: true` on the trainer route lets one alert both act and page; it acts at once (resends are
# harmless: the trainer applies each alert once per (fingerprint, startsAt)). The routes and inhibitions are
# generated from rankscope/mixin/config.py (SEVERITY_ROUTES, CONTROL_ROUTE, INHIBITIONS); the receivers below
# are written out as they ship.
#
# Addresses are the docker compose service names (trainer:9300, pager:9095). Outside compose,
# replace them (the no-Docker stack launcher does: trainer -> 127.0.0.1).

global:
  resolve_timeout: 5m

"""

_RECEIVERS = """\
receivers:
  - name: "null"

  - name: trainer-control
    webhook_configs:
      - url: http://trainer:9300/v1/alerts
        # The trainer acts on firing alerts only; resolved notifications would be ignored.
        send_resolved: false
        http_config:
          authorization:
            type: Bearer
            # Relative to this file. Create it from secrets/control-token.example (see
            # alertmanager/README.md); the trainer reads the same token (control.token_file).
            credentials_file: secrets/control-token

  - name: pager
    webhook_configs:
      # A generic webhook (Alertmanager's JSON payload, version 4). Replace with your paging
      # system, or use one of the integrations below instead.
      - url: http://pager:9095/alerts
        send_resolved: true
    # pagerduty_configs:
    #   - routing_key_file: /etc/alertmanager/secrets/pagerduty-routing-key
    #     severity: critical
    #     description: '{{ .CommonAnnotations.summary }}'
    #     links:
    #       - href: '{{ (index .Alerts 0).Annotations.runbook_url }}'
    #         text: runbook
    # slack_configs:
    #   - api_url_file: /etc/alertmanager/secrets/slack-webhook-url
    #     channel: '#training-oncall'
    #     send_resolved: true
    #     title: '{{ .CommonLabels.alertname }} - run {{ .CommonLabels.run_id }}'
    #     text: '{{ range .Alerts }}{{ .Annotations.description }} <{{ .Annotations.runbook_url }}|runbook>{{ "\\n" }}{{ end }}'

  - name: tickets
    # Notifies no one until wired to your ticket queue, for example:
    # slack_configs:
    #   - api_url_file: /etc/alertmanager/secrets/slack-webhook-url
    #     channel: '#training-tickets'
    #     send_resolved: true
    #     text: '{{ range .Alerts }}{{ .Annotations.description }}{{ "\\n" }}{{ end }}'
"""  # noqa: E501 - the Slack example's line, as it is written in the file


def _timings(severity: Severity) -> dict[str, str]:
    return {
        "group_wait": severity.group_wait,
        "group_interval": severity.group_interval,
        "repeat_interval": severity.repeat_interval,
    }


def route() -> dict[str, Any]:
    """The routing tree: the trainer for alerts with an `action` the catalog declares, then each severity."""
    page = SEVERITY_ROUTES["page"]
    routes: list[dict[str, Any]] = [
        {
            "receiver": CONTROL_ROUTE.receiver,
            "matchers": [f'action=~"{"|".join(_ACTIONS)}"'],
            **_timings(CONTROL_ROUTE),
            "continue": True,
        }
    ]
    routes += [
        {"receiver": severity.receiver, "matchers": [f'severity="{name}"'], **_timings(severity)}
        for name, severity in SEVERITY_ROUTES.items()
        if severity.receiver != "null"
    ]
    # One notification per run and alert name: a straggler page names its rank in the alert labels, and
    # eight ranks with full memory still make one message.
    return {"receiver": "null", "group_by": ["run_id", "alertname"], **_timings(page), "routes": routes}


def inhibit_rules() -> list[dict[str, Any]]:
    return [
        {
            "source_matchers": [f'alertname="{source}"'],
            "target_matchers": [f'alertname=~"{"|".join(targets)}"'],
            "equal": ["run_id"],
        }
        for source, targets in INHIBITIONS
    ]


def render(t: Tunables) -> dict[str, str]:
    """File name -> text of the Alertmanager configuration."""
    del t  # the routes follow the severities and actions, not the thresholds
    lines = ""
    for name, severity in SEVERITY_ROUTES.items():
        lines += f'#   - severity="{name}"{" " * (22 - len(name))}-> {severity.routed_to};\n'
    lines = lines.rstrip(";\n") + ".\n"
    intro = _INTRO.format(severities=lines)
    body = _yaml.dump({"route": route()}) + "\n" + _yaml.dump({"inhibit_rules": inhibit_rules()}) + "\n"
    return {FILE: _yaml.HEADER + intro + body + _RECEIVERS}
