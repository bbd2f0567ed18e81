"""Building blocks for rankscope's dashboards, on top of grafana-foundation-sdk.

Every panel made here queries the one provisioned Prometheus datasource, has a
unit, and gets its query refIds and ids assigned the same way every time, so
the generated JSON is stable and a test can compare it byte for byte.

PromQL is written with :func:`m`, which looks each name up in the metric
contract: a metric that is renamed or removed there fails the generator
instead of leaving an empty panel behind.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import heatmap as heatmap_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as timeline_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prom_m
from rankscope_trainer.metrics import TRAINER_METRICS

from rankscope.contract import PREFIX, metric
from rankscope.mixin.dashboards.queries import REQUIRES_GPU_TAG, metric_names
from rankscope.mixin.promql import MFU, PEAK_FLOPS

__all__ = [
    "DATASOURCE",
    "DATASOURCE_UID",
    "FIRING_ALERTS",
    "GPU_ONLY_METRICS",
    "RANK_SEL",
    "RATE",
    "RUN_SEL",
    "Target",
    "alert_annotation",
    "control_action_annotation",
    "dashboard",
    "heatmap",
    "m",
    "needs_gpu",
    "quantile",
    "rank_variable",
    "run_variable",
    "stat",
    "state_timeline",
    "timeseries",
    "to_json",
]

#: Fixed so that provisioned dashboards find the provisioned datasource.
DATASOURCE_UID = "rankscope-prometheus"
DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)

#: Metrics that only exist on a GPU (NVML and device-memory probes, each step's peak; the devices' peak
#: FLOP/s, known from the table of GPUs unless configured, and the MFU recorded from it). A panel
#: reading any of them is tagged ``requires:gpu`` automatically.
GPU_ONLY_METRICS = frozenset(
    metric(name).name
    for name in (
        "device_memory_bytes",
        "step_peak_device_memory_bytes",
        "gpu_utilization_ratio",
        "gpu_power_watts",
        "gpu_temperature_celsius",
        "peak_flops_per_second",
    )
) | {MFU, PEAK_FLOPS}

#: Label matchers for "this run" and "this run, the selected ranks".
RUN_SEL = 'run_id="$run"'
RANK_SEL = 'run_id="$run", rank=~"$rank"'

#: Firing alerts of this run; run_id=~"$run|" also keeps alerts that carry no
#: run_id (an alert on `up` of a static scrape target has none).
FIRING_ALERTS = 'ALERTS{alertstate="firing", run_id=~"$run|"}'

#: Grafana's rate window: at least four scrape intervals (the datasource's timeInterval).
RATE = "$__rate_interval"


#: The reference trainer's own metrics (its "Model and data" panels), declared beside the contract.
_TRAINER = {spec.name: spec for spec in TRAINER_METRICS}


def m(name: str, series: str = "") -> str:
    """A contract (or reference-trainer) metric's exposed name; `series` picks ``bucket``/``sum``/``count`` of
    a histogram (``sum``/``count`` of a summary)."""
    full = name if name.startswith(PREFIX) else PREFIX + name
    spec = _TRAINER.get(full) or metric(name)
    return spec.series(series) if series else spec.name


def quantile(q: float, name: str, by: str = "", sel: str = RANK_SEL) -> str:
    """``histogram_quantile`` of a contract histogram over Grafana's rate window."""
    keys = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({keys}) (rate({m(name, 'bucket')}{{{sel}}}[{RATE}])))"


class Target:
    """One PromQL query of a panel, with the legend Grafana draws for it."""

    def __init__(self, expr: str, legend: str = "", *, fmt: str = "") -> None:
        self.expr, self.legend, self.fmt = expr, legend, fmt

    def build(self, ref_id: str) -> prom_b.Dataquery:
        query = prom_b.Dataquery().expr(self.expr).ref_id(ref_id).datasource(DATASOURCE)
        if self.legend:
            query = query.legend_format(self.legend)
        if self.fmt:  # e.g. "heatmap": Grafana then reads the series as histogram buckets
            query = query.format(prom_m.PromQueryFormat(self.fmt))
        return query


def needs_gpu(expr: str) -> bool:
    """Whether `expr` reads a metric that only a GPU run exposes."""
    return bool(GPU_ONLY_METRICS & metric_names(expr))


#: An alert's line (red above it), or a (low, high) pair: red below low and above high.
Threshold = float | tuple[float, float]


def _thresholds(threshold: Threshold) -> dash_b.ThresholdsConfig:
    """Grafana's threshold steps for an alert's line; the first step's value null is Grafana's -Infinity."""
    if isinstance(threshold, tuple):
        low, high = threshold
        steps = [dash_m.Threshold(value=None, color="red"), dash_m.Threshold(value=low, color="green"),
                 dash_m.Threshold(value=high, color="red")]  # fmt: skip
    else:
        steps = [dash_m.Threshold(value=None, color="green"), dash_m.Threshold(value=threshold, color="red")]
    return dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE).steps(steps)


def _common(panel: Any, title: str, unit: str, targets: Sequence[Target], description: str, w: int, h: int):
    """Title, unit, datasource, size and targets: what every panel here shares."""
    if not unit:
        raise ValueError(f"panel {title!r} needs a unit")
    gpu = any(needs_gpu(target.expr) for target in targets)
    if gpu:
        description = (description + " " if description else "") + "Needs a GPU: empty on CPU runs."
    panel = panel.title(title).unit(unit).datasource(DATASOURCE).span(w).height(h)
    if description:
        panel = panel.description(description)
    for ref_id, target in zip(string.ascii_uppercase, targets, strict=False):
        panel = panel.with_target(target.build(ref_id))
    return _Tagged(panel, [REQUIRES_GPU_TAG] if gpu else [])


class _Tagged(Builder[dash_m.Panel]):
    """Adds panel tags, which the SDK's panel builders do not expose (the panel model has them)."""

    def __init__(self, inner: Builder[dash_m.Panel], tags: list[str]) -> None:
        self._inner, self._tags = inner, tags

    def build(self) -> dash_m.Panel:
        panel = self._inner.build()
        if self._tags:
            panel.tags = list(self._tags)
        return panel


def timeseries(
    title: str,
    unit: str,
    *targets: Target,
    description: str = "",
    log: bool = False,
    w: int = 12,
    h: int = 8,
    min_val: float | None = None,
    max_val: float | None = None,
    threshold: Threshold | None = None,
    stacked: bool = False,
) -> Builder[dash_m.Panel]:
    """A time series panel; `threshold` draws an alert's line (pass the Tunables value, never a literal);
    `stacked` stacks the series (parts of a whole)."""
    panel = (
        ts_b.Panel()
        .legend(
            common_b.VizLegendOptions()
            .show_legend(True)
            .display_mode(common_m.LegendDisplayMode.LIST)
            .placement(common_m.LegendPlacement.BOTTOM)
        )
        .tooltip(
            common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI).sort(common_m.SortOrder.DESCENDING)
        )
        .line_width(1)
        .fill_opacity(10)
        .show_points(common_m.VisibilityMode.NEVER)
    )
    if log:
        panel = panel.scale_distribution(
            common_b.ScaleDistributionConfig().type(common_m.ScaleDistribution.LOG).log(10)
        )
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL)).fill_opacity(60)
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    if threshold is not None:
        panel = panel.thresholds(_thresholds(threshold)).thresholds_style(
            common_b.GraphThresholdsStyleConfig().mode(common_m.GraphTresholdsStyleMode.DASHED)
        )
    return _common(panel, title, unit, targets, description, w, h)


def stat(
    title: str,
    unit: str,
    target: Target,
    *,
    description: str = "",
    w: int = 4,
    h: int = 4,
    show_name: bool = False,
    threshold: Threshold | None = None,
) -> Builder[dash_m.Panel]:
    """A single value; with `threshold` it turns red at an alert's line."""
    panel = (
        stat_b.Panel()
        .graph_mode(common_m.BigValueGraphMode.AREA)
        .color_mode(common_m.BigValueColorMode.VALUE)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if show_name:
        # The series name carries the answer (e.g. which rank), not only the value.
        panel = panel.text_mode(common_m.BigValueTextMode.VALUE_AND_NAME)
    if threshold is not None:
        panel = panel.thresholds(_thresholds(threshold))
    return _common(panel, title, unit, [target], description, w, h)


#: Colours of a state timeline's states, by index (cycled); Grafana's palette names. No red: a state is not an
#: alert (the alert's own panels and annotations are red).
_STATE_COLORS = ("text", "blue", "purple", "green", "orange", "yellow", "super-light-blue", "dark-gray")


def state_timeline(
    title: str,
    target: Target,
    states: Sequence[str],
    *,
    description: str = "",
    w: int = 24,
    h: int = 8,
) -> Builder[dash_m.Panel]:
    """One row per series of a gauge whose value is an index into `states` (pass the contract's tuple, never a
    copy): each index is drawn as its name, so a new state appended there reaches the panel by itself."""
    names = {
        str(index): dash_m.ValueMappingResult(text=name, color=_STATE_COLORS[index % len(_STATE_COLORS)], index=index)
        for index, name in enumerate(states)
    }
    panel = (
        timeline_b.Panel()
        .mappings([dash_m.ValueMap(options=names)])
        .color_scheme(dash_b.FieldColor().mode(dash_m.FieldColorModeId.FIXED).fixed_color("text"))
        .show_value(common_m.VisibilityMode.AUTO)
        .merge_values(True)
        .row_height(0.9)
        .fill_opacity(80)
        .line_width(0)
        .legend(
            common_b.VizLegendOptions()
            .show_legend(True)
            .display_mode(common_m.LegendDisplayMode.LIST)
            .placement(common_m.LegendPlacement.BOTTOM)
        )
    )
    return _common(panel, title, "none", [target], description, w, h)


def heatmap(
    title: str,
    y_unit: str,
    target: Target,
    *,
    description: str = "",
    repeat: str = "",
    w: int = 12,
    h: int = 8,
) -> Builder[dash_m.Panel]:
    """A heatmap of a histogram's buckets (Prometheus-computed, so Grafana does not re-bucket)."""
    panel = (
        heatmap_b.Panel()
        .calculate(False)
        .y_axis(heatmap_b.YAxisConfig().unit(y_unit))
        .color(heatmap_b.HeatmapColorOptions().mode(heatmap_m.HeatmapColorMode.SCHEME).scheme("Oranges"))
        .show_legend()
        .show_tooltip()
    )
    if repeat:
        # Grafana splits the panel's width between the repeated copies.
        panel = panel.repeat(repeat).repeat_direction("h")
    # The cell value is a count of observations per rate window.
    return _common(panel, title, "short", [target], description, w, h)


def run_variable() -> dash_b.QueryVariable:
    return (
        dash_b.QueryVariable("run")
        .label("Run")
        .description("The run_id of a training run (from rankscope_run_info).")
        .query(f"label_values({m('run_info')}, run_id)")
        .datasource(DATASOURCE)
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_DESC)
    )


def rank_variable() -> dash_b.QueryVariable:
    return (
        dash_b.QueryVariable("rank")
        .label("Rank")
        .description('Global ranks of the run; panels use rank=~"$rank".')
        .query(f"label_values({m('run_info')}{{{RUN_SEL}}}, rank)")
        .datasource(DATASOURCE)
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.NUMERICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dash_m.VariableOption(selected=True, text="All", value="$__all"))
    )


class _PromAnnotationModel(dash_m.AnnotationQuery):
    """The SDK's AnnotationQuery plus the Prometheus annotation fields it lacks (title/text/tags)."""

    def __init__(self, title_format: str, text_format: str, tag_keys: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.title_format, self.text_format, self.tag_keys = title_format, text_format, tag_keys

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        payload.update(
            # step below the rate window, so that an action between two steps is not skipped.
            {"titleFormat": self.title_format, "textFormat": self.text_format, "tagKeys": self.tag_keys, "step": "10s"}
        )
        return payload


class _PromAnnotation(dash_b.AnnotationQuery):
    def __init__(self, name: str, expr: str, color: str, title: str, text: str, tag_keys: str) -> None:
        self._internal = _PromAnnotationModel(
            title, text, tag_keys, name=name, datasource=DATASOURCE, enable=True, icon_color=color, expr=expr
        )


def alert_annotation() -> _PromAnnotation:
    return _PromAnnotation(
        "Firing alerts",
        FIRING_ALERTS,
        "red",
        "{{alertname}}",
        "{{severity}} {{rank}}",
        "alertname,severity,action",
    )


def control_action_annotation() -> _PromAnnotation:
    actions = f"{m('control_actions_total')}{{{RUN_SEL}}}"
    # A labelled counter's series appears with its first action (value 1, no change to see):
    # `unless ... offset` marks that first one, changes() every later one.
    return _PromAnnotation(
        "Control actions",
        f"sum by (action, source, result) "
        f"((changes({actions}[{RATE}]) > 0) or ({actions} unless {actions} offset {RATE}))",
        "blue",
        "{{action}}",
        "{{result}} (from {{source}})",
        "action,result",
    )


def dashboard(uid: str, title: str, description: str, rows: Sequence[tuple[str, Sequence[Builder]]]) -> dict:
    """A whole dashboard as a JSON-ready dict: variables, annotations, links, then the rows of panels."""
    board = (
        dash_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["rankscope"])
        .editable()
        .refresh("10s")
        .time("now-30m", "now")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .with_variable(run_variable())
        .with_variable(rank_variable())
        .annotation(alert_annotation())
        .annotation(control_action_annotation())
        .link(
            dash_b.DashboardLink("rankscope")
            .type(dash_m.DashboardLinkType.DASHBOARDS)
            .tags(["rankscope"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    for row_title, panels in rows:
        board = board.with_row(dash_b.Row(row_title))
        for panel in panels:
            board = board.with_panel(panel)
    model = board.build()
    for panel_id, panel in enumerate(model.panels or [], start=1):
        # Stable ids in layout order (the SDK leaves them unset or 0).
        panel.id_val = panel_id
        # The SDK wraps to a new line only after a panel overflows it; catch widths that do not add up to 24.
        if panel.grid_pos.x + panel.grid_pos.w > 24:
            raise ValueError(f"{title}: panel {panel.title!r} does not fit the 24-column grid")
    return json.loads(json.dumps(model, cls=JSONEncoder))


def to_json(board: dict) -> str:
    """The committed form: sorted keys, two-space indent, trailing newline (stable diffs)."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"
