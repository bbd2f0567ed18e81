"""The page's sections, built from what Prometheus, the run log and the attention maps hold.

One function per section (:func:`overview`, :func:`training`, :func:`ranks`, :func:`resources`,
:func:`incidents_section`, :func:`analyses`, :func:`attention`) turns the data into blocks of
:mod:`.html` (figures from :mod:`.plots`, tables, notes); :func:`facts` is the header's list.
A part the run has no data for says so in its panel or in a note, never silently disappears.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from rankscope.mixin.config import IMBALANCE_ALERT, Tunables
from rankscope.report import plots
from rankscope.report.analysis import Straggler, align, rate_of_change, rolling_correlation
from rankscope.report.attention import AttentionSnapshot
from rankscope.report.collect import RunData
from rankscope.report.html import Figure, Note, Paragraph, Section, Table
from rankscope.report.incidents import ActionEvent, AlertEpisode, Incidents
from rankscope.report.runlog import RunLog
from rankscope.report.series import Series, broken
from rankscope.report.stops import Stop, find_stops, mask_stops

__all__ = [
    "SECTIONS",
    "STRAGGLER_RATIO",
    "Context",
    "analyses",
    "attention",
    "duration",
    "explain_empty",
    "facts",
    "incidents_section",
    "overview",
    "ranks",
    "resources",
    "training",
    "utc",
]

#: The straggler alert's line of the shipped rules: a rank this much slower than the median is a straggler.
STRAGGLER_RATIO = Tunables().imbalance_ratio
#: The page's definitions of its incident figures (docs/report.md says the same).
FAULT_TO_ACTION = (
    "Fault to action: from the fault's first sign where the report can see one (for the non-finite alert, the "
    "first step with a non-finite loss: its time in the run log, spread evenly between two flushes of the log, "
    "or else the first scrape whose loss was not finite) to the action applied on every rank. Where no first "
    "sign is known it runs from the alert's onset: its first pending evaluation (its first firing one for a rule "
    "without `for`). The column says which, and how the time splits up."
)
SETTLED_BY = (
    "Settled by: the time the action's outcome was settled on every rank. From the run log's action records "
    "(the trainer writes each outcome with its id, step, reason and settle time, as /v1/status reports them) it "
    "is exact; from Prometheus alone it is the first scrape that counted the action, up to a scrape interval "
    "late. Step: the step boundary the action was carried out at (/v1/status's step). Seen in: where the "
    "action is recorded."
)
#: Section ids, in page order.
SECTIONS = ("overview", "training", "ranks", "resources", "incidents", "goodput", "analyses", "attention")


def explain_empty(section: Section, run_id: str) -> Section:
    """A section left with nothing to show says so (every part of the page says why it is empty)."""
    if not section.blocks:
        section.blocks.append(Note(f"Nothing to show for run {run_id}: none of this section's series is in "
                                   "Prometheus for it, and the run log has none of its records."))  # fmt: skip
    return section


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


@dataclass
class Context:
    """Everything the sections draw from, with the pieces several of them share."""

    data: RunData
    log: RunLog | None
    incidents: Incidents
    straggler: Straggler

    def __post_init__(self) -> None:
        self.axis = plots.TimeAxis(self.data.start, self.data.end)
        self.marks = plots.marks_from(self.incidents, self.data.run.interval)
        self.logged = _log_series(self.log)
        data = self.data
        finished = bool(data.finished_ranks and data.finished_ranks >= data.run.ranks)
        self.stops = find_stops(data.get("last_step"), data.run.interval, data.get("step_time"), data.get("phase"),
                                to_the_end=not finished)  # fmt: skip
        self.training = _training_inputs(self.data, self.logged, self.stops)
        self.compute = self.data.get("compute_time")

    def summary_png(self) -> bytes:
        run = self.data.run
        title = f"rankscope run {run.run_id}: {utc(run.start)}, {duration(run.end - run.start)}"
        compute = [mask_stops(s, self.stops) for s in self.compute]
        figure = plots.summary_figure(title, self.training, compute, self.incidents, self.axis, self.straggler,
                                      run.interval)  # fmt: skip
        return plots.png_bytes(figure)


def overview(ctx: Context, summary_png: bytes) -> Section:
    return Section("overview", "Overview", [
        Paragraph(_straggler_words(ctx.straggler, ctx.incidents)),
        Figure(summary_png, "summary: loss, learning rate, compute per rank, incidents",
               "Red bar along the top of a plot: an alert firing. Dashed lines: control actions applied on "
               "every rank."),
    ])  # fmt: skip


def training(ctx: Context) -> Section:
    blocks: list = [_fig(plots.training_figure(ctx.training, ctx.axis, ctx.marks),
                         "loss, accuracy, learning rate, gradient norm")]  # fmt: skip
    if ctx.log is None:
        blocks.append(Note("Without --log the loss is Prometheus's (one point a scrape); with the run log every "
                           "step is drawn."))  # fmt: skip
    else:
        blocks.append(Note("Prometheus's series trail the run log's by up to a scrape interval plus the exporter's "
                           "page cache: on a short run the per-step lines lead by a second or two."))  # fmt: skip
    return Section("training", "Training", blocks)


def ranks(ctx: Context) -> Section:
    data, found = ctx.data, ctx.straggler
    timings = {"step": data.get("step_time"), "compute": ctx.compute, "comm": data.get("comm_time"),
               "data wait": data.get("data_wait")}  # fmt: skip
    blocks: list = [
        Paragraph(_straggler_words(found, ctx.incidents)),
        _fig(
            plots.rank_timings_figure(timings, ctx.axis, found, ctx.marks, ctx.stops, data.get("last_step")),
            "step, compute, comm and data wait per rank, and the time since each rank's last step",
            "Timings are means over the rate window. Grey: a stretch in which a rank made no step (from its last "
            "step, rankscope_last_step_timestamp_seconds); the lines break there.",
        ),
        _fig(
            plots.rank_small_multiples_figure(ctx.compute, ctx.axis, found, ctx.stops),
            "compute time, one panel per rank",
        ),  # fmt: skip
        _fig(
            plots.rank_heatmap_figure([mask_stops(s, ctx.stops, gaps=False) for s in ctx.compute], ctx.axis),
            "compute time against the other ranks, rank by time",
        ),  # fmt: skip
    ]
    if len(found.ranking) > 1:
        rows = [[str(rank), f"{ratio:.2f}x"] for rank, ratio in found.ranking[:8]]
        blocks.append(Table(["rank", "compute / other ranks' median (90th percentile)"], rows, caption="Slowest ranks"))
    return Section("ranks", "Ranks", blocks)


def resources(ctx: Context) -> Section:
    data = ctx.data

    def sampled(name: str) -> list[Series]:  # measured while the process lives: broken only where not sampled
        return [mask_stops(s, ()) for s in data.get(name)]

    def stepped(name: str) -> list[Series]:  # made by steps: broken where a rank made none, too
        return [mask_stops(s, ctx.stops) for s in data.get(name)]

    inputs = plots.ResourceInputs(
        host_memory=sampled("host_memory"),
        process_memory=sampled("process_memory"),
        device_memory=sampled("device_memory"),
        gpu_utilization=sampled("gpu_utilization"),
        samples_rate=next(iter(stepped("samples_rate")), None),
        tokens_rate=next(iter(stepped("tokens_rate")), None),
        host_load=sampled("host_load"),
        step_time=stepped("step_time"),
    )
    figure = plots.resources_figure(inputs, ctx.axis, ctx.marks)
    alt = "host, process and device memory, GPU use, throughput, the host's CPU load"
    return Section("resources", "Resources", [_fig(figure, alt)])


def incidents_section(ctx: Context) -> Section:
    figure = plots.incidents_figure(ctx.incidents, ctx.axis, ctx.data.run.interval)
    return Section("incidents", "Incidents", [
        _fig(figure, "timeline of alerts and actions"),
        *_incident_tables(ctx.incidents, ctx.data.start),
        Paragraph(FAULT_TO_ACTION),
        Paragraph(SETTLED_BY),
    ])  # fmt: skip


def analyses(ctx: Context) -> Section:
    x, slope, unit, window = _loss_rate(ctx.data, ctx.log)
    cx, correlation, cwindow = _lr_loss_correlation(ctx.data, ctx.log)
    # Not drawn across a stretch in which a rank made no step (there is no rate of change to speak of there).
    rate = mask_stops(Series({}, x, slope), ctx.stops, gaps=False)
    together = mask_stops(Series({}, cx, correlation), ctx.stops, gaps=False)
    x, slope, cx, correlation = rate.t, rate.v, together.t, together.v
    pairs, x_label, y_label = _memory_pairs(ctx.data)
    return Section("analyses", "Analyses", [
        _fig(plots.loss_rate_figure(x, slope, ctx.axis, unit, window, ctx.marks), "loss rate of change"),
        _fig(plots.correlation_figure(cx, correlation, ctx.axis, cwindow, ctx.marks), "learning rate-loss correlation"),
        _fig(plots.memory_vs_length_figure(pairs, x_label, y_label), "memory against sequence length"),
    ])  # fmt: skip


def attention(snapshots: list[AttentionSnapshot], skipped: list[str], where: Path | None) -> Section:
    return Section("attention", "Attention maps", _attention_blocks(snapshots, skipped, where))


# --- helpers -------------------------------------------------------------------------------------------


def _log_series(log: RunLog | None) -> dict[str, Series]:
    if log is None:
        return {}
    train, val = log.train(), log.val()
    out: dict[str, Series] = {}
    if len(train["step"]):
        # A NaN between the stretches that trained (a hang or a restart lies between them): the line breaks.
        for key, name in (("loss", "train loss"), ("lr", "learning rate")):
            keep = np.isfinite(train["time"]) & np.isfinite(train[key])
            out[key] = broken(Series({}, train["time"][keep], train[key][keep], name), train["segment"][keep])
    if len(val["step"]):
        out["val"] = Series({}, val["time"], val["loss"], "validation loss").finite()
    return out


# --- analyses -----------------------------------------------------------------------------------------


def _analysis_window(count: int, minimum: int = 8) -> int:
    return int(min(200, max(minimum, count // 12)))


def _loss_rate(data: RunData, log: RunLog | None) -> tuple[np.ndarray, np.ndarray, str, str]:
    """(times, slope, unit, window words): per step from the run log, else per second from Prometheus."""
    if log is not None:
        train = log.train()
        keep = np.isfinite(train["loss"]) & np.isfinite(train["time"]) & np.isfinite(train["step"])
        steps, loss, times = train["step"][keep], train["loss"][keep], train["time"][keep]
        window = _analysis_window(len(steps))
        if len(steps) >= window:
            _, slope = rate_of_change(steps, loss, window)
            return times[window - 1 :], slope, "step", f"{window} steps"
    s = next((x for x in data.get("loss") if x.labels.get("split") == "train"), None)
    if s is None or len(s) < 8:
        return np.array([]), np.array([]), "s", ""
    window = _analysis_window(len(s))
    x, slope = rate_of_change(s.t, s.v, window)
    return x, slope, "s", duration(window * data.run.step)


def _lr_loss_correlation(data: RunData, log: RunLog | None) -> tuple[np.ndarray, np.ndarray, str]:
    if log is not None:
        train = log.train()
        keep = np.isfinite(train["loss"]) & np.isfinite(train["lr"]) & np.isfinite(train["time"])
        if keep.sum() >= 8:
            window = _analysis_window(int(keep.sum()), minimum=10)
            return train["time"][keep], rolling_correlation(train["lr"][keep], train["loss"][keep], window), \
                f"{window} steps"  # fmt: skip
    lr = next((s for s in data.get("learning_rate") if s.labels.get("param_group") in ("0", None)), None)
    loss = next((s for s in data.get("loss") if s.labels.get("split") == "train"), None)
    if lr is None or loss is None:
        return np.array([]), np.array([]), ""
    times = np.intersect1d(lr.t, loss.t)
    if len(times) < 10:
        return np.array([]), np.array([]), ""
    window = _analysis_window(len(times), minimum=10)
    return times, rolling_correlation(lr.at(times), loss.at(times), window), duration(window * data.run.step)


def _memory_pairs(data: RunData) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], str, str]:
    """Per rank: (sequence length, memory) at shared times; the memory is device memory where there is some."""
    device = [s for s in data.get("device_memory") if s.labels.get("kind") == "allocated"]
    memory, y_label = (device, "device memory allocated") if device else (data.get("process_memory"), "process RSS")
    lengths, x_label = data.get("text_length"), "mean caption length per step (tokens)"
    if not lengths:
        lengths, x_label = data.get("tokens_per_step"), "tokens per step (excluding padding)"
    by_rank = {s.rank: s for s in memory if s.rank is not None}
    pairs = {}
    for s in lengths:
        if s.rank in by_rank:
            pairs[s.rank] = align(s, by_rank[s.rank])
    return {r: p for r, p in pairs.items() if len(p[0])}, x_label, y_label


# --- sections -----------------------------------------------------------------------------------------


def _fig(figure: object, alt: str, caption: str = "") -> Figure:
    return Figure(plots.png_bytes(figure), alt, caption)  # type: ignore[arg-type]


def _training_inputs(data: RunData, logged: dict[str, Series], stops: list[Stop]) -> plots.TrainingInputs:
    """Prometheus's per-step series break where a rank made no step (their gauges hold the last step's values),
    and the validation line does not run across a stop."""

    def get(name: str) -> list[Series]:
        return [mask_stops(s, stops) for s in data.get(name)]

    loss = {s.labels.get("split"): s for s in data.get("loss")}
    if "train" in loss:
        loss["train"] = mask_stops(loss["train"], stops)
    val_points = logged.get("val")
    grad_norm = get("grad_norm")
    return plots.TrainingInputs(
        train_loss=loss.get("train"),
        val_loss=mask_stops(loss["val"], stops, gaps=False) if "val" in loss else None,
        per_step_loss=logged.get("loss"),
        val_points=mask_stops(val_points, stops, gaps=False) if val_points is not None else None,
        accuracy=get("accuracy"),
        learning_rate=get("learning_rate"),
        per_step_lr=logged.get("lr"),
        grad_norm=grad_norm[0] if grad_norm else None,
    )


def _straggler_words(found: Straggler, incidents: Incidents) -> str:
    named = sorted({e.labels.get("rank", "?") for e in incidents.episodes if e.alertname == IMBALANCE_ALERT})
    alert = f" {IMBALANCE_ALERT} fired for rank {', '.join(named)}." if named else ""
    if found.rank is None:
        return "No per-rank compute series: the straggler cannot be named." + alert
    if len(found.ranking) < 2:
        return "A single rank: there is no straggler to name." + alert
    if found.stands_out:
        return (
            f"Straggler: rank {found.rank}. Its compute time was {found.ratio:.2f}x the other ranks' median "
            f"(90th percentile over the run; the imbalance alert's line is {found.threshold:g}x).{alert}"
        )
    return (
        f"No straggler: every rank's compute time stayed within {found.threshold:g}x the other ranks' median "
        f"(the slowest, rank {found.rank}, reached {found.ratio:.2f}x).{alert}"
    )


def _episode_state(episode: AlertEpisode) -> str:
    if episode.active:
        return "still active"
    return "fired, resolved" if episode.firing_at is not None else "pending only"


def _latency(event: ActionEvent) -> str:
    """Fault to action, from where it is measured, with where the time went."""
    value, cause = event.fault_to_action, event.cause
    if value is None or cause is None:
        return "-"
    parts = []
    if event.first_sign is not None:
        step = f" (step {event.first_sign_step})" if event.first_sign_step is not None else ""
        parts.append(f"from {event.first_sign_what}{step}; to the alert {cause.onset - event.first_sign:.1f} s")
    else:
        parts.append("from the alert's onset")
    if cause.pending_at is not None and cause.firing_at is not None:
        parts.append(f"pending {cause.firing_at - cause.pending_at:.1f} s")
    if cause.firing_at is not None:
        parts.append(f"firing to applied {event.at - cause.firing_at:.1f} s")
    return f"{value:.1f} s ({', '.join(parts)})"


def _incident_tables(incidents: Incidents, start: float) -> list[Table | Note]:
    def since(t: float | None) -> str:
        return "" if t is None else plots.clock(t - start)

    episodes = Table(
        ["alert", "where", "severity", "action label", "pending at", "firing at", "last seen", "state"],
        [[e.alertname, e.where or "run", e.severity, e.action or "-", since(e.pending_at), since(e.firing_at),
          since(e.ended_at), _episode_state(e)] for e in incidents.episodes],
        caption="Alert episodes (times since the run's first sample; from Prometheus's ALERTS series)",
    )  # fmt: skip
    actions = Table(
        ["action", "source", "result", "settled by", "step", "reason", "caused by", "fault to action", "seen in"],
        [[a.action, a.source, a.result, since(a.at), "" if a.step is None else str(a.step),
          (a.reason or "-") + (f" ({a.detail})" if a.detail else ""),
          a.cause.title if a.cause is not None else "-", _latency(a), " + ".join(a.evidence)]
         for a in incidents.actions],
        caption="Control actions (rankscope_control_actions_total, sharpened by the run log where it has them)",
    )  # fmt: skip
    blocks: list = [t for t in (episodes, actions) if t.rows]
    if not episodes.rows:
        blocks.append(Note("No alert was pending or firing during this run: Prometheus's ALERTS series has no "
                           "sample with its run_id (is the rule pack loaded? `promtool check rules`)."))  # fmt: skip
    if not actions.rows:
        blocks.append(Note("No control action was settled during this run: rankscope_control_actions_total "
                           "never increased and the run log has no action record."))  # fmt: skip
    return blocks


def _attention_blocks(snapshots: list[AttentionSnapshot], skipped: list[str], where: Path | None) -> list:
    blocks: list = []
    if not snapshots:
        if where is None:
            blocks.append(Note("No attention maps: give the run log (--log) or --attention DIR to show them."))
        else:
            blocks.append(Note(f"No attention maps in {where} (the trainer saves them at validation time into "
                               "attention/ beside its run log; run.attention_maps sets how many)."))  # fmt: skip
    else:
        blocks.append(Paragraph(
            "The first validation samples of rank 0, at the first and at the latest validation. Top: each input "
            "image beside its class token's attention over the image patches (last ViT layer, mean over heads; "
            "bright = more attention). Below: the caption's token-to-token attention (last text layer, mean over "
            "heads; a row is the attending token, a column the token attended to)."
        ))  # fmt: skip
        chosen = [snapshots[0]] + ([snapshots[-1]] if len(snapshots) > 1 else [])
        for snapshot in chosen:
            blocks.append(_fig(plots.attention_figure(snapshot), f"attention maps at step {snapshot.step}"))
    blocks += [Note(f"skipped {line}") for line in skipped]
    return blocks


def _state(data: RunData, log: RunLog | None) -> str:
    if data.finished_ranks and data.finished_ranks >= data.run.ranks:
        stopped = [r.get("stopped") for r in (log.of("finished") if log else []) if r.get("stopped")]
        return f"finished (stopped: {stopped[-1]})" if stopped else "finished"
    if data.run.live:
        return "live: still training (run the report again for a newer picture)"
    return "ended without finishing cleanly (crashed, killed, or no longer scraped)"


def facts(data: RunData, log: RunLog | None, incidents: Incidents, found: Straggler) -> list[tuple[str, str]]:
    """The header: what the run was, in a few lines."""
    logged = _log_series(log)
    run = data.run
    info = data.info
    facts = [
        ("run_id", run.run_id),
        ("state", _state(data, log)),
        ("when", f"{utc(run.start)[:-4]} to {utc(run.end)[11:]}"),
        ("duration", duration(run.end - run.start)),
        ("ranks", f"{run.ranks}" + (f" (world size {info['world_size']})" if "world_size" in info else "")),
        ("steps", f"up to {run.max_step}"),
        ("scrape interval", f"{run.interval:g} s (resolution {run.step:g} s)"),
    ]
    # A CUDA build's version says nothing about a run that used no GPU (no device series).
    keys = ("model", "backend", "torch_version", *(("cuda_version",) if data.on_gpu else ()), "config_hash")
    facts += [(key, info[key]) for key in keys if key in info]
    loss = logged.get("loss") or next((s for s in data.get("loss") if s.labels.get("split") == "train"), None)
    if loss is not None and len(loss):
        facts.append(("last train loss", f"{loss.v[-1]:.4g}"))
    val = logged.get("val") or next((s for s in data.get("loss") if s.labels.get("split") == "val"), None)
    if val is not None and len(val):
        facts.append(("best validation loss", f"{np.nanmin(val.v):.4g}"))
    rate = data.one("samples_rate")
    if rate is not None:
        facts.append(("throughput", f"{np.nanmedian(rate.v):.4g} samples/s (median)"))
    firing = [e for e in incidents.episodes if e.firing_at is not None]
    facts.append(
        (
            "alerts fired",
            str(len(firing)) + (f" ({', '.join(sorted({e.alertname for e in firing}))})" if firing else ""),
        )
    )
    applied = [a for a in incidents.actions if a.result == "applied"]
    facts.append(
        ("actions applied", str(len(applied)) + (f" ({', '.join(a.action for a in applied)})" if applied else ""))
    )
    if found.stands_out:
        facts.append(("straggler", f"rank {found.rank} ({found.ratio:.2f}x the other ranks' median)"))
    elif len(found.ranking) > 1:
        facts.append(("straggler", "none"))
    return facts
