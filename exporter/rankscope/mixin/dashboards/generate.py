"""The three rankscope dashboards (``grafana/dashboards/*.json``), written by ``rankscope-mixin``.

Every metric comes from the contract (``rankscope.contract``) through
:func:`rankscope.mixin.dashboards.panels.m`; every alert threshold drawn or quoted comes from the
config (:mod:`rankscope.mixin.config`) and every recorded series' name from
:mod:`rankscope.mixin.promql`. Panels that read a metric only a GPU run exposes are tagged
``requires:gpu`` automatically; the end-to-end test reads that tag
(see :mod:`rankscope.mixin.dashboards.queries`).

Queries are written for short runs too: everything is a rate over
``$__rate_interval`` (four scrapes), and counters whose series only appear with
their first event (actions, checkpoints, errors) fall back to ``vector(0)``,
so "nothing happened" shows as 0 rather than as "No data".
"""

from __future__ import annotations

from rankscope.contract import PHASES
from rankscope.mixin import promql
from rankscope.mixin.config import Tunables
from rankscope.mixin.dashboards.panels import (
    FIRING_ALERTS,
    RANK_SEL,
    RATE,
    RUN_SEL,
    Target,
    dashboard,
    heatmap,
    m,
    quantile,
    stat,
    state_timeline,
    timeseries,
    to_json,
)

# --- shared PromQL -----------------------------------------------------------


def rate_sum(name: str, by: str = "", sel: str = RANK_SEL, series: str = "") -> str:
    """``sum [by (...)] (rate(name{sel}[$__rate_interval]))``."""
    grouping = f" by ({by})" if by else ""
    full = m(name, series) if series else m(name)
    return f"sum{grouping} (rate({full}{{{sel}}}[{RATE}]))"


def share(part: str, whole: str, by: str = "", sel: str = RANK_SEL) -> str:
    """Fraction of `whole`'s time spent in `part` (two histograms' _sum rates)."""
    return f"{rate_sum(part, by, sel, 'sum')} / {rate_sum(whole, by, sel, 'sum')}"


def mean(name: str, by: str = "", sel: str = RANK_SEL) -> str:
    """The exact mean of a histogram's or summary's observations over the rate window (_sum over _count)."""
    return f"{rate_sum(name, by, sel, 'sum')} / {rate_sum(name, by, sel, 'count')}"


def events(name: str, by: str = "", sel: str = RUN_SEL) -> str:
    """Events per rate window of a counter; 0 until the first event creates the series."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (increase({m(name)}{{{sel}}}[{RATE}])) or vector(0)"


# Run-level panels read the recording rules of prometheus/rules/ (by the names of
# rankscope.mixin.promql): at thousands of ranks a
# panel that aggregated every rank's series at every point of its range would cost
# Prometheus more than all the rules. Imbalance and straggler panels show exactly the
# series the RankscopeRankImbalance alert fires on, built on per-rank compute time
# (step - comm - data wait): the all-reduce makes step time equal on all DDP ranks,
# compute time is what differs. Per-rank panels compute from the raw series, for the
# ranks selected. Every threshold drawn or quoted is the alert's own (the config's Tunables);
# render() sets T to the tunables it is given.
T = Tunables()
IMBALANCE, STRAGGLER = promql.IMBALANCE, promql.STRAGGLER


def _rec(series: str, sel: str = RUN_SEL) -> str:
    """A recorded series (a name the rule generator defines) with a label selector."""
    return f"{series}{{{sel}}}"


def _pct(share: float) -> str:
    """A 0..1 threshold as the alerts' descriptions write it: 0.85 -> "85%"."""
    return f"{share:.0%}"


#: Each rank's compute seconds per step: its compute seconds per second over the run's steps per second.
COMPUTE_PER_STEP = f"{_rec(promql.COMPUTE_BUSY, RANK_SEL)} / on (run_id) group_left () {_rec(promql.STEPS_RATE)}"
#: Each rank over the median rank (the straggler ratio of every rank).
RATIO_TO_MEDIAN = (
    f"{_rec(promql.COMPUTE_BUSY, RANK_SEL)} / on (run_id) group_left () "
    f"({_rec(promql.COMPUTE_MEDIAN)} * on (run_id) {_rec(promql.STEPS_RATE)})"
)

# --- dashboards ----------------------------------------------------------------


def run_overview() -> dict:
    return dashboard(
        "rankscope-run-overview",
        "rankscope / Run overview",
        "One training run at a glance: progress, optimisation, speed, balance, memory, alerts and actions.",
        [
            (
                "Run",
                [
                    stat("Global step", "none", Target(f"max({m('global_step')}{{{RUN_SEL}}})")),
                    stat(
                        "Ranks reporting",
                        "none",
                        Target(f"count({m('run_info')}{{{RUN_SEL}}})"),
                        description="Ranks whose /metrics Prometheus scraped recently.",
                    ),
                    stat("Samples per second", "suffix:samples/s", Target(_rec(promql.SAMPLES_RATE))),
                    stat(
                        "Since last step",
                        "s",
                        Target(f"time() - min({m('last_step_timestamp_seconds')}{{{RUN_SEL}}})"),
                        description="Age of the slowest rank's last completed step; grows when the run stalls.",
                    ),
                    stat(
                        "Firing alerts",
                        "none",
                        Target(f"count({FIRING_ALERTS}) or vector(0)"),
                        description="Alerts of this run that are firing now (markers on the graphs below).",
                    ),
                    stat("Paused", "bool_yes_no", Target(f"max({m('paused')}{{{RUN_SEL}}})")),
                ],
            ),
            (
                "Optimisation",
                [
                    timeseries(
                        "Loss",
                        "none",
                        Target(f"{m('loss')}{{{RANK_SEL}}}", "{{split}} rank {{rank}}"),
                        description="Latest loss per rank and split (train, val).",
                    ),
                    timeseries(
                        "Contrastive accuracy",
                        "percentunit",
                        Target(
                            f"{m('contrastive_accuracy_ratio')}{{{RANK_SEL}}}",
                            "{{split}} {{direction}} rank {{rank}}",
                        ),
                        description="In-batch retrieval accuracy (image to text and text to image).",
                        min_val=0,
                        max_val=1,
                    ),
                    timeseries(
                        "Gradient norm",
                        "none",
                        Target(f"{m('grad_norm')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        description="Total L2 norm before clipping. Alerts fire above "
                        f"{promql.num(T.grad_norm_explosion)} (for {T.grad_explosion_for}) and below "
                        f"{promql.num(T.grad_norm_vanishing)} (for {T.grad_vanishing_for}).",
                        log=True,
                        threshold=(T.grad_norm_vanishing, T.grad_norm_explosion),
                    ),
                    timeseries(
                        "Learning rate",
                        "sci",
                        Target(f"max by (param_group) ({m('learning_rate')}{{{RUN_SEL}}})", "group {{param_group}}"),
                        description="Per optimizer parameter group; reduce_lr actions show as steps down.",
                    ),
                    timeseries(
                        "Loss rate of change",
                        "percentunit",
                        Target(_rec(promql.LOSS_CHANGE), f"train, per {promql.LOSS_CHANGE_STEPS} steps"),
                        description=f"Change of the smoothed training loss per {promql.LOSS_CHANGE_STEPS} steps, as a "
                        f"share of its level: the least-squares slope over the last {T.loss_change_window} "
                        "(recording rule); below 0 the loss improves. The plateau alert "
                        f"({T.loss_plateau_severity}) fires above -{_pct(T.loss_plateau_improvement)} for "
                        f"{T.loss_plateau_for}.",
                        w=24,
                    ),
                ],
            ),
            (
                "Speed and balance",
                [
                    timeseries(
                        "Throughput",
                        "suffix:samples/s",
                        Target(_rec(promql.SAMPLES_RATE), "run"),
                        Target(rate_sum("samples_total", "rank"), "rank {{rank}}"),
                    ),
                    timeseries(
                        "Step time",
                        "s",
                        Target(_rec(promql.STEP_QUANTILES[0.5]), "p50"),
                        Target(_rec(promql.STEP_QUANTILES[0.99]), "p99"),
                        description="Whole iterations (recorded from local rank 0 of each node: under DDP every "
                        "rank's step takes the same time). See Ranks for who is slow.",
                    ),
                    timeseries(
                        "Imbalance (slowest / median rank compute time)",
                        "suffix:x",
                        Target(_rec(IMBALANCE), "imbalance"),
                        description="1 is perfectly balanced. Compute time = step - comm - data wait, per rank "
                        f"(recording rule). The straggler alert ({T.imbalance_severity}) fires above "
                        f"{promql.num(T.imbalance_ratio)} for {T.imbalance_for}.",
                        threshold=T.imbalance_ratio,
                    ),
                    timeseries(
                        "Communication and data-wait share",
                        "percentunit",
                        Target(_rec(promql.COMM_SHARE), "comm"),
                        Target(share("data_wait_seconds", "step_duration_seconds", sel=RUN_SEL), "data wait"),
                        description="Fraction of step time spent in the all-reduce and waiting for batches. The "
                        f"comm alert fires above {_pct(T.comm_share)} for {T.comm_for}.",
                        min_val=0,
                        threshold=T.comm_share,
                    ),
                ],
            ),
            efficiency_row(),
            (
                "Memory",
                [
                    timeseries(
                        "Process resident memory",
                        "bytes",
                        Target(f"{m('process_resident_memory_bytes')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        w=8,
                    ),
                    timeseries(
                        "Host memory used",
                        "percentunit",
                        Target(f"max by (node) ({m('host_memory_used_ratio')}{{{RUN_SEL}}})", "{{node}}"),
                        description=f"The checkpoint alert fires above {_pct(T.host_memory_ratio)} for "
                        f"{T.host_memory_for}.",
                        min_val=0,
                        max_val=1,
                        w=8,
                        threshold=T.host_memory_ratio,
                    ),
                    timeseries(
                        "Device memory",
                        "bytes",
                        Target(f"{m('device_memory_bytes')}{{{RANK_SEL}}}", "rank {{rank}} {{kind}}"),
                        w=8,
                    ),
                ],
            ),
            (
                "Guards and control",
                [
                    timeseries(
                        "Guard events",
                        "none",
                        Target(events("nonfinite_steps_total"), "non-finite steps"),
                        Target(events("skipped_steps_total"), "skipped updates"),
                        Target(events("loss_spikes_total"), "loss spikes"),
                        description="Per rate window, summed over ranks.",
                        w=8,
                    ),
                    timeseries(
                        "Control actions",
                        "none",
                        Target(events("control_actions_total", "action, result"), "{{action}} {{result}}"),
                        description="Actions applied by the trainer, from alerts or operators (also annotations).",
                        w=8,
                    ),
                    timeseries(
                        "Checkpoints",
                        "none",
                        Target(events("checkpoints_total", "reason"), "{{reason}}"),
                        w=8,
                    ),
                ],
            ),
        ],
    )


def efficiency_row() -> tuple[str, list]:
    """Goodput (where the job's time went, across restarts) and MFU (docs/goodput.md)."""
    badput = f'{promql.GOODPUT_BUCKETS}{{{RUN_SEL}, bucket!="training"}}'
    return (
        "Goodput and MFU",
        [
            timeseries(
                "Where the time went",
                "s",
                Target(_rec(promql.GOODPUT_PRODUCTIVE), "productive"),
                Target(badput, "{{bucket}}"),
                description="The job's wall time since its first start, across restarts, stacked: productive "
                "training (kept), and each cause of badput (startup and restarts, lost work thrown away by a "
                "resume or a rollback, checkpoint saves, validation, pauses, hangs). Kept by rank 0.",
                stacked=True,
            ),
            timeseries(
                "Goodput",
                "percentunit",
                Target(_rec(promql.GOODPUT_RATIO), "whole job"),
                Target(_rec(promql.GOODPUT_WINDOW_RATIO), f"last {T.goodput_window}"),
                description="Productive share of the job's wall time. The ticket fires below "
                f"{_pct(T.goodput_ratio)} over {T.goodput_window} for {T.goodput_for}.",
                min_val=0,
                max_val=1,
                w=4,
                threshold=T.goodput_ratio,
            ),
            timeseries(
                "MFU",
                "percentunit",
                Target(_rec(promql.MFU), "MFU"),
                description="Model FLOP/s over the devices' peak (metrics.peak_flops or the table for a known "
                "GPU). Absent without a peak (a CPU) or without FLOPs per step (metrics.count_flops).",
                min_val=0,
                w=4,
            ),
            timeseries(
                "Achieved FLOP/s",
                "flops",
                Target(_rec(promql.FLOPS_RATE), "run"),
                Target(rate_sum("model_flops_total", "rank"), "rank {{rank}}"),
                description="Model FLOPs per second (FLOPs per step counted once by FlopCounterMode, or given).",
                w=4,
            ),
        ],
    )


def ranks() -> dict:
    return dashboard(
        "rankscope-ranks",
        "rankscope / Ranks",
        "Per-rank timing, waiting, memory and GPU: which rank is slow, and why.",
        [
            (
                "Step time",
                [
                    heatmap(
                        "Compute time distribution, rank $rank",
                        "s",
                        Target(
                            f"sum by (le) (increase({m('compute_duration_seconds', 'bucket')}{{{RANK_SEL}}}[{RATE}]))",
                            "{{le}}",
                            fmt="heatmap",
                        ),
                        description="Observations per bucket of per-rank compute time; one panel per selected rank.",
                        repeat="rank",
                        w=24,
                    ),
                    timeseries(
                        "Step time per rank",
                        "s",
                        Target(quantile(0.5, "step_duration_seconds", "rank"), "p50 rank {{rank}}"),
                        Target(quantile(0.99, "step_duration_seconds", "rank"), "p99 rank {{rank}}"),
                    ),
                    timeseries(
                        "Compute time per rank (p90)",
                        "s",
                        Target(quantile(0.9, "compute_duration_seconds", "rank"), "rank {{rank}}"),
                        description="Differs between ranks under DDP; a straggler stands out here.",
                    ),
                ],
            ),
            (
                "Straggler",
                [
                    stat(
                        "Straggler",
                        "suffix:x",
                        Target(_rec(STRAGGLER), "rank {{rank}}"),
                        description="The slowest rank and its compute time over the median rank's (the "
                        f"RankscopeRankImbalance alert ({T.imbalance_severity}) fires above "
                        f"{promql.num(T.imbalance_ratio)} for {T.imbalance_for}).",
                        show_name=True,
                        threshold=T.imbalance_ratio,
                        w=6,
                        h=8,
                    ),
                    timeseries(
                        "Compute time over median, per rank",
                        "suffix:x",
                        Target(RATIO_TO_MEDIAN, "rank {{rank}}"),
                        w=9,
                        threshold=T.imbalance_ratio,
                    ),
                    timeseries(
                        "Mean compute time per rank",
                        "s",
                        Target(COMPUTE_PER_STEP, "rank {{rank}}"),
                        description="Compute seconds per step of each rank (recorded compute time per second over "
                        "the run's steps per second).",
                        w=9,
                    ),
                ],
            ),
            phase_row(),
            (
                "Waiting",
                [
                    timeseries(
                        "Data wait per rank (p90)",
                        "s",
                        Target(quantile(0.9, "data_wait_seconds", "rank"), "rank {{rank}}"),
                        description="A slow loader shows on its own rank here, and as comm time on the others. "
                        f"The data-loader alert fires above {promql.num(T.data_wait_p90_seconds)} s for "
                        f"{T.data_loader_for}.",
                        threshold=T.data_wait_p90_seconds,
                    ),
                    timeseries(
                        "Communication time per rank (p90)",
                        "s",
                        Target(quantile(0.9, "comm_duration_seconds", "rank"), "rank {{rank}}"),
                        description="Includes waiting in the all-reduce for the slowest rank.",
                    ),
                    timeseries(
                        "Data-wait share per rank",
                        "percentunit",
                        Target(share("data_wait_seconds", "step_duration_seconds", "rank"), "rank {{rank}}"),
                        description=f"The data-loader alert fires above {_pct(T.data_wait_share)} for "
                        f"{T.data_loader_for}.",
                        min_val=0,
                        threshold=T.data_wait_share,
                    ),
                    timeseries(
                        "Communication share per rank",
                        "percentunit",
                        Target(share("comm_duration_seconds", "step_duration_seconds", "rank"), "rank {{rank}}"),
                        min_val=0,
                    ),
                ],
            ),
            (
                "Resources",
                [
                    timeseries(
                        "Process resident memory per rank",
                        "bytes",
                        Target(f"{m('process_resident_memory_bytes')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        w=8,
                    ),
                    timeseries(
                        "Device memory per rank",
                        "bytes",
                        Target(f"{m('device_memory_bytes')}{{{RANK_SEL}}}", "rank {{rank}} {{kind}}"),
                        w=8,
                    ),
                    timeseries(
                        "Since last step per rank",
                        "s",
                        Target(f"time() - {m('last_step_timestamp_seconds')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        description="Seconds since each rank completed a step.",
                        w=8,
                    ),
                    timeseries(
                        "GPU utilisation",
                        "percentunit",
                        Target(f"{m('gpu_utilization_ratio')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        min_val=0,
                        max_val=1,
                        w=8,
                    ),
                    timeseries(
                        "GPU power",
                        "watt",
                        Target(f"{m('gpu_power_watts')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        w=8,
                    ),
                    timeseries(
                        "GPU temperature",
                        "celsius",
                        Target(f"{m('gpu_temperature_celsius')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        w=8,
                    ),
                    timeseries(
                        "Monitor errors",
                        "none",
                        Target(events("monitor_errors_total", "probe", RANK_SEL), "{{probe}}"),
                        description="Failures inside the monitor itself; training goes on. Should stay 0.",
                        w=24,
                    ),
                ],
            ),
        ],
    )


def phase_row() -> tuple[str, list]:
    """What each rank is doing and for how long (rankscope_phase, served even while a rank is blocked): the
    rank the hang alert names is the one in another phase, or in its phase for longest."""
    return (
        "Phase",
        [
            state_timeline(
                "Phase per rank",
                Target(f"{m('phase')}{{{RANK_SEL}}}", "rank {{rank}}"),
                PHASES,
                description="What each rank is doing (rankscope_phase): during a hang the ranks waiting in a "
                "collective and the one that never entered it show as different phases.",
                w=12,
            ),
            timeseries(
                "Time in the current phase per rank",
                "s",
                Target(f"time() - {m('phase_started_timestamp_seconds')}{{{RANK_SEL}}}", "rank {{rank}}"),
                description=f"Seconds since each rank entered its current phase. RankscopeRankHung "
                f"({T.hang_severity}) fires when the run completes no step, nor ends a checkpoint, validation or "
                f"pause, for longer than {promql.num(T.hang_step_multiple)} times its recent step time, and never "
                f"sooner than "
                f"{promql.num(T.hang_floor_seconds)} s (the line).",
                min_val=0,
                threshold=T.hang_floor_seconds,
            ),
        ],
    )


def model_and_data() -> dict:
    return dashboard(
        "rankscope-model-data",
        "rankscope / Model and data",
        "Per-module gradients and updates, the multimodal model's internals, and statistics of the data fed in.",
        [
            (
                "Model",
                [
                    timeseries(
                        "Gradient norm per module",
                        "none",
                        Target(f"max by (module) ({m('module_grad_norm')}{{{RANK_SEL}}})", "{{module}}"),
                        description="Sampled on an interval; after the all-reduce every rank holds the same gradients.",
                        log=True,
                    ),
                    timeseries(
                        "Update ratio per module",
                        "percentunit",
                        Target(f"max by (module) ({m('update_ratio')}{{{RANK_SEL}}})", "{{module}}"),
                        description="|update| / |weights|; around 1e-3 is healthy, far above means too high a LR.",
                        log=True,
                    ),
                    timeseries(
                        "Fusion gate weights",
                        "none",
                        Target(f"max by (stat) ({m('fusion_gate_weight')}{{{RANK_SEL}}})", "{{stat}}"),
                        w=8,
                    ),
                    timeseries(
                        "Attention entropy",
                        "suffix:nats",
                        Target(f"max by (layer) ({m('attention_entropy_nats')}{{{RANK_SEL}}})", "layer {{layer}}"),
                        description="Mean attention entropy per text-encoder layer; near 0 means collapsed attention.",
                        w=8,
                    ),
                    timeseries(
                        "Contrastive temperature",
                        "none",
                        Target(f"max({m('contrastive_temperature')}{{{RANK_SEL}}})", "temperature"),
                        w=8,
                    ),
                ],
            ),
            (
                "Data",
                [
                    timeseries(
                        "Caption length",
                        "suffix:tokens",
                        Target(mean("text_length_tokens"), "mean"),
                        Target(f"max({m('sequence_length_max_tokens')}{{{RANK_SEL}}})", "longest"),
                        description="Mean caption length before padding, and the longest caption of the latest step.",
                        w=8,
                    ),
                    timeseries(
                        "Text padding",
                        "percentunit",
                        Target(f"{m('text_padding_ratio')}{{{RANK_SEL}}}", "rank {{rank}}"),
                        min_val=0,
                        max_val=1,
                        w=8,
                    ),
                    timeseries(
                        "Tokens per second",
                        "suffix:tokens/s",
                        Target(rate_sum("tokens_total", "rank"), "rank {{rank}}"),
                        w=8,
                    ),
                    timeseries(
                        "Source image size (mean)",
                        "pixel",
                        Target(mean("image_size_pixels"), "side"),
                        description="Mean side length (width and height alike) of the source images, before resizing.",
                        w=8,
                    ),
                    timeseries(
                        "Image channel statistics",
                        "none",
                        Target(f"max by (channel) ({m('image_channel_mean')}{{{RANK_SEL}}})", "mean {{channel}}"),
                        Target(f"max by (channel) ({m('image_channel_std')}{{{RANK_SEL}}})", "std {{channel}}"),
                        description="Of the latest normalised batch: means near 0 and stds near 1 are expected.",
                        w=8,
                    ),
                    timeseries(
                        "Skipped samples",
                        "none",
                        Target(events("data_skipped_samples_total", "reason", RANK_SEL), "{{reason}}"),
                        description="Samples the data set could not read, per rate window.",
                        w=8,
                    ),
                ],
            ),
            batch_cost_row(),
        ],
    )


#: Each rank's longest sequence of its latest step, as its loop reports it.
LONGEST_SEQUENCE = f"max by (rank) ({m('sequence_length_max_tokens')}{{{RANK_SEL}}})"
#: Each rank's tokens per step (without padding): its token rate over its step rate.
TOKENS_PER_STEP = f"{rate_sum('tokens_total', 'rank')} / ({rate_sum('steps_total', 'rank')} > 0)"
#: Each rank's peak allocated device memory of its latest step (CUDA, metrics.step_peak_memory on).
STEP_PEAK_MEMORY = f"max by (rank) ({m('step_peak_device_memory_bytes')}{{{RANK_SEL}}})"


def batch_cost_row() -> tuple[str, list]:
    """Which batch shapes cost memory: the longest sequence and tokens per step, and the step's peak device
    memory per token of each. Per rank, computed for the ranks shown (no recording rule: nothing alerts on it)."""
    return (
        "Batch shape and memory",
        [
            timeseries(
                "Longest sequence and tokens per step",
                "suffix:tokens",
                Target(LONGEST_SEQUENCE, "longest sequence, rank {{rank}}"),
                Target(TOKENS_PER_STEP, "tokens per step, rank {{rank}}"),
                description="The longest sequence of each rank's latest step, as its loop reports it "
                "(Monitor.step(max_seq_len=...)), and the tokens (without padding) it processes per step.",
            ),
            timeseries(
                "Peak device memory per token",
                "bytes",
                Target(
                    f"{STEP_PEAK_MEMORY} / ({LONGEST_SEQUENCE} > 0)", "per token of the longest sequence, rank {{rank}}"
                ),
                Target(f"{STEP_PEAK_MEMORY} / ({TOKENS_PER_STEP} > 0)", "per token of the step, rank {{rank}}"),
                description="Each step's peak allocated device memory (max_memory_allocated, reset per step: "
                "metrics.step_peak_memory, CUDA only) over the step's longest sequence and over its tokens. A "
                "line that rises with the sequence length means long batches cost more than their tokens (attention "
                "grows with the square of the length); flat means memory follows tokens.",
            ),
        ],
    )


#: File name -> builder. The file names are what Grafana's file provider loads.
DASHBOARDS = {
    "run-overview.json": run_overview,
    "ranks.json": ranks,
    "model-and-data.json": model_and_data,
}


def render(t: Tunables | None = None) -> dict[str, str]:
    """File name -> the JSON text of every dashboard, drawn with the tunables `t` (default: the shipped ones)."""
    global T
    shipped, T = T, t or Tunables()
    try:
        return {name: to_json(build()) for name, build in DASHBOARDS.items()}
    finally:
        T = shipped
