"""Every figure of the report, drawn with matplotlib's object API on the Agg canvas (no pyplot, no display).

Conventions, the same in every figure:

- x is time since the run's first sample (`h:mm:ss`), so an alert, an action and
  a loss spike line up across sections; firing alerts are shaded red, control
  actions are vertical lines in their action's colour;
- y is in the metric's base unit, labelled readably: seconds as ms/s/min, bytes in
  binary units (KiB, MiB, GiB), ratios as %, rates with k/M prefixes;
- each rank has one colour everywhere (:func:`rank_colors`); with more than
  :data:`LEGEND_RANKS` ranks lines lose their legend and the small multiples and
  heat map carry the per-rank reading;
- figures are 12.4 inches wide at 100 dpi: 1240 px, readable in a 1280 px window.
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import matplotlib
import numpy as np
from matplotlib import colors as mcolors
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from rankscope.report.analysis import Straggler, ratio_to_median
from rankscope.report.attention import AttentionSnapshot
from rankscope.report.incidents import Incidents
from rankscope.report.series import Series, times_union
from rankscope.report.stops import Stop, mask_stops, phase_words

__all__ = [
    "DPI",
    "LEGEND_RANKS",
    "WIDTH",
    "Mark",
    "ResourceInputs",
    "TimeAxis",
    "TrainingInputs",
    "attention_figure",
    "bytes_axis",
    "clock",
    "correlation_figure",
    "incidents_figure",
    "loss_rate_figure",
    "marks_from",
    "memory_vs_length_figure",
    "png_bytes",
    "rank_colors",
    "rank_heatmap_figure",
    "rank_small_multiples_figure",
    "rank_timings_figure",
    "resources_figure",
    "seconds_axis",
    "summary_figure",
    "training_figure",
]

WIDTH = 12.4
DPI = 100
#: Up to this many ranks, per-rank lines get a legend.
LEGEND_RANKS = 16
ACTION_COLORS = {
    "reduce_lr": "#7b2cbf",
    "checkpoint": "#2a9d8f",
    "stop": "#222222",
    "pause": "#8d99ae",
    "resume": "#8d99ae",
    "rollback": "#e76f51",
    "reduce_micro_batch": "#bc6c25",
    "restart": "#3a86ff",
}
#: Actions named on the loss panel too: a rollback is where the curve jumps back to an earlier state.
LOSS_PANEL_LABELS = frozenset({"rollback"})
#: Actions named at their line on the learning-rate panel: those that change the rate.
LR_PANEL_LABELS = frozenset({"reduce_lr", "rollback"})
FIRING = "#d62828"
#: The shade of a stretch in which a rank made no step.
STOPPED = "#c9c9c9"
PENDING = "#f4a261"
_STYLE: Any = {  # matplotlib's stub wants its literal rc names as keys
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.labelsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e4e4e4",
    "grid.linewidth": 0.6,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "lines.linewidth": 1.3,
}


def _figure(height: float, width: float = WIDTH) -> Figure:
    with matplotlib.rc_context(_STYLE):
        figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    # The layout leaves no room for the last x tick label's overhang: keep 1.5 % of the width for it.
    figure.get_layout_engine().set(rect=(0.0, 0.0, 0.985, 1.0))  # type: ignore[call-arg,union-attr]
    FigureCanvasAgg(figure)
    return figure


def _styled(build: Callable[..., Figure]) -> Callable[..., Figure]:
    """Run a figure builder under the report's style (rc settings are read when artists are made)."""

    def wrapper(*args: object, **kwargs: object) -> Figure:
        with matplotlib.rc_context(_STYLE):
            return build(*args, **kwargs)

    wrapper.__name__ = build.__name__
    wrapper.__doc__ = build.__doc__
    return wrapper


def png_bytes(figure: Figure) -> bytes:
    """The figure as PNG (Agg), at the report's resolution."""
    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


# --- colours -------------------------------------------------------------------------------------


def rank_colors(ranks: Iterable[int]) -> dict[int | None, tuple[float, float, float, float]]:
    """One colour per rank, the same in every figure: tab10/tab20 for small runs, a sweep of hues beyond."""
    ranks = sorted(set(ranks))
    world = max(ranks, default=0) + 1
    if world <= 10:
        palette = matplotlib.colormaps["tab10"]
        return {r: palette(r) for r in ranks}
    if world <= 20:
        palette = matplotlib.colormaps["tab20"]
        return {r: palette(r) for r in ranks}
    palette = matplotlib.colormaps["turbo"]
    return {r: palette(0.05 + 0.9 * r / (world - 1)) for r in ranks}


# --- axes: time and units ---------------------------------------------------------------------------

_NICE_SECONDS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def clock(seconds: float, with_hours: bool = False) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on (or always, `with_hours`)."""
    seconds = int(round(seconds))
    sign = "-" if seconds < 0 else ""
    hours, rest = divmod(abs(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{sign}{hours}:{minutes:02d}:{secs:02d}" if hours or with_hours else f"{sign}{minutes}:{secs:02d}"


@dataclass(frozen=True)
class TimeAxis:
    """The shared x axis: seconds since `start`, up to `end`."""

    start: float
    end: float

    @property
    def span(self) -> float:
        return max(self.end - self.start, 1.0)

    @overload
    def x(self, t: np.ndarray) -> np.ndarray: ...
    @overload
    def x(self, t: float) -> float: ...
    def x(self, t: np.ndarray | float) -> np.ndarray | float:
        return np.asarray(t, dtype=float) - self.start if isinstance(t, np.ndarray) else float(t) - self.start

    def apply(self, axis: Axes, label: bool = True) -> None:
        axis.set_xlim(0, self.span)
        target = self.span / 7
        tick = next((n for n in _NICE_SECONDS if n >= target), math.ceil(target / 86400) * 86400)
        axis.xaxis.set_major_locator(ticker.MultipleLocator(tick))
        long = self.span >= 3600
        axis.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: clock(v, with_hours=long)))
        if label:
            axis.set_xlabel("time since the run's first sample (h:mm:ss)" if self.span >= 3600 else
                            "time since the run's first sample (m:ss)")  # fmt: skip


class _ScaledLocator(ticker.MaxNLocator):
    """Nice ticks in a display unit (e.g. GiB), placed in the base unit (bytes)."""

    def __init__(self, scale: float, nbins: int | Literal["auto"] = "auto") -> None:
        super().__init__(nbins=nbins, steps=[1, 2, 2.5, 5, 10])
        self.scale = scale

    def tick_values(self, vmin: float, vmax: float) -> np.ndarray:  # type: ignore[override]  # as MaxNLocator's
        return np.asarray(super().tick_values(vmin / self.scale, vmax / self.scale)) * self.scale


def _unit(values: Sequence[float], units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    top = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    chosen = units[0]
    for scale, name in units:
        if top >= scale:
            chosen = (scale, name)
    return chosen


def _values(series: Iterable[Series]) -> list[float]:
    return [float(v) for s in series for v in s.v if math.isfinite(v)]


def bytes_axis(axis: Axes, values: Sequence[float], label: str = "bytes") -> str:
    """Binary units on y for byte values; returns the unit chosen."""
    scale, unit = _unit(values, [(1, "B"), (1024, "KiB"), (1024**2, "MiB"), (1024**3, "GiB"), (1024**4, "TiB")])
    axis.yaxis.set_major_locator(_ScaledLocator(scale))
    axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v / scale:g} {unit}"))
    axis.set_ylabel(label)
    return unit


def seconds_axis(axis: Axes, values: Sequence[float], label: str = "seconds") -> str:
    """ms / s / min on y for durations in seconds; returns the unit chosen."""
    scale, unit = _unit(values, [(1e-6, "µs"), (1e-3, "ms"), (1.0, "s"), (60.0, "min")])
    axis.yaxis.set_major_locator(_ScaledLocator(scale))
    axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v / scale:g} {unit}"))
    axis.set_ylabel(label)
    return unit


def _ratio_axis(axis: Axes, label: str) -> None:
    axis.yaxis.set_major_formatter(ticker.PercentFormatter(1.0, decimals=0))
    axis.set_ylabel(label)


def _rate_axis(axis: Axes, unit: str, label: str) -> None:
    axis.yaxis.set_major_formatter(ticker.EngFormatter(unit=unit, sep=" "))
    axis.set_ylabel(label)


#: A y axis spans at least this fraction of its values' magnitude: a 0.5 % wobble must not fill the panel.
MIN_RELATIVE_SPAN = 0.2


def _min_span(axis: Axes, values: Sequence[float], fraction: float = MIN_RELATIVE_SPAN) -> None:
    """Widen the y limits around the data to at least `fraction` of its magnitude (never below zero for
    positive data), so noise is drawn as noise."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    lo, hi = min(finite), max(finite)
    need = fraction * max(abs(lo), abs(hi))
    if hi - lo >= need or need == 0:
        return
    middle = (lo + hi) / 2
    bottom, top = middle - need / 2, middle + need / 2
    if lo >= 0 and bottom < 0:
        bottom, top = 0.0, need
    axis.set_ylim(bottom, top)


def _log_if_wide(axis: Axes, values: Sequence[float], ratio: float = 30.0) -> None:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > ratio:
        axis.set_yscale("log")


# --- marks: alerts and actions on every time axis ----------------------------------------------------


@dataclass(frozen=True)
class Mark:
    """A firing alert (a span) or a control action (a line), drawn on time axes."""

    t: float
    until: float | None
    label: str
    color: str
    kind: str  # "alert", "action" or "nonfinite" (a training step with a non-finite loss)


def marks_from(incidents: Incidents | None, interval: float = 0.0) -> list[Mark]:
    """Spans for firing alerts, lines for applied actions."""
    if incidents is None:
        return []
    marks = [
        Mark(e.firing_at, e.ended_at + interval, e.alertname, FIRING, "alert")
        for e in incidents.episodes
        if e.firing_at is not None
    ]
    marks += [
        Mark(a.at, None, a.action, ACTION_COLORS.get(a.action, "#555555"), "action")
        for a in incidents.actions
        if a.result == "applied"
    ]
    marks += [Mark(t, None, "non-finite step", FIRING, "nonfinite") for t, _ in incidents.nonfinite]
    return marks


#: Action labels closer than this fraction of the axis share one label ("pause, resume"): side by side they
#: would run over each other (a rotated label is ~10 px wide; a half-width panel ~550 px).
LABEL_GAP = 0.03


def _label_groups(marks: Sequence[Mark], axis_x: TimeAxis) -> list[tuple[float, str, str]]:
    """(x, text, colour) per group of nearby action lines, their names joined in time order."""
    groups: list[list[Mark]] = []
    for mark in sorted(marks, key=lambda m: m.t):
        if groups and mark.t - groups[-1][-1].t <= LABEL_GAP * axis_x.span:
            groups[-1].append(mark)
        else:
            groups.append([mark])
    out = []
    for group in groups:
        names = list(dict.fromkeys(m.label for m in group))
        color = group[0].color if len({m.color for m in group}) == 1 else "#333333"
        out.append((axis_x.x(group[0].t), ", ".join(names), color))
    return out


def _draw_marks(axis: Axes, axis_x: TimeAxis, marks: Sequence[Mark], labels: bool | frozenset[str] = False) -> None:
    """Alerts as bars along the top, actions as dashed lines; `labels`: name every action line, or those in the set.

    Labels stand at the bottom of the plot (the legend sits at the top), nearby ones merged into one."""
    named = []
    for mark in marks:
        if mark.kind == "nonfinite":
            continue  # the loss panels draw them (see _draw_nonfinite)
        if mark.kind == "alert":
            # A bar along the top edge, not a full-height shade: several alerts must not hide the lines.
            axis.axvspan(axis_x.x(mark.t), axis_x.x(mark.until or mark.t), ymin=0.97, ymax=1.0, color=mark.color,
                         alpha=0.75, lw=0)  # fmt: skip
        else:
            axis.axvline(axis_x.x(mark.t), color=mark.color, lw=1.0, ls="--", alpha=0.85)
            if labels is True or (labels and mark.label in labels):
                named.append(mark)
    for x, text, color in _label_groups(named, axis_x):
        axis.annotate(text, (x, 0.0), xycoords=("data", "axes fraction"), xytext=(2, 3), textcoords="offset points",
                      va="bottom", ha="left", fontsize=7.5, color=color, rotation=90, gid=ACTION_LABEL,
                      bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7})  # fmt: skip


#: The gid of an action line's label (see _room_for_labels).
ACTION_LABEL = "action-label"
#: The band the labels may claim at the bottom of a plot, at most (the data keeps the rest).
MAX_LABEL_BAND = 0.6


def _room_for_labels(figure: Figure) -> None:
    """Lower each plot's y floor until its data stays above its action labels (they stand at the bottom), so
    no label sits on a curve. Lays the figure out to measure them."""
    figure.canvas.draw()
    for axis in figure.axes:
        labels = [t for t in axis.texts if t.get_gid() == ACTION_LABEL and t.get_visible()]
        box = axis.get_window_extent()
        if not labels or box.height <= 0:
            continue
        extents = [t.get_window_extent() for t in labels]
        band = min(MAX_LABEL_BAND, max(e.y1 - box.y0 for e in extents) / box.height + 0.02)
        lowest = math.inf
        for line in axis.get_lines():
            if line.get_transform() != axis.transData:
                continue  # action lines and markers placed in axes fractions
            points = axis.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
            ys = np.asarray(line.get_ydata(), dtype=float)
            for extent in extents:
                under = (points[:, 0] >= extent.x0 - 2) & (points[:, 0] <= extent.x1 + 2) & np.isfinite(ys)
                if under.any():
                    lowest = min(lowest, float(ys[under].min()))
        if not math.isfinite(lowest):
            continue
        log = axis.get_yscale() == "log"
        if log and lowest <= 0:
            continue
        lo, hi = axis.get_ylim()
        to = (lambda v: math.log10(v)) if log else (lambda v: v)
        back = (lambda v: 10**v) if log else (lambda v: v)
        if (to(lowest) - to(lo)) / (to(hi) - to(lo)) >= band:
            continue
        axis.set_ylim(back((to(lowest) - band * to(hi)) / (1 - band)), hi)


def _draw_nonfinite(axis: Axes, axis_x: TimeAxis, marks: Sequence[Mark]) -> None:
    """A red cross along the bottom edge at every step whose loss was not finite (it has no point to plot)."""
    xs = [axis_x.x(m.t) for m in marks if m.kind == "nonfinite"]
    if xs:
        axis.plot(
            xs,
            [0.03] * len(xs),
            transform=axis.get_xaxis_transform(),
            ls="none",
            marker="x",
            ms=6,
            mew=1.5,
            color=FIRING,
            label=f"non-finite loss ({len(xs)} step{'s' if len(xs) != 1 else ''})",
            clip_on=False,
        )


def _empty(axis: Axes, title: str, why: str) -> None:
    axis.set_title(title, loc="left")
    axis.text(0.5, 0.5, why, transform=axis.transAxes, ha="center", va="center", color="#777777", wrap=True)
    axis.set_xticks([])
    axis.set_yticks([])
    axis.grid(False)


def _per_rank_lines(axis: Axes, axis_x: TimeAxis, series: Sequence[Series], colors: dict, lw: float = 1.1) -> None:
    for s in series:
        rank = s.rank
        label = f"rank {rank}" if rank is not None else (s.name or None)
        axis.plot(axis_x.x(s.t), s.v, color=colors.get(rank, "#333333"), lw=lw, label=label)
    if 1 < len(series) <= LEGEND_RANKS:
        axis.legend(loc="best", ncols=2 if len(series) > 4 else 1)


# --- training -----------------------------------------------------------------------------------------


@dataclass
class TrainingInputs:
    """What the training figure draws; any part may be missing."""

    train_loss: Series | None = None
    """Prometheus: mean over ranks of the training loss."""
    val_loss: Series | None = None
    per_step_loss: Series | None = None
    """The run log's loss of every step (rank 0), times spread between its flushes."""
    val_points: Series | None = None
    """The run log's validations (loss)."""
    accuracy: list[Series] = field(default_factory=list)
    learning_rate: list[Series] = field(default_factory=list)
    per_step_lr: Series | None = None
    """The run log's learning rate of every step (param group 0): where a reduction took effect, exactly."""
    grad_norm: Series | None = None


def _plot_loss(axis: Axes, inputs: TrainingInputs, axis_x: TimeAxis, marks: Sequence[Mark]) -> None:
    drew = False
    if inputs.per_step_loss is not None and len(inputs.per_step_loss):
        s = inputs.per_step_loss
        axis.plot(axis_x.x(s.t), s.v, color="#9ecae1", lw=0.7, label="train, every step (run log, rank 0)")
        drew = True
    if inputs.train_loss is not None and len(inputs.train_loss):
        s = inputs.train_loss
        axis.plot(axis_x.x(s.t), s.v, color="#1f77b4", label="train (mean over ranks)")
        drew = True
    val = inputs.val_points if inputs.val_points is not None and len(inputs.val_points) else inputs.val_loss
    if val is not None and len(val):
        axis.plot(axis_x.x(val.t), val.v, color="#ff7f0e", marker="o", ms=3.5, label="validation")
        drew = True
    if not drew:
        _empty(axis, "Loss", "no loss series in this run")
        return
    _draw_nonfinite(axis, axis_x, marks)
    axis.set_title("Loss", loc="left")
    axis.set_ylabel("loss")
    axis.legend(loc="upper right")
    _draw_marks(axis, axis_x, marks, labels=LOSS_PANEL_LABELS)


def _plot_learning_rate(axis: Axes, inputs: TrainingInputs, axis_x: TimeAxis, marks: Sequence[Mark],
                        named: frozenset[str] = LR_PANEL_LABELS) -> None:  # fmt: skip
    """The rate per param group; the actions in `named` labelled at their line, the others in the legend."""
    groups = sorted(inputs.learning_rate, key=lambda s: s.labels.get("param_group", ""))
    logged = inputs.per_step_lr if inputs.per_step_lr is not None and len(inputs.per_step_lr) else None
    if not groups and logged is None:
        _empty(axis, "Learning rate", "no rankscope_learning_rate series")
        return
    for i, s in enumerate(groups):
        axis.plot(axis_x.x(s.t), s.v, color=matplotlib.colormaps["Dark2"](i % 8),
                  label=f"param group {s.labels.get('param_group', '?')}")  # fmt: skip
    if logged is not None:
        axis.plot(axis_x.x(logged.t), logged.v, color="#222222", lw=0.8, ls=":", label="group 0, every step (run log)")
    _log_if_wide(axis, _values([*groups, *([logged] if logged is not None else [])]))
    axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_ylabel("learning rate")
    axis.set_title("Learning rate per param group, control actions marked", loc="left")
    _draw_marks(axis, axis_x, marks, labels=named)
    # The other actions' lines are named once each in the legend: a label at each would stand on the curve.
    others = {m.label: m.color for m in marks if m.kind == "action" and m.label not in named}
    handles, names = axis.get_legend_handles_labels()
    handles += [Line2D([], [], color=color, lw=1.0, ls="--") for color in others.values()]
    axis.legend(handles, names + list(others), loc="best", ncols=2 if len(handles) > 4 else 1)


@_styled
def training_figure(inputs: TrainingInputs, axis_x: TimeAxis, marks: Sequence[Mark] = ()) -> Figure:
    """Loss (train and validation), contrastive accuracy, learning rate per group (actions marked), grad norm."""
    figure = _figure(7.2)
    (loss, accuracy), (lr, norm) = figure.subplots(2, 2, sharex=True)

    _plot_loss(loss, inputs, axis_x, marks)

    if inputs.accuracy:
        styles = {"train": "-", "val": "--"}
        palette = {"image_to_text": "#2ca02c", "text_to_image": "#9467bd"}
        for s in inputs.accuracy:
            split, direction = s.labels.get("split", "?"), s.labels.get("direction", "?")
            accuracy.plot(axis_x.x(s.t), s.v, ls=styles.get(split, ":"), color=palette.get(direction, "#555555"),
                          label=f"{split} {direction.replace('_', ' ')}")  # fmt: skip
        accuracy.set_ylim(0, 1.02)
        _ratio_axis(accuracy, "in-batch retrieval accuracy")
        accuracy.set_title("Contrastive accuracy", loc="left")
        accuracy.legend(loc="lower right", ncols=2)
        _draw_marks(accuracy, axis_x, marks)
    else:
        _empty(
            accuracy, "Contrastive accuracy", "no rankscope_contrastive_accuracy_ratio series (not a contrastive model)"
        )

    _plot_learning_rate(lr, inputs, axis_x, marks)

    if inputs.grad_norm is not None and len(inputs.grad_norm):
        s = inputs.grad_norm
        norm.plot(axis_x.x(s.t), s.v, color="#8c564b")
        _log_if_wide(norm, list(s.v))
        norm.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
        norm.set_ylabel("L2 norm before clipping")
        norm.set_title("Gradient norm", loc="left")
        _draw_marks(norm, axis_x, marks)
    else:
        _empty(norm, "Gradient norm", "no rankscope_grad_norm series")
    for axis in (lr, norm):
        axis_x.apply(axis)
    _room_for_labels(figure)
    return figure


# --- ranks --------------------------------------------------------------------------------------------

TIMINGS = (
    ("step", "Step time per rank (the same on every rank under DDP)"),
    ("compute", "Compute time per rank (step - comm - data wait)"),
    ("comm", "All-reduce time per rank (fast ranks wait for slow ones)"),
    ("data wait", "Data-loader wait per rank"),
)


@_styled
def rank_timings_figure(
    timings: dict[str, Sequence[Series]], axis_x: TimeAxis, straggler: Straggler | None = None,
    marks: Sequence[Mark] = (), stops: Sequence[Stop] = (), last_step: Sequence[Series] = (),
) -> Figure:  # fmt: skip
    """Mean step, compute, comm and data-wait time per rank over time (one colour per rank), and, from each
    rank's `last_step` time, the time since its last step.

    The timings are means over a rate window: they read a normal step for a while after a rank stopped,
    then are absent. So each rank's line breaks in its `stops` and every panel shades them; the time since
    the last step climbs through them, and its title says what each stopped rank was doing.
    """
    figure = _figure(10.0 if last_step else 7.2)
    grid = figure.add_gridspec(3 if last_step else 2, 2, height_ratios=[1.0, 1.0, 0.85] if last_step else None)
    first = figure.add_subplot(grid[0, 0])
    axes = [first, *(figure.add_subplot(grid[i, j], sharex=first) for i, j in ((0, 1), (1, 0), (1, 1)))]
    ranks = [s.rank for group in (*timings.values(), last_step) for s in group if s.rank is not None]
    colors = rank_colors(ranks)
    for axis, (key, title) in zip(axes, TIMINGS, strict=True):
        series = [mask_stops(s, stops) for s in timings.get(key, [])]
        if not series:
            _empty(axis, title, f"no {key} series")
            continue
        _per_rank_lines(axis, axis_x, series, colors)
        if key == "compute" and straggler is not None and straggler.stands_out:
            slow = [s for s in series if s.rank == straggler.rank]
            for s in slow:
                axis.plot(axis_x.x(s.t), s.v, color=colors.get(s.rank), lw=2.6)
            title = f"Compute time per rank: rank {straggler.rank} is the straggler"
        axis.set_title(title, loc="left", fontsize=9.5)
        seconds_axis(axis, _values(series), "mean over the rate window")
        axis.set_ylim(bottom=0)
        _draw_stops(axis, axis_x, stops)
        _draw_marks(axis, axis_x, marks)
    if last_step:
        since = figure.add_subplot(grid[2, :], sharex=first)
        _plot_since_last_step(since, axis_x, last_step, stops, colors, marks)
        axes.append(since)
        for axis in axes[2:4]:
            axis_x.apply(axis, label=False)
    else:
        for axis in axes[2:]:
            axis_x.apply(axis)
    if len(set(ranks)) > LEGEND_RANKS:
        _rank_colorbar(figure, axes, colors)
    return figure


def _draw_stops(axis: Axes, axis_x: TimeAxis, stops: Sequence[Stop]) -> None:
    """A grey shade over each stretch in which some rank made no step."""
    spans: list[list[float]] = []
    for stop in sorted(stops, key=lambda s: s.start):
        if spans and stop.start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], stop.end)
        else:
            spans.append([stop.start, stop.end])
    for lo, hi in spans:
        axis.axvspan(axis_x.x(lo), axis_x.x(hi), color=STOPPED, alpha=0.35, lw=0, gid="stop", zorder=0)


def _stop_words(stops: Sequence[Stop], start: float) -> str:
    """The stops for a title: rank, from-to and what it was doing; the longest few when there are many."""
    shown = sorted(stops, key=lambda s: s.start - s.end)[:4]
    words = [f"rank {s.rank} {clock(s.start - start)}-{clock(s.end - start)}"
             + (" and on" if s.open else "") + (f" ({phase_words(s.phase)})" if s.phase else "")
             for s in sorted(shown, key=lambda s: (s.start, s.rank))]  # fmt: skip
    more = f" and {len(stops) - len(shown)} more" if len(stops) > len(shown) else ""
    return ", ".join(words) + more


def _plot_since_last_step(axis: Axes, axis_x: TimeAxis, last_step: Sequence[Series], stops: Sequence[Stop],
                          colors: dict, marks: Sequence[Mark]) -> None:  # fmt: skip
    """Per rank: seconds since its last step, as Prometheus saw it; it climbs while the rank makes no step."""
    ages = []
    for s in last_step:
        age = np.where(s.v > 0, s.t - s.v, np.nan)  # 0: an incarnation that has not stepped yet
        ages.append(mask_stops(Series(dict(s.labels), s.t, age, s.name), ()))
    _per_rank_lines(axis, axis_x, ages, colors)
    seconds_axis(axis, _values(ages), "since the last step")
    axis.set_ylim(bottom=0)
    title = "Time since each rank's last step"
    title += f": no step on {_stop_words(stops, axis_x.start)}" if stops else " (no rank stopped stepping)"
    axis.set_title(title, loc="left", fontsize=9.5)
    _draw_stops(axis, axis_x, stops)
    _draw_marks(axis, axis_x, marks)
    axis_x.apply(axis)


def _rank_colorbar(figure: Figure, axes: Any, colors: dict) -> None:
    ranks = sorted(colors)
    cmap = mcolors.ListedColormap([colors[r] for r in ranks])
    norm = mcolors.BoundaryNorm(np.arange(len(ranks) + 1) - 0.5, len(ranks))
    bar = figure.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, shrink=0.6, pad=0.01)
    bar.set_label("rank (colour)")
    bar.set_ticks(np.linspace(0, len(ranks) - 1, min(len(ranks), 9)).round())


#: The grey of a reference line (the other ranks' median).
REFERENCE = "#777777"


def _nanmedian(values: np.ndarray) -> np.ndarray:
    """The median down the rows, NaN (without a warning) where a column has no number."""
    import warnings

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(values, axis=0)


def _grid(count: int) -> tuple[int, int]:
    columns = min(count, 8 if count <= 64 else 16)
    return math.ceil(count / columns), columns


@_styled
def rank_small_multiples_figure(
    compute: Sequence[Series], axis_x: TimeAxis, straggler: Straggler | None = None, stops: Sequence[Stop] = ()
) -> Figure:
    """One small panel per rank: its compute time (in its colour) and the median over ranks (grey), shared axes.

    Reads at any number of ranks: panels shrink, the shared y keeps them comparable, and the
    straggler's panel is framed in red.
    """
    ranked = [mask_stops(s, stops) for s in compute if s.rank is not None and len(s)]
    if not ranked:
        figure = _figure(1.6)
        _empty(figure.subplots(), "Compute time, rank by rank", "no per-rank compute series")
        return figure
    rows, columns = _grid(len(ranked))
    row_height = 1.05 if len(ranked) <= 64 else 0.62
    figure = _figure(0.6 + rows * row_height)
    axes = figure.subplots(rows, columns, sharex=True, sharey=True, squeeze=False)
    colors = rank_colors([s.rank for s in ranked])  # type: ignore[misc]
    times = times_union(ranked)
    values = np.vstack([s.at(times) for s in ranked])
    # Beyond 64 ranks one rank hardly moves the median, and a median per rank would cost a median per rank.
    exclusive = len(ranked) <= 64
    everyone = None if exclusive else _nanmedian(values)
    slow = straggler.rank if straggler is not None and straggler.stands_out else None
    small = len(ranked) > 64
    for index, axis in enumerate(axes.ravel()):
        if index >= len(ranked):
            axis.set_visible(False)
            continue
        s = ranked[index]
        axis.plot(axis_x.x(s.t), s.v, color=colors[s.rank], lw=0.9 if small else 1.1)
        if len(ranked) > 1:
            # The other ranks' median (the straggler's measure), dashed over the rank's own line: with two ranks
            # the median of all would be their mean, a line hidden between the two.
            others = _nanmedian(np.delete(values, index, axis=0)) if everyone is None else everyone
            axis.plot(axis_x.x(times), others, color=REFERENCE, lw=0.9, ls=(0, (3, 2)), zorder=3)
        axis.grid(False)
        _draw_stops(axis, axis_x, [stop for stop in stops if stop.rank == s.rank])
        axis.set_title(f"rank {s.rank}", fontsize=6.5 if small else 8, loc="left", pad=1.5,
                       color=FIRING if s.rank == slow else "#333333",
                       fontweight="bold" if s.rank == slow else "normal")  # fmt: skip
        if s.rank == slow:
            for spine in axis.spines.values():
                spine.set_visible(True)
                spine.set_color(FIRING)
                spine.set_linewidth(2)
        axis.tick_params(labelsize=6 if small else 7, length=2)
    seconds_axis(axes[0][0], _values(ranked), "")
    axes[0][0].set_ylim(bottom=0)
    axis_x.apply(axes[-1][0], label=False)
    axes[-1][0].xaxis.set_major_locator(ticker.MaxNLocator(3))
    figure.suptitle(
        f"Compute time, rank by rank ({len(ranked)} ranks; grey: the median of "
        + ("the other ranks" if exclusive else "all ranks")
        + (f"; red frame: straggler rank {slow})" if slow is not None else ")"),
        fontsize=10, fontweight="bold", x=0.01, ha="left",
    )  # fmt: skip
    return figure


def _regular(times: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`values[:, i]` at `times[i]` placed on a regular grid of the times' step, NaN columns where no time was:
    an image's columns are equally wide, so a gap in the samples must be columns of its own."""
    if len(times) < 2:
        return times, values
    steps = np.diff(times)
    step = float(steps[steps > 0].min())
    index = np.round((times - times[0]) / step).astype(int)
    if index[-1] + 1 > 4 * len(times):  # not one grid (series of different resolutions): leave it
        return times, values
    grid = np.full((values.shape[0], int(index[-1]) + 1), np.nan)
    grid[:, index] = values
    return times[0] + step * np.arange(grid.shape[1]), grid


@_styled
def rank_heatmap_figure(compute: Sequence[Series], axis_x: TimeAxis) -> Figure:
    """Compute time over the other ranks' median, rank by time: 1 is white, slower red, faster blue."""
    times, ranks, ratios = ratio_to_median(compute)
    times, ratios = _regular(times, ratios)
    height = min(7.0, 1.6 + 0.16 * max(len(ranks), 4))
    figure = _figure(height)
    axis = figure.subplots()
    if not ranks or ratios.shape[1] < 2:
        _empty(axis, "Compute time against the other ranks", "too few per-rank compute points for a heat map")
        return figure
    finite = ratios[np.isfinite(ratios)]
    top = float(np.percentile(finite, 99)) if finite.size else 2.0
    low = float(np.percentile(finite, 1)) if finite.size else 0.5
    norm = mcolors.TwoSlopeNorm(vmin=min(0.5, low), vcenter=1.0, vmax=max(1.5, top))
    order = np.argsort(ranks)
    span = axis_x.x(times)
    step = float(np.median(np.diff(span))) if len(span) > 1 else 1.0
    image = axis.imshow(
        np.ma.masked_invalid(ratios[order]), aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest",
        extent=(span[0] - step / 2, span[-1] + step / 2, len(ranks) - 0.5, -0.5),
    )  # fmt: skip
    labels = [ranks[i] for i in order]
    if len(labels) <= 32:
        axis.set_yticks(range(len(labels)), [str(r) for r in labels])
    else:
        positions = np.linspace(0, len(labels) - 1, 9).round().astype(int)
        axis.set_yticks(positions, [str(labels[i]) for i in positions])
    axis.set_ylabel("rank")
    axis.grid(False)
    axis.set_title("Compute time against the median of the other ranks (red: slower, blue: faster)", loc="left")
    bar = figure.colorbar(image, ax=axis, pad=0.01)
    bar.set_label("x the other ranks' median")
    bar.ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    axis_x.apply(axis)
    return figure


# --- resources ----------------------------------------------------------------------------------------


@dataclass
class ResourceInputs:
    host_memory: list[Series] = field(default_factory=list)
    process_memory: list[Series] = field(default_factory=list)
    device_memory: list[Series] = field(default_factory=list)
    gpu_utilization: list[Series] = field(default_factory=list)
    samples_rate: Series | None = None
    tokens_rate: Series | None = None
    host_load: list[Series] = field(default_factory=list)
    """Per node: the 1-minute load average over the CPU count (rankscope_host_cpu_load_ratio)."""
    step_time: list[Series] = field(default_factory=list)
    """Per rank: mean step time, drawn beside the load so a rise caused by other processes shows as such."""


@_styled
def resources_figure(inputs: ResourceInputs, axis_x: TimeAxis, marks: Sequence[Mark] = ()) -> Figure:
    """Host and process memory, device memory, GPU utilisation (where present), throughput, the host's load."""
    figure = _figure(10.4)
    grid = figure.add_gridspec(3, 2)
    host = figure.add_subplot(grid[0, 0])
    process, device, speed = (figure.add_subplot(grid[i, j], sharex=host) for i, j in ((0, 1), (1, 0), (1, 1)))
    load = figure.add_subplot(grid[2, :], sharex=host)
    ranks = [s.rank for group in (inputs.process_memory, inputs.device_memory, inputs.gpu_utilization)
             for s in group if s.rank is not None]  # fmt: skip
    colors = rank_colors(ranks)

    if inputs.host_memory:
        for i, s in enumerate(inputs.host_memory):
            color = matplotlib.colormaps["Dark2"](i % 8)  # not red: red is for alerts
            host.plot(axis_x.x(s.t), s.v, color=color, label=f"node {s.labels.get('node', '?')}")
        _ratio_axis(host, "host memory in use")
        host.set_ylim(0, 1.0)
        host.set_title("Host memory in use, per node", loc="left")
        if len(inputs.host_memory) <= 8:
            host.legend(loc="lower right")
        _draw_marks(host, axis_x, marks)
    else:
        _empty(host, "Host memory", "no rankscope_host_memory_used_ratio series (host probe off)")

    if inputs.process_memory:
        _per_rank_lines(process, axis_x, inputs.process_memory, colors)
        bytes_axis(process, _values(inputs.process_memory), "resident set size")
        _min_span(process, _values(inputs.process_memory))
        process.set_title("Process memory (RSS) per rank", loc="left")
        _draw_marks(process, axis_x, marks)
    else:
        _empty(process, "Process memory", "no rankscope_process_resident_memory_bytes series")

    allocated = [s for s in inputs.device_memory if s.labels.get("kind") in ("allocated", "reserved")]
    if allocated:
        for s in allocated:
            dashed = s.labels.get("kind") == "reserved"
            device.plot(
                axis_x.x(s.t),
                s.v,
                color=colors.get(s.rank, "#333333"),
                ls="--" if dashed else "-",
                lw=0.9 if dashed else 1.2,
                label=f"rank {s.rank} {s.labels.get('kind')}" if len(allocated) <= LEGEND_RANKS else None,
            )
        bytes_axis(device, _values(allocated), "device memory")
        _min_span(device, _values(allocated))
        title = "Device memory per rank (solid: allocated, dashed: reserved)"
        if inputs.gpu_utilization:
            twin = device.twinx()
            for s in inputs.gpu_utilization:
                twin.plot(axis_x.x(s.t), s.v, color=colors.get(s.rank, "#333333"), lw=0.7, alpha=0.5, ls=":")
            twin.set_ylim(0, 1.0)
            _ratio_axis(twin, "GPU utilisation (dotted)")
            twin.grid(False)
            title += ", GPU utilisation dotted"
        device.set_title(title, loc="left", fontsize=9.5)
        _draw_marks(device, axis_x, marks)
    elif inputs.gpu_utilization:
        _per_rank_lines(device, axis_x, inputs.gpu_utilization, colors)
        _ratio_axis(device, "GPU utilisation")
        device.set_title("GPU utilisation per rank", loc="left")
    else:
        _empty(device, "Device memory and GPU utilisation", "no device series: this run trained on CPU")

    if inputs.samples_rate is not None and len(inputs.samples_rate):
        s = inputs.samples_rate
        speed.plot(axis_x.x(s.t), s.v, color="#1f77b4", label="samples/s (all ranks)")
        _rate_axis(speed, "/s", "samples per second")
        speed.set_ylim(bottom=0)
        per_sample = _constant_ratio(inputs.tokens_rate, s)
        if per_sample is not None:
            # Each sample is a fixed number of tokens: a second axis would draw tokens/s exactly over samples/s.
            speed.plot([], [], " ", label=f"tokens/s = {per_sample:.4g} x samples/s throughout (not drawn twice)")
            speed.legend(loc="lower right")
        elif inputs.tokens_rate is not None and len(inputs.tokens_rate):
            twin = speed.twinx()
            twin.plot(axis_x.x(inputs.tokens_rate.t), inputs.tokens_rate.v, color="#ff7f0e", lw=1.0, ls="--",
                      label="tokens/s (all ranks)")  # fmt: skip
            _rate_axis(twin, "/s", "tokens per second")
            twin.set_ylim(bottom=0)
            twin.grid(False)
            twin.spines["right"].set_visible(True)
            lines = speed.get_lines() + twin.get_lines()
            speed.legend(lines, [str(line.get_label()) for line in lines], loc="lower right")
        speed.set_title("Throughput", loc="left")
        _draw_marks(speed, axis_x, marks)
    else:
        _empty(speed, "Throughput", "no rankscope_samples_total series")
    _plot_host_load(load, inputs, axis_x, marks)
    for axis in (host, process, device, speed):
        axis_x.apply(axis, label=False)
    return figure


def _plot_host_load(axis: Axes, inputs: ResourceInputs, axis_x: TimeAxis, marks: Sequence[Mark]) -> None:
    """The machine's own load per node (1 = as many runnable processes as CPUs), the step time beside it."""
    if not inputs.host_load:
        _empty(axis, "Host CPU load", "no rankscope_host_cpu_load_ratio series (the host probe is off, or the "
               "exporter predates it): the machine's own load cannot be shown")  # fmt: skip
        axis_x.apply(axis)
        return
    for i, s in enumerate(inputs.host_load):
        axis.plot(
            axis_x.x(s.t),
            s.v,
            color=matplotlib.colormaps["Dark2"](i % 8),
            label=f"load, node {s.labels.get('node', '?')}",
        )
    axis.axhline(1.0, color="#555555", lw=0.8, ls=":", label="as many runnable processes as CPUs")
    loads = _values(inputs.host_load)
    axis.set_ylim(0, 1.35 * max(1.0, *loads))  # headroom: the legend sits at the top
    axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_ylabel("1-min load / CPUs")
    lines = axis.get_lines()
    if inputs.step_time:
        twin = axis.twinx()
        times = times_union(inputs.step_time)
        median = _nanmedian(np.vstack([s.at(times) for s in inputs.step_time]))
        twin.plot(axis_x.x(times), median, color="#1f77b4", lw=1.0, ls="--", label="step time (median over ranks)")
        finite = [float(v) for v in median if math.isfinite(v)]
        seconds_axis(twin, finite, "step time (dashed)")
        twin.set_ylim(0, 1.35 * max(finite, default=1.0))
        twin.grid(False)
        twin.spines["right"].set_visible(True)
        lines = lines + twin.get_lines()
    axis.legend(lines, [str(line.get_label()) for line in lines], loc="upper left", ncols=2)
    axis.set_title("Host CPU load per node: a step-time rise with the load above 1 is other processes' doing",
                   loc="left")  # fmt: skip
    _draw_marks(axis, axis_x, marks)
    axis_x.apply(axis)


def _constant_ratio(a: Series | None, b: Series, tolerance: float = 0.01) -> float | None:
    """a / b where it is the same (within `tolerance`) at every shared time with b > 0, else None."""
    if a is None or not len(a):
        return None
    times = np.intersect1d(a.t, b.t)
    x, y = a.at(times), b.at(times)
    keep = np.isfinite(x) & np.isfinite(y) & (y > 0)
    if keep.sum() < 2:
        return None
    ratio = x[keep] / y[keep]
    middle = float(np.median(ratio))
    return middle if middle > 0 and float(np.max(np.abs(ratio - middle))) <= tolerance * middle else None


# --- incidents ----------------------------------------------------------------------------------------


def _fmt_seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 120 else clock(value)


@_styled
def incidents_figure(incidents: Incidents, axis_x: TimeAxis, interval: float = 0.0) -> Figure:
    """A timeline: one row per alert (amber pending, red firing), then checkpoints, pauses and actions.

    An arrow joins each alert's onset to the action it caused, labelled with the fault-to-action time. The
    actions' names stand on lanes under their row, each on the first where it runs over no other.
    """
    rows: list[str] = []
    for episode in incidents.episodes:
        if episode.title not in rows:
            rows.append(episode.title)
    rows += ["checkpoints"] + (["paused"] if incidents.paused else []) + ["control actions"]
    labels = _action_labels(incidents, timing=False)
    # The axes are narrower than the figure by the row names on the left.
    inches = WIDTH - 0.8 - max(len(row) for row in rows) * 8 * 0.62 / 72
    lanes = _lanes(labels, axis_x, inches)
    extra = max(lanes, default=-1) + 1
    figure = _figure(1.3 + 0.42 * len(rows) + 0.18 * extra)
    axis = figure.subplots()
    position = {title: i for i, title in enumerate(rows)}
    for episode in incidents.episodes:
        y = position[episode.title]
        end = episode.ended_at + interval
        if episode.pending_at is not None:
            until = episode.firing_at if episode.firing_at is not None else end
            axis.barh(y, until - episode.pending_at, left=axis_x.x(episode.pending_at), height=0.5, color=PENDING)
        if episode.firing_at is not None:
            axis.barh(y, max(end - episode.firing_at, interval, 0.5), left=axis_x.x(episode.firing_at), height=0.5,
                      color=FIRING)  # fmt: skip
    y_actions = position["control actions"]
    _draw_action_labels(axis, axis_x, labels, lanes, y_actions, white_edge=True)
    for event in incidents.actions:
        if event.cause is not None and event.fault_to_action is not None:
            color = ACTION_COLORS.get(event.action, "#555555")
            start = (axis_x.x(event.cause.onset), position[event.cause.title])
            axis.annotate("", xy=(axis_x.x(event.at), y_actions), xytext=start,
                          arrowprops={"arrowstyle": "->", "color": color, "lw": 1.0})  # fmt: skip
            middle = ((start[0] + axis_x.x(event.at)) / 2, (start[1] + y_actions) / 2)
            axis.annotate(f"{_fmt_seconds(event.fault_to_action or 0.0)}", middle, xytext=(4, 0),
                          textcoords="offset points", fontsize=7.5, color=color, va="center",
                          bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})  # fmt: skip
    y_checkpoints = position["checkpoints"]
    for t, reason in incidents.checkpoints:
        kind = reason.split(":", 1)[0]
        axis.plot(axis_x.x(t), y_checkpoints, marker="|", ms=11, mew=2,
                  color=ACTION_COLORS["checkpoint"] if kind not in ("interval", "final") else "#999999")  # fmt: skip
    for lo, hi in incidents.paused:
        axis.barh(position["paused"], max(hi - lo, interval), left=axis_x.x(lo), height=0.5, color="#8d99ae")
    axis.set_yticks(range(len(rows)), rows)
    axis.set_ylim(y_actions + LANE_HEIGHT * extra + 0.4, -0.6)
    axis.grid(axis="y", visible=False)
    title = "Alerts (amber: pending, red: firing) and the actions they caused"
    if not incidents.episodes and not incidents.actions:
        title = "No alert fired and no control action was taken"
    axis.set_title(title, loc="left")
    axis_x.apply(axis)
    return figure


# --- the documents' analyses ----------------------------------------------------------------------------


@_styled
def loss_rate_figure(x: np.ndarray, slope: np.ndarray, axis_x: TimeAxis, unit: str, window: str,
                     marks: Sequence[Mark] = ()) -> Figure:  # fmt: skip
    """The loss's rate of change over a sliding window; above zero, the loss is climbing."""
    figure = _figure(3.0)
    axis = figure.subplots()
    if len(x) == 0:
        _empty(axis, "Loss rate of change", "too few loss points for the sliding window")
        return figure
    xs = axis_x.x(x)
    axis.plot(xs, slope, color="#1f77b4", lw=1.0)
    axis.fill_between(xs, slope, 0, where=slope > 0, color=FIRING, alpha=0.25, lw=0, label="rising")
    axis.fill_between(xs, slope, 0, where=slope <= 0, color="#2a9d8f", alpha=0.2, lw=0, label="falling")
    axis.axhline(0, color="#555555", lw=0.8)
    finite = slope[np.isfinite(slope)]
    if finite.size:
        # Robust limits: the steep fall of the first steps would flatten everything after it (it is clipped,
        # and obviously falling); a climb later in the run is what this plot is for.
        bound = float(np.percentile(np.abs(finite), 90)) * 2.5 or float(np.abs(finite).max()) or 1.0
        axis.set_ylim(-bound, bound)
    axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.2g}"))
    axis.set_ylabel(f"d loss / d {unit}")
    axis.set_title(f"Loss rate of change (least-squares slope over the last {window})", loc="left")
    axis.legend(loc="upper right")
    _draw_marks(axis, axis_x, marks, labels=LOSS_PANEL_LABELS)
    axis_x.apply(axis)
    _room_for_labels(figure)
    return figure


@_styled
def correlation_figure(x: np.ndarray, correlation: np.ndarray, axis_x: TimeAxis, window: str,
                       marks: Sequence[Mark] = ()) -> Figure:  # fmt: skip
    """Rolling Pearson correlation of learning rate and loss: +1 they rise together, -1 one falls as the other rises."""
    figure = _figure(3.0)
    axis = figure.subplots()
    if len(x) == 0 or not np.isfinite(correlation).any():
        _empty(axis, "Learning rate and loss: rolling correlation",
               "not enough points where both the learning rate and the loss vary")  # fmt: skip
        return figure
    xs = axis_x.x(x)
    axis.plot(xs, correlation, color="#7b2cbf", lw=1.1)
    axis.axhline(0, color="#555555", lw=0.8)
    axis.set_ylim(-1.05, 1.05)
    axis.set_ylabel("Pearson r")
    axis.set_title(f"Learning rate and loss: rolling correlation over the last {window}", loc="left")
    _draw_marks(axis, axis_x, marks)
    axis_x.apply(axis)
    return figure


#: Below this spread (relative to its size) the sequence length is "constant": a scatter would be a cloud.
MIN_LENGTH_SPREAD = 0.1


@_styled
def memory_vs_length_figure(pairs: dict[int, tuple[np.ndarray, np.ndarray]], x_label: str, y_label: str) -> Figure:
    """Memory against sequence length (or tokens per step), one colour per rank."""
    figure = _figure(3.6, width=WIDTH * 0.62)
    axis = figure.subplots()
    if not any(len(x) for x, _ in pairs.values()):
        _empty(axis, "Memory against sequence length", "no pair of memory and sequence-length series to compare")
        return figure
    xs_all = np.concatenate([x for x, _ in pairs.values()])
    low, high = float(np.min(xs_all)), float(np.max(xs_all))
    if high - low < MIN_LENGTH_SPREAD * max(abs(high), 1e-12):
        _empty(axis, "Memory against sequence length",
               f"The sequence length hardly varied ({low:.3g} to {high:.3g}, {x_label}): too little to relate "
               "memory to it. A run whose batches vary in length shows the relation here.")  # fmt: skip
        return figure
    colors = rank_colors(pairs)
    ys = []
    for rank, (x, y) in sorted(pairs.items()):
        axis.scatter(x, y, s=9, color=colors[rank], alpha=0.6, label=f"rank {rank}", lw=0)
        ys += list(y)
    bytes_axis(axis, ys, y_label)
    _min_span(axis, ys)
    axis.set_xlabel(x_label)
    axis.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_title("Memory against sequence length", loc="left")
    if len(pairs) <= LEGEND_RANKS:
        axis.legend(loc="best", markerscale=1.5)
    return figure


# --- attention maps ---------------------------------------------------------------------------------------

SHOWN_SAMPLES = 4


@_styled
def attention_figure(snapshot: AttentionSnapshot, samples: int = SHOWN_SAMPLES) -> Figure:
    """Per sample: the image and its class token's attention over the patches side by side, the caption's
    token-to-token attention under them."""
    count = min(samples, snapshot.samples)
    has_image = snapshot.image_attention is not None
    # One scale per row for all the samples shown, so one colour bar reads them all.
    patches_top = max([float(snapshot.image_attention[i].max()) for i in range(count)] if has_image else [0.0])  # type: ignore[index]
    text_top = max(float(snapshot.text_attention[i].max()) for i in range(count)) if count else 0.0
    figure = _figure(5.4 if has_image else 3.4)
    grid = figure.add_gridspec(2 if has_image else 1, 2 * count, height_ratios=[1.0, 1.9] if has_image else [1.0])
    for i in range(count):
        caption = "\n".join(textwrap.wrap(snapshot.captions[i], 40)[:2])
        if has_image:
            picture = figure.add_subplot(grid[0, 2 * i])
            picture.imshow(snapshot.images[i], interpolation="nearest")
            picture.set_title("input", fontsize=7.5, fontweight="normal")
            heat = figure.add_subplot(grid[0, 2 * i + 1])
            patches = snapshot.image_attention[i]  # type: ignore[index]
            patch_image = heat.imshow(patches, cmap="inferno", vmin=0, vmax=max(patches_top, 1e-9),
                                      interpolation="nearest")  # fmt: skip
            heat.set_title("class token's attention", fontsize=7.5, fontweight="normal")
            for axis in (picture, heat):
                axis.set_xticks([])
                axis.set_yticks([])
                axis.grid(False)
        text = figure.add_subplot(grid[-1, 2 * i : 2 * i + 2])
        tokens = [t for t in snapshot.tokens[i] if t]
        n = len(tokens)
        matrix = snapshot.text_attention[i][:n, :n]
        image = text.imshow(matrix, cmap="viridis", vmin=0, vmax=max(text_top, 1e-9),
                            interpolation="nearest")  # fmt: skip
        text.set_xticks(range(n), tokens, rotation=90, fontsize=7)
        text.set_yticks(range(n), tokens, fontsize=7)
        text.grid(False)
        text.set_title(caption, fontsize=8, fontweight="normal")
        if i == count - 1:
            bar = figure.colorbar(image, ax=text, shrink=0.8, pad=0.02)
            bar.set_label("attention weight", fontsize=7)
            if has_image:
                bar = figure.colorbar(patch_image, ax=heat, shrink=0.9, pad=0.04)
                bar.set_label("attention weight", fontsize=7)
                bar.ax.tick_params(labelsize=6.5)
    figure.suptitle(f"Validation at step {snapshot.step}", fontsize=10, fontweight="bold", x=0.01, ha="left")
    return figure


# --- the summary -------------------------------------------------------------------------------------------

#: Rows between two lanes of action labels under the summary's action row.
LANE_HEIGHT = 0.42
#: Width of a character of the labels' 7.5 pt font, in inches (a generous estimate: labels must not touch).
_CHAR_INCHES = 7.5 * 0.62 / 72
#: The summary's full-width axes are about this wide, in inches.
_TIMELINE_INCHES = WIDTH - 1.9


def _action_labels(incidents: Incidents, timing: bool = True) -> list[tuple[Any, str]]:
    """(event, label) per action, in time order; with `timing` the label says the fault-to-action time and
    what from."""
    out = []
    for event in sorted(incidents.actions, key=lambda e: e.at):
        label = event.action if event.result == "applied" else f"{event.action} ({event.result})"
        if timing and event.cause is not None and event.fault_to_action is not None:
            since = event.first_sign_what if event.first_sign is not None else event.cause.alertname
            label += f": {_fmt_seconds(event.fault_to_action)} after {since}"
        out.append((event, label))
    return out


def _lanes(labels: Sequence[tuple[Any, str]], axis_x: TimeAxis, inches: float = _TIMELINE_INCHES) -> list[int]:
    """A lane per label (0 = nearest the row) such that labels on one lane do not run into each other, on axes
    `inches` wide."""
    per_second = inches / axis_x.span
    taken: list[list[tuple[float, float]]] = []  # per lane: the (from, to) of its labels, in inches
    lanes = []
    for event, label in labels:
        x = axis_x.x(event.at) * per_second
        width = (len(label) + 2) * _CHAR_INCHES
        right = axis_x.x(event.at) > axis_x.span * 0.6  # drawn to the left of its marker (as summary_figure)
        lo, hi = (x - width, x + 0.1) if right else (x - 0.1, x + width)
        lane = next((i for i, spans in enumerate(taken) if all(lo > b or hi < a for a, b in spans)), len(taken))
        if lane == len(taken):
            taken.append([])
        taken[lane].append((lo, hi))
        lanes.append(lane)
    return lanes


def _draw_action_labels(axis: Axes, axis_x: TimeAxis, labels: Sequence[tuple[Any, str]], lanes: Sequence[int],
                        y: float, white_edge: bool = False) -> None:  # fmt: skip
    """Each action as a marker on row `y` (a diamond applied, a cross not), its label on its lane under the row
    (lanes: _lanes), joined to the marker by a thin line when it is not on the first lane."""
    for (event, label), lane in zip(labels, lanes, strict=True):
        color = ACTION_COLORS.get(event.action, "#555555")
        x = axis_x.x(event.at)
        applied = event.result == "applied"
        axis.plot(x, y, marker="D" if applied else "X", ms=6, color=color, ls="none",
                  markeredgecolor="white" if white_edge and applied else color)  # fmt: skip
        lane_y = y + LANE_HEIGHT * (lane + 1)
        if lane:
            axis.plot([x, x], [y, lane_y], color=color, lw=0.6, alpha=0.6)
        right = x > axis_x.span * 0.6
        axis.annotate(label, (x, lane_y), xytext=(-3 if right else 3, 0), textcoords="offset points", fontsize=7.5,
                      color=color, va="center", ha="right" if right else "left")  # fmt: skip


@_styled
def summary_figure(
    title: str,
    training: TrainingInputs,
    compute: Sequence[Series],
    incidents: Incidents,
    axis_x: TimeAxis,
    straggler: Straggler | None = None,
    interval: float = 0.0,
) -> Figure:
    """The one-picture summary saved next to the report: loss, learning rate, compute per rank, incidents."""
    labels = _action_labels(incidents)
    lanes = _lanes(labels, axis_x)
    extra = max(lanes, default=0)
    figure = _figure(8.4 + 0.16 * extra)
    grid = figure.add_gridspec(3, 2, height_ratios=[1.0, 1.0, 0.9 + 0.16 * extra])
    loss = figure.add_subplot(grid[0, 0])
    lr = figure.add_subplot(grid[0, 1], sharex=loss)
    ranks = figure.add_subplot(grid[1, :], sharex=loss)
    timeline = figure.add_subplot(grid[2, :], sharex=loss)
    marks = marks_from(incidents, interval)

    _plot_loss(loss, training, axis_x, marks)
    # The timeline under it names every action at the same time: here the legend says which line is which.
    _plot_learning_rate(lr, training, axis_x, marks, named=frozenset())
    lr.set_title("Learning rate, actions marked", loc="left")

    ranked = [s for s in compute if s.rank is not None]
    colors = rank_colors([s.rank for s in ranked])  # type: ignore[misc]
    _per_rank_lines(ranks, axis_x, ranked, colors, lw=0.9 if len(ranked) > LEGEND_RANKS else 1.2)
    if straggler is not None and straggler.stands_out:
        for s in ranked:
            if s.rank == straggler.rank:
                ranks.plot(axis_x.x(s.t), s.v, color=colors[s.rank], lw=2.6)
        ranks.set_title(f"Compute time per rank: rank {straggler.rank} is the straggler "
                        f"({straggler.ratio:.2f}x the other ranks' median)", loc="left")  # fmt: skip
    else:
        ranks.set_title("Compute time per rank (no straggler)", loc="left")
    if ranked:
        seconds_axis(ranks, _values(ranked), "compute time")
        ranks.set_ylim(bottom=0)
    _draw_marks(ranks, axis_x, marks)

    rows: list[str] = []
    for episode in incidents.episodes:
        if episode.title not in rows:
            rows.append(episode.title)
    rows.append("actions")
    for episode in incidents.episodes:
        y = rows.index(episode.title)
        if episode.pending_at is not None:
            until = episode.firing_at if episode.firing_at is not None else episode.ended_at + interval
            timeline.barh(y, until - episode.pending_at, left=axis_x.x(episode.pending_at), height=0.5, color=PENDING)
        if episode.firing_at is not None:
            timeline.barh(y, max(episode.ended_at + interval - episode.firing_at, 0.5),
                          left=axis_x.x(episode.firing_at), height=0.5, color=FIRING)  # fmt: skip
    y_actions = len(rows) - 1
    _draw_action_labels(timeline, axis_x, labels, lanes, y_actions)
    timeline.set_yticks(range(len(rows)), rows, fontsize=7.5)
    timeline.set_ylim(y_actions + LANE_HEIGHT * (extra + 1) + 0.35, -0.6)
    timeline.grid(axis="y", visible=False)
    quiet = not incidents.episodes and not incidents.actions
    timeline.set_title("No alert fired and no control action was taken" if quiet else
                       "Alerts (amber pending, red firing) and control actions", loc="left")  # fmt: skip
    ranks.tick_params(labelbottom=False)  # the timeline under it has the same axis
    for axis in (loss, lr):
        axis_x.apply(axis, label=False)
        axis.tick_params(labelbottom=True)
    axis_x.apply(timeline)
    figure.suptitle(title, fontsize=11, fontweight="bold", x=0.01, ha="left")
    _room_for_labels(figure)
    return figure
