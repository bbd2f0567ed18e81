"""The rule pack for the Prometheus Operator (kube-prometheus): the rule groups as one ``PrometheusRule`` and
each dashboard as a ConfigMap labelled ``grafana_dashboard: "1"``, which Grafana's dashboard sidecar loads.

No namespace is set: apply them where your Prometheus selects rules (kube-prometheus: ``monitoring``;
``kubectl apply -n monitoring -f kubernetes/``). The labels ``prometheus: k8s`` and ``role: alert-rules``
match kube-prometheus's default ``ruleSelector``.
"""

from __future__ import annotations

from typing import Any

from rankscope.mixin import _yaml

PROMETHEUS_RULE = "prometheusrule.yaml"
DASHBOARD_CONFIGMAPS = "grafana-dashboards.yaml"
_LABELS = {"app.kubernetes.io/name": "rankscope", "app.kubernetes.io/component": "monitoring"}


def prometheus_rule(groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "rankscope", "labels": {**_LABELS, "prometheus": "k8s", "role": "alert-rules"}},
        "spec": {"groups": groups},
    }


def dashboard_configmap(file_name: str, text: str) -> dict[str, Any]:
    name = "rankscope-dashboard-" + file_name.removesuffix(".json")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {**_LABELS, "grafana_dashboard": "1"}},
        "data": {file_name: text},
    }


def render(groups: list[dict[str, Any]], dashboards: dict[str, str]) -> dict[str, str]:
    """File name -> text: the PrometheusRule and the dashboards' ConfigMaps (one YAML document each)."""
    found = {PROMETHEUS_RULE: _yaml.HEADER + _yaml.dump(prometheus_rule(groups))}
    if dashboards:  # none without the Grafana SDK (the mixin extra)
        maps = [_yaml.dump(dashboard_configmap(name, text)) for name, text in dashboards.items()]
        found[DASHBOARD_CONFIGMAPS] = _yaml.HEADER + "---\n".join(maps)
    return found
