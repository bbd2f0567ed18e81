"""Putting the report together: Prometheus + run log + attention maps -> sections -> one HTML page.

    report = build_report(ReportRequest("http://127.0.0.1:9090", Path("report.html"), log=Path(".stack/log.jsonl")))

Writes `out` (self-contained HTML) and the PNG summary beside it (`out` with
`.png`), and returns what it wrote and what it found.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.report import sections
from rankscope.report.analysis import straggler
from rankscope.report.attention import read_attention_maps
from rankscope.report.campaign import campaign_section
from rankscope.report.collect import RunData, collect
from rankscope.report.errors import ReportError
from rankscope.report.goodput import goodput_section
from rankscope.report.html import Note, render_page
from rankscope.report.incidents import find_incidents
from rankscope.report.prom import Prometheus
from rankscope.report.run import find_run
from rankscope.report.runlog import RunLog, read_run_log

__all__ = ["Report", "ReportRequest", "build_report", "summary_path"]

#: Attention maps this much outside the run's window belong to another run of the same directory.
ATTENTION_SLACK_SECONDS = 60.0


@dataclass(frozen=True)
class ReportRequest:
    prometheus: str
    out: Path
    run_id: str | None = None
    log: Path | None = None
    attention: Path | None = None
    """Directory of attention maps; default: `attention/` beside the run log."""
    timeout: float = 30.0
    price_per_gpu_hour: float | None = None
    """Shows the goodput section's costs in money too."""
    campaign: Path | None = None
    """A fault campaign's --json file: its table becomes a section."""


@dataclass
class Report:
    """What was written, and the facts a caller (the CLI, a test) may want to print."""

    html: Path
    png: Path
    run_id: str
    sections: list[str] = field(default_factory=list)
    alerts: int = 0
    actions: int = 0
    images: int = 0


def summary_path(out: Path) -> Path:
    """Where the PNG summary of a report at `out` goes."""
    return out.with_suffix(".png")


def _log_for_run(log: RunLog, data: RunData) -> RunLog:
    """The records written during this run (a demo's log holds every run it was used for)."""
    margin = 2 * data.run.interval + 10.0
    lo, hi = data.run.start - margin, data.end + margin
    kept = [r for r in log.records if isinstance(r.get("time"), int | float) and lo <= r["time"] <= hi]
    return RunLog(log.path, kept)


def _world_size(data: RunData) -> int:
    """The run's world size from rankscope_run_info (1 where it is missing)."""
    try:
        return max(1, int(data.info.get("world_size", "1")))
    except ValueError:
        return 1


def build_report(request: ReportRequest, now: float | None = None) -> Report:
    """Build and write the report (see the module docstring); ReportError for anything the user must fix."""
    now = time.time() if now is None else now
    log = read_run_log(request.log) if request.log is not None else None  # fail fast on a bad path
    # Read and drawn before Prometheus is asked: a bad file fails in one line, at once.
    campaign = campaign_section(request.campaign) if request.campaign is not None else None
    prom = Prometheus(request.prometheus, timeout=request.timeout)
    run = find_run(prom, request.run_id, now)
    data = collect(prom, run, now)
    if log is not None:
        log = _log_for_run(log, data)
    attention_dir = request.attention or (request.log.parent / "attention" if request.log is not None else None)
    snapshots, skipped = read_attention_maps(attention_dir) if attention_dir is not None else ([], [])
    # Only this run's: the directory outlives runs, like the log.
    slack = ATTENTION_SLACK_SECONDS
    snapshots = [s for s in snapshots if run.start - slack <= s.time <= data.end + slack]
    incidents = find_incidents(
        data.raw.get("alerts", []), data.raw.get("actions", []), interval=run.interval, end=data.events_end, log=log,
        global_step=data.one("global_step"), paused=data.one("paused"),
        loss=next((s for s in data.series.get("loss", []) if s.labels.get("split") == "train"), None),  # NaNs kept
    )  # fmt: skip
    ctx = sections.Context(data, log, incidents, straggler(data.get("compute_time"), sections.STRAGGLER_RATIO))
    summary_png = ctx.summary_png()
    page_sections = [
        sections.overview(ctx, summary_png),
        sections.training(ctx),
        sections.ranks(ctx),
        sections.resources(ctx),
        sections.incidents_section(ctx),
        goodput_section(
            prom,
            run,
            _world_size(data),
            request.price_per_gpu_hour,
            utc=sections.utc,
            axis_x=ctx.axis,
            on_gpu=data.on_gpu,
        ),
        sections.analyses(ctx),
        sections.attention(snapshots, skipped, attention_dir),
    ]
    if campaign is not None:
        page_sections.append(campaign)
    page_sections = [sections.explain_empty(s, run.run_id) for s in page_sections]
    if log is not None and not log.records:
        note = f"The run log {request.log} has no record from this run's time window (another run's log?)."
        page_sections[0].blocks.insert(0, Note(note + " Only Prometheus's data is shown."))
    subtitle = (
        f"from {request.prometheus}" + (f" and {request.log}" if request.log else "") + f", made {sections.utc(now)}"
    )
    page = render_page(f"rankscope run report: {run.run_id}", subtitle,
                       sections.facts(data, log, incidents, ctx.straggler), page_sections)  # fmt: skip
    out = request.out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page)
        summary_path(out).write_bytes(summary_png)
    except OSError as exc:
        raise ReportError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    return Report(
        html=out,
        png=summary_path(out),
        run_id=run.run_id,
        sections=[s.id for s in page_sections],
        alerts=len([e for e in incidents.episodes if e.firing_at is not None]),
        actions=len([a for a in incidents.actions if a.result == "applied"]),
        images=page.count("data:image/png;base64,"),
    )
