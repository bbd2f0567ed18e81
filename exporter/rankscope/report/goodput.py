"""The report's goodput section: where the job's time went, and what each incident cost (docs/goodput.md).

Reads `rankscope_goodput_seconds_total{bucket}` (rank 0's ledger, the job's totals across restarts) over the
run's window. The breakdown is each bucket's last value; an incident is a stretch of samples over which a
badput bucket grew (a restart shows as the jump between two incarnations' samples). Its cost is its seconds
times the world size, in GPU-hours (rank-hours on a CPU run), and in money with a price per GPU-hour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from rankscope.contract import metric
from rankscope.goodput import BUCKETS
from rankscope.report import plots
from rankscope.report.html import Figure as FigureBlock
from rankscope.report.html import Note, Paragraph, Section, Table
from rankscope.report.prom import Prometheus
from rankscope.report.run import RunWindow
from rankscope.report.series import Series

__all__ = [
    "GoodputIncident",
    "breakdown",
    "goodput_section",
    "growth",
    "incidents",
    "query",
    "time_axes",
    "time_figure",
]

#: Buckets that are not progress kept: every bucket but training (lost is the part of training thrown away).
BADPUT = tuple(bucket for bucket in BUCKETS if bucket != "training")
#: Growth below this many seconds between samples is noise of the sampling, not an incident.
MIN_GROWTH_SECONDS = 0.5
#: Growth the section names when it is no incident: the table's precision (one decimal).
SAID_SECONDS = 0.05
_WHAT = {
    "startup": "start-up or restart",
    "lost": "work thrown away (resume or rollback)",
    "checkpoint": "checkpoint save",
    "validation": "validation",
    "paused": "paused",
    "hang": "hang",
}


def query(selector: str) -> str:
    """The run's buckets, one series each (rank 0's, whichever node it ran on)."""
    return f"max by (bucket) ({metric('goodput_seconds_total').name}{{{selector}}})"


@dataclass(frozen=True)
class GoodputIncident:
    bucket: str
    start: float
    end: float
    seconds: float


def breakdown(series: list[Series]) -> dict[str, float]:
    """Bucket -> seconds at the last sample."""
    found = {s.labels.get("bucket", ""): float(s.v[-1]) for s in series if len(s)}
    return {bucket: found[bucket] for bucket in BUCKETS if bucket in found}


def incidents(series: list[Series]) -> list[GoodputIncident]:
    """Stretches over which a badput bucket grew, in time order."""
    found: list[GoodputIncident] = []
    for s in series:
        bucket = s.labels.get("bucket", "")
        if bucket not in BADPUT or len(s) < 2:
            continue
        open_at: float | None = None
        grown = 0.0
        for i in range(1, len(s)):
            growth = float(s.v[i] - s.v[i - 1])
            if growth >= MIN_GROWTH_SECONDS:
                if open_at is None:
                    open_at = float(s.t[i - 1])
                    if bucket == "hang":  # counted whole once past its threshold: it began at its last activity
                        open_at = min(open_at, float(s.t[i]) - growth)
                grown += growth
            elif open_at is not None:
                found.append(GoodputIncident(bucket, open_at, float(s.t[i - 1]), grown))
                open_at, grown = None, 0.0
        if open_at is not None:
            found.append(GoodputIncident(bucket, open_at, float(s.t[-1]), grown))
    return sorted(found, key=lambda incident: incident.start)


def growth(series: list[Series]) -> dict[str, float]:
    """Badput bucket -> seconds it grew over the run's window (its last sample minus its first), where it did."""
    grown = {s.labels.get("bucket", ""): float(s.v[-1] - s.v[0]) for s in series if len(s)}
    return {bucket: grown[bucket] for bucket in BADPUT if grown.get(bucket, 0.0) >= SAID_SECONDS}


def _amounts(seconds: dict[str, float]) -> str:
    return ", ".join(f"{_WHAT.get(bucket, bucket)} {value:.1f} s" for bucket, value in seconds.items())


def _unlisted(series: list[Series], found: list[GoodputIncident]) -> str:
    """What the incidents do not account for: the badput that grew in amounts under an incident's, said so."""
    rest = growth(series)
    for incident in found:
        rest[incident.bucket] = rest.get(incident.bucket, 0.0) - incident.seconds
    rest = {bucket: value for bucket, value in rest.items() if value >= SAID_SECONDS}
    if not found:
        if not rest:
            return "No badput bucket grew during the run's window: no incident."
        return (
            f"No incident (a badput bucket growing by {MIN_GROWTH_SECONDS:g} s or more between two samples), but "
            f"badput grew in smaller amounts over the run's window: {_amounts(rest)}."
        )
    return f"Besides these incidents, badput grew in smaller amounts: {_amounts(rest)}." if rest else ""


def _rank_hours(seconds: float, world_size: int) -> float:
    return seconds * world_size / 3600.0


def _hours_name(on_gpu: bool) -> str:
    """GPU-hours on a GPU run; a CPU run's ranks are processes, and its cost is rank-hours."""
    return "GPU-hours" if on_gpu else "rank-hours"


def _cost_columns(seconds: float, world_size: int, price: float | None) -> list[str]:
    hours = _rank_hours(seconds, world_size)
    cells = [f"{hours:.3f}"]
    if price is not None:
        cells.append(f"{hours * price:,.2f}")
    return cells


def goodput_section(
    prom: Prometheus,
    run: RunWindow,
    world_size: int,
    price_per_gpu_hour: float | None = None,
    *,
    utc: Callable[[float], str] | None = None,
    axis_x: plots.TimeAxis | None = None,
    on_gpu: bool = True,
) -> Section:
    """The section, from Prometheus; a note instead when the run exported no goodput. `axis_x`: the report's
    time axis (default: the run's window); `on_gpu`: the run used GPUs (else its cost is in rank-hours)."""
    series = [s.finite() for s in prom.query_range(query(run.selector), run.start, run.end, run.step)]
    axis_x = axis_x or plots.TimeAxis(run.start, run.end)
    return render_section(series, world_size, price_per_gpu_hour, utc, axis_x=axis_x, on_gpu=on_gpu)


def render_section(
    series: list[Series],
    world_size: int,
    price: float | None,
    utc: Callable[[float], str] | None = None,
    *,
    axis_x: plots.TimeAxis | None = None,
    on_gpu: bool = True,
) -> Section:
    section = Section("goodput", "Goodput")
    totals = breakdown(series)
    if not totals:
        section.blocks.append(
            Note(
                f"No {metric('goodput_seconds_total').name} in Prometheus for this run (goodput off, or rank 0 "
                "not scraped)."
            )  # fmt: skip
        )
        return section
    wall = sum(seconds for bucket, seconds in totals.items() if bucket != "lost")
    productive = totals.get("training", 0.0) - totals.get("lost", 0.0)
    share = productive / wall if wall > 0 else 0.0
    section.blocks.append(
        Paragraph(
            f"Goodput {share:.1%}: {productive:.0f} s of the job's {wall:.0f} s of wall time (every restart "
            f"included) went into training progress that was kept. {world_size} rank(s): "
            f"{_rank_hours(wall, world_size):.3f} {_hours_name(on_gpu)} in all, "
            f"{_rank_hours(wall - productive, world_size):.3f} "
            "of them badput."
        )
    )
    section.blocks.append(
        FigureBlock(
            time_figure(series, axis_x),
            "where the job's time went, cumulative, stacked",
            "Seconds of the job's wall time by bucket as it went by (productive = training kept).",
        )  # fmt: skip
    )
    money = ["cost"] if price is not None else []
    rows = [["productive", f"{productive:.1f}", f"{productive / wall:.1%}" if wall else "-",
             *_cost_columns(productive, world_size, price)]]  # fmt: skip
    for bucket in BADPUT:
        if bucket in totals:
            seconds = totals[bucket]
            rows.append([bucket, f"{seconds:.1f}", f"{seconds / wall:.1%}" if wall else "-",
                         *_cost_columns(seconds, world_size, price)])  # fmt: skip
    section.blocks.append(
        Table(
            ["where the time went", "seconds", "share of wall time", _hours_name(on_gpu), *money],
            rows,
            "lost is training time thrown away; the other rows add up to the wall time",
        )  # fmt: skip
    )
    found = incidents(series)
    unlisted = _unlisted(series, found)
    if not found:
        section.blocks.append(Note(unlisted))
        return section
    when = utc or (lambda t: f"{t:.0f}")
    section.blocks.append(
        Table(
            ["began", "cause", "seconds", _hours_name(on_gpu), *money],
            [
                [
                    when(i.start),
                    _WHAT.get(i.bucket, i.bucket),
                    f"{i.seconds:.1f}",
                    *_cost_columns(i.seconds, world_size, price),
                ]
                for i in found
            ],  # fmt: skip
            "each stretch over which a badput bucket grew (seconds as the ledger counted them)",
        )
    )
    if unlisted:
        section.blocks.append(Note(unlisted))
    return section


_COLOURS = {
    "productive": "#2a9d8f",
    "startup": "#8d99ae",
    "lost": "#e63946",
    "checkpoint": "#457b9d",
    "validation": "#a8dadc",
    "paused": "#f4a261",
    "hang": "#6d2e46",
}


def time_axes(series: list[Series], axis_x: plots.TimeAxis) -> Axes:
    """Stacked cumulative seconds by bucket on the report's time axis (m:ss since the run's first sample),
    productive at the bottom."""
    with matplotlib.rc_context(plots._STYLE):  # the report's style, as every other figure
        return _time_axes(series, axis_x)


def _time_axes(series: list[Series], axis_x: plots.TimeAxis) -> Axes:
    by_bucket = {s.labels.get("bucket", ""): s for s in series if len(s)}
    times = sorted({float(t) for s in by_bucket.values() for t in s.t})
    figure = plots._figure(2.6)
    axes = figure.add_subplot()
    if times:
        at = np.asarray(times)
        values = {bucket: s.at(at) for bucket, s in by_bucket.items()}
        zero = np.zeros(len(at))
        stack = {"productive": values.get("training", zero) - values.get("lost", zero)}
        stack |= {bucket: values[bucket] for bucket in BADPUT if bucket in values}
        axes.stackplot(
            axis_x.x(at),
            *(np.nan_to_num(v) for v in stack.values()),
            labels=list(stack),
            colors=[_COLOURS[name] for name in stack],
        )
        axes.legend(loc="upper left", fontsize=8, ncols=len(stack))
    axes.set_axisbelow(True)  # the grid under the areas
    axis_x.apply(axes)
    axes.set_ylabel("seconds of wall time")
    return axes


def time_figure(series: list[Series], axis_x: plots.TimeAxis | None = None) -> bytes:
    """:func:`time_axes` as PNG; without `axis_x`, from the first sample to the last."""
    if axis_x is None:
        times = [float(t) for s in series for t in s.t]
        axis_x = plots.TimeAxis(min(times, default=0.0), max(times, default=0.0))
    figure = time_axes(series, axis_x).figure
    assert isinstance(figure, Figure)
    return plots.png_bytes(figure)
