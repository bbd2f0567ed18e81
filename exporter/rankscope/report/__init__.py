"""rankscope-report: one self-contained HTML page (and a PNG summary) that shows what happened in a run.

    rankscope-report --prometheus http://127.0.0.1:9090 --log .stack/log.jsonl --out report.html

Built from Prometheus's HTTP API (any Prometheus-compatible store that holds the
run, selected by its ``run_id`` label) and, when given, the trainer's JSONL run
log and the attention maps it saved. One module per job:

- :mod:`.prom` - the HTTP API client (instant and range queries, one-line errors);
- :mod:`.run` - which run, over which time window, at which resolution;
- :mod:`.collect` - every query the report asks, in one place, as :class:`.series.Series`;
- :mod:`.runlog` and :mod:`.attention` - the trainer's run log and attention maps;
- :mod:`.analysis` - the analyses (loss rate of change, LR-loss correlation, stragglers);
- :mod:`.incidents` - alerts, the control actions they caused, fault-to-action times;
- :mod:`.plots` - every figure (matplotlib, Agg backend);
- :mod:`.html` - the page; :mod:`.build` puts it together; :mod:`.cli` is the command.

This package is not imported by ``import exporter``: matplotlib is a dependency of
the ``report`` extra (``pip install 'rankscope[report]'``) and is imported here only.
Importing this package itself imports nothing heavy, so a missing matplotlib is
reported by the command in one line.
"""

from __future__ import annotations

__all__: list[str] = []
