"""The rule pack, shaped like a monitoring mixin: one config, and from it the recording and alert rules by
area, the Grafana dashboards, the Alertmanager routes and the Kubernetes resources (``rankscope-mixin``).

Modules:

- :mod:`~rankscope.mixin.config`: the one config: every Tunable (thresholds, windows, ``for``s, severities,
  the runbook URL pattern), where each severity is routed, and which alert asks for which control action.
- :mod:`~rankscope.mixin.promql`: shared PromQL helpers and the names of every recorded series.
- :mod:`~rankscope.mixin.rules`: one module per area (``rules/<area>.py``), each one rule group
  ``rankscope.<area>`` written to ``prometheus/rules/<area>.yml`` and tested by
  ``prometheus/tests/<area>_test.yml``.
- :mod:`~rankscope.mixin.dashboards`: the dashboards (grafana-foundation-sdk, the ``mixin`` extra).
- :mod:`~rankscope.mixin.alertmanager`: ``alertmanager/alertmanager.yml``'s routes and inhibitions.
- :mod:`~rankscope.mixin.kubernetes`: the ``PrometheusRule`` and the dashboards' ConfigMaps.
- :mod:`~rankscope.mixin.cli`: the ``rankscope-mixin`` command (``--set``, ``--out``, ``--check``,
  ``--kubernetes``); the repository's committed files are its default output, checked byte for byte.

Adding an area (say ``hangs``) is one new file, ``rules/hangs.py``, defining
``records(t) -> list[dict]`` (recording rules, in dependency order; ``[]`` for none) and
``alerts(t) -> list[Alert]`` (``from rankscope.mixin.rules import Alert``). The area is found by listing
the package, its group is ordered after the groups whose series it reads, and ``rankscope-mixin`` writes
``prometheus/rules/hangs.yml`` (Prometheus loads ``rules/*.yml``). Then add its Tunables to
``config.Tunables`` (and, if it asks for an action, an entry in ``config.ACTION_TUNABLES``), its promtool
tests as ``prometheus/tests/hangs_test.yml`` (``rule_files: [../rules/*.yml]``, ``group_eval_order``
listing the groups in the order the generator gives them), a runbook section per alert in
``docs/runbook.md`` and a row in prometheus/README.md's alert table; tests/test_prometheus_rules.py checks
each of those.
"""
