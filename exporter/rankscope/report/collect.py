"""Every query the report asks Prometheus, in one place, and the answers as :class:`Series`.

Range queries (`RANGE_QUERIES`) are evaluated over the run's window at its
resolution; `$SEL` is the run's label matcher and `$W` the rate window (see
:class:`.run.RunWindow`). Timings per rank are means over the rate window
(rate of the histogram's sum over rate of its count), computed here from the
raw histograms rather than read from recording rules, so the report works
against a Prometheus that does not load rankscope's rules. Events (alerts,
control actions, checkpoints) are read as raw samples (`RAW_QUERIES`), so no
evaluation step can hide a short one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from rankscope.report.prom import Prometheus
from rankscope.report.run import RunWindow
from rankscope.report.series import Series, by_rank

__all__ = ["RANGE_QUERIES", "RAW_QUERIES", "RunData", "collect", "fill"]


def _mean(histogram: str, by: str = "rank, node") -> str:
    return (
        f"sum by ({by}) (rate({histogram}_sum{{$SEL}}[$W])) / (sum by ({by}) (rate({histogram}_count{{$SEL}}[$W])) > 0)"
    )


#: name -> PromQL, with `$SEL` the run's label matcher and `$W` the rate window. Per-rank series keep
#: `rank` and `node`.
RANGE_QUERIES: dict[str, str] = {
    "loss": "avg by (split) (rankscope_loss{$SEL})",
    "loss_by_rank": 'max by (rank, node) (rankscope_loss{$SEL, split="train"})',
    "accuracy": "avg by (split, direction) (rankscope_contrastive_accuracy_ratio{$SEL})",
    "learning_rate": "max by (param_group) (rankscope_learning_rate{$SEL})",
    "grad_norm": "max(rankscope_grad_norm{$SEL})",
    "step_time": _mean("rankscope_step_duration_seconds"),
    "compute_time": _mean("rankscope_compute_duration_seconds"),
    "comm_time": _mean("rankscope_comm_duration_seconds"),
    "data_wait": _mean("rankscope_data_wait_seconds"),
    "host_memory": "max by (node) (rankscope_host_memory_used_ratio{$SEL})",
    "host_load": "max by (node) (rankscope_host_cpu_load_ratio{$SEL})",
    "process_memory": "max by (rank, node) (rankscope_process_resident_memory_bytes{$SEL})",
    "device_memory": "max by (rank, node, kind) (rankscope_device_memory_bytes{$SEL})",
    "gpu_utilization": "max by (rank, node) (rankscope_gpu_utilization_ratio{$SEL})",
    "samples_rate": "sum(rate(rankscope_samples_total{$SEL}[$W]))",
    "tokens_rate": "sum(rate(rankscope_tokens_total{$SEL}[$W]))",
    "steps_rate": "avg(rate(rankscope_steps_total{$SEL}[$W]))",
    "text_length": _mean("rankscope_text_length_tokens"),
    "tokens_per_step": (
        "sum by (rank, node) (rate(rankscope_tokens_total{$SEL}[$W]))"
        " / (sum by (rank, node) (rate(rankscope_steps_total{$SEL}[$W])) > 0)"
    ),
    "global_step": "max(rankscope_global_step{$SEL})",
    "last_step": "max by (rank, node) (rankscope_last_step_timestamp_seconds{$SEL})",
    "phase": "max by (rank, node) (rankscope_phase{$SEL})",
    "paused": "max(rankscope_paused{$SEL})",
}

#: name -> a range selector over `$D` (the whole window), read as raw samples.
RAW_QUERIES: dict[str, str] = {
    "alerts": "ALERTS{$SEL}[$D]",
    "actions": "rankscope_control_actions_total{$SEL}[$D]",
    "checkpoints": "rankscope_checkpoints_total{$SEL}[$D]",
}

#: Alerts may come after the last step (a dead rank pages minutes later): read this far past it.
ALERT_TAIL_SECONDS = 30 * 60


def fill(template: str, **values: str) -> str:
    """A query template with its `$NAME` placeholders replaced (SEL, W, D)."""
    for name, value in values.items():
        template = template.replace(f"${name.upper()}", value)
    return template


@dataclass
class RunData:
    """What Prometheus holds about one run, ready to plot."""

    run: RunWindow
    start: float
    """Start of the report's time axis (the run's first sample)."""
    end: float
    """End of the axis: the last sample, or a little after the last alert that began after it."""
    events_end: float = 0.0
    """Where the alert and action samples end (now, or half an hour after the last step)."""
    series: dict[str, list[Series]] = field(default_factory=dict)
    raw: dict[str, list[Series]] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    """Labels of rankscope_run_info (world size, backend, model, torch and CUDA versions...)."""
    finished_ranks: int = 0
    """Ranks whose last rankscope_run_finished was 1 (they finished cleanly)."""

    def get(self, name: str) -> list[Series]:
        """The finite series of a range query (empty if Prometheus had none)."""
        return [s for s in (x.finite() for x in self.series.get(name, [])) if len(s)]

    @property
    def on_gpu(self) -> bool:
        """The run used accelerators: it has device series (a CUDA build alone says nothing)."""
        return bool(self.get("device_memory") or self.get("gpu_utilization"))

    def one(self, name: str) -> Series | None:
        found = self.get(name)
        return found[0] if found else None


def collect(prom: Prometheus, run: RunWindow, now: float | None = None) -> RunData:
    """Ask every query of this module for `run` (about two dozen HTTP requests)."""
    now = time.time() if now is None else now
    step = run.step
    start = math.floor(run.start / step) * step  # aligned, so every series shares one time grid
    end = math.ceil(run.end / step) * step
    data = RunData(run, run.start, run.end)
    for name, template in RANGE_QUERIES.items():
        expr = fill(template, sel=run.selector, w=run.rate_window)
        data.series[name] = by_rank(prom.query_range(expr, start, end, step))
    events_end = data.events_end = min(now, run.end + ALERT_TAIL_SECONDS)
    span = f"{max(1, math.ceil(events_end - run.start + 2 * run.interval))}s"
    for name, template in RAW_QUERIES.items():
        data.raw[name] = by_rank(prom.query(fill(template, sel=run.selector, d=span), events_end))
    info = prom.query(f"last_over_time(rankscope_run_info{{{run.selector}}}[{span}])", events_end)
    if info:
        skip = ("__name__", "rank", "local_rank", "instance", "job", "node")
        data.info = {k: v for k, v in info[0].labels.items() if k not in skip}
    finished = prom.query(f"last_over_time(rankscope_run_finished{{{run.selector}}}[{span}])", events_end)
    data.finished_ranks = sum(1 for s in finished if len(s) and s.v[-1] == 1)
    # The axis reaches as far as alerts *began* after the last step (a dead rank pages minutes later), not
    # as far as they last: a rule with a long window keeps firing long after a short run.
    onsets = [float(s.t[0]) for s in data.raw["alerts"] if len(s)]
    data.end = min(events_end, max([run.end, *(t + 5 * run.interval for t in onsets)]))
    return data
