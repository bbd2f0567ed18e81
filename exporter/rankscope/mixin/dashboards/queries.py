"""Every panel query of the committed dashboards, ready to send to Prometheus.

Grafana cannot run where the tests run, so the end-to-end test executes each
panel's PromQL itself. This module reads the dashboard JSON (exactly what a
Grafana instance would import), fills in the template variables the way
Grafana would for one run and one rank, and says which panels can only have
data on a GPU run.

    from rankscope.mixin.dashboards.queries import panel_queries
    for q in panel_queries(run="demo", rank="0", rate_interval="20s"):
        if q.requires_gpu and not on_gpu:
            continue
        ...  # GET /api/v1/query_range?query=q.expr ...

Only the standard library is used, so the e2e test needs nothing extra.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DASHBOARDS_DIR",
    "REQUIRES_GPU_TAG",
    "PanelQuery",
    "dashboards",
    "metric_names",
    "panel_queries",
    "substitute",
]

#: Where the generated dashboards are committed.
DASHBOARDS_DIR = Path("grafana") / "dashboards"  # the repository's, from its root

#: Panel tag marking a panel whose metrics only exist on a GPU (NVML or device
#: memory probes): such a panel legitimately shows "No data" on a CPU run.
REQUIRES_GPU_TAG = "requires:gpu"


@dataclass(frozen=True)
class PanelQuery:
    """One query target of one panel, with its variables filled in."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str
    requires_gpu: bool


def dashboards(directory: Path = DASHBOARDS_DIR) -> list[dict]:
    """The dashboard JSON models in `directory`, sorted by file name."""
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]


def substitute(expr: str, *, run: str, rank: str = ".*", rate_interval: str = "1m") -> str:
    """Fill in Grafana's variables as Grafana would for a single run and rank selection.

    `rank` is used inside ``rank=~"$rank"`` matchers, so a regex such as ``.*``
    (Grafana's "All") or ``0|1`` works as well as a single rank.
    """
    values = {"run": run, "rank": rank, "__rate_interval": rate_interval}

    def fill(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"unknown dashboard variable ${name} in query {expr!r}")
        return values[name]

    # Grafana accepts both $name and ${name}.
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", fill, expr)


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        if panel.get("type") == "row":
            # A collapsed row keeps its panels inside it.
            yield from _panels(panel.get("panels") or [])
        else:
            yield panel


def panel_queries(
    *, run: str, rank: str = ".*", rate_interval: str = "1m", directory: Path = DASHBOARDS_DIR
) -> list[PanelQuery]:
    """Every (dashboard, panel, target) in `directory` with its expression ready to run."""
    found = []
    for board in dashboards(directory):
        for panel in _panels(board.get("panels") or []):
            requires_gpu = REQUIRES_GPU_TAG in (panel.get("tags") or [])
            for target in panel.get("targets") or []:
                expr = substitute(target["expr"], run=run, rank=rank, rate_interval=rate_interval)
                found.append(PanelQuery(board["title"], panel["title"], target.get("refId", ""), expr, requires_gpu))
    return found


#: PromQL words that look like metric names but are functions, aggregations or keywords.
_PROMQL_WORDS_TEXT = """
abs absent absent_over_time avg avg_over_time bool bottomk ceil changes clamp clamp_max clamp_min count
count_over_time count_values day_of_month day_of_week delta deriv exp floor group group_left group_right
histogram_quantile holt_winters hour idelta increase irate label_join label_replace last_over_time ln log10 log2
max max_over_time min min_over_time minute month offset predict_linear present_over_time quantile
quantile_over_time rate resets round scalar sgn sort sort_desc sqrt stddev stddev_over_time stdvar
stdvar_over_time sum sum_over_time time timestamp topk vector year and or unless inf nan
"""
_PROMQL_WORDS = frozenset(_PROMQL_WORDS_TEXT.split())


def metric_names(expr: str) -> set[str]:
    """The metric (series) names a PromQL expression reads.

    Good enough for the expressions we write: it drops string literals, label
    matchers, range/offset durations, grouping label lists and function names,
    and keeps the identifiers left over.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors and subqueries
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"\boffset\s+\S+", "", text)
    words = re.findall(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", text)
    return {word for word in words if word not in _PROMQL_WORDS}
