"""Grafana dashboards and provisioning for rankscope.

``python -m grafana.generate`` writes ``grafana/dashboards/*.json`` from the
Python definitions in :mod:`grafana.generate`; :mod:`grafana.queries` reads
those files back to list every panel query (the end-to-end test runs each one
against a live Prometheus).
"""
