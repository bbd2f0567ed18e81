"""Grafana dashboards generated with the Grafana Foundation SDK (the `mixin` extra)."""
