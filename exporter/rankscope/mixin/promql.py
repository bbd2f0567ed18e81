"""Shared PromQL: contract names, number formatting, the rate and counting idioms, and the names of every
recorded series (``level:metric:operation``), read by the rule areas, the dashboards and the tests.

``run`` aggregates by ``run_id``; ``run_node`` by ``run_id, node``; ``run_rank`` by ``run_id, node, rank`` (or
keeps each rank's series as scraped). Metric names, histogram buckets and identity labels come from
:mod:`rankscope.contract`: a metric renamed or removed there fails generation.

A run-level figure over many ranks is built in two steps where it can: each node's part first (``run_node``,
computed where the node's series are: a shard of the sharded layout, rankscope.mixin.layout), then the run's
from the nodes' parts, in the same group. One server computes the same value either way; the global server
of the sharded layout then holds one series per node instead of one per rank.
"""

from __future__ import annotations

import re

from rankscope import contract
from rankscope.hang_threshold import duration_seconds

RUN = "run_id"
NODE = "run_id, node"
RANK = "run_id, node, rank"
assert {"run_id", "node", "rank"} <= set(contract.IDENTITY_LABELS)

#: One rank per node stands for all of them where DDP makes every rank's value the same: the all-reduce makes
#: every rank's step take the same wall time and every rank complete every step. Reading local rank 0 of each
#: node is 1/8 of the series at 8 ranks per node, and torchrun gives every node a local rank 0.
ONE_PER_NODE = '{local_rank="0"}'


def metric_name(short: str, series: str = "") -> str:
    """A contract metric's exposed name (KeyError naming it if the contract has no such metric);
    `series` picks ``bucket``/``sum``/``count`` of a histogram (``sum``/``count`` of a summary)."""
    spec = contract.metric(short)
    return spec.series(series) if series else spec.name


def num(value: float) -> str:
    """A float as PromQL and people read it: 0.85, 100000, 1e-07."""
    return format(value, "g")


def percent(share: float) -> str:
    """A 0..1 share as people read it: 0.01 -> 1%, 0.005 -> 0.5%."""
    return f"{share * 100:g}%"


def le(bound: float) -> str:
    """A bucket boundary as the exporter writes it in `le` (prometheus_client: Go's float formatting)."""
    return repr(float(bound))


def counted_in_window(counter: str, window: str) -> str:
    """How much a small counter grew in `window`, without increase()'s extrapolation.

    increase() scales the growth it saw to the whole window, so 2 events can read as 2.1 and
    cross a "> 2" threshold. The spread max - min counts exactly, but reads a restart (a reset to 0)
    as growth; increase() handles resets. The smaller of the two is exact in both cases:
    `A < B or B` is min(A, B) per series. Three range functions: give it a run-level series
    (one per run), never every rank's.
    """
    growth = f"increase({counter}[{window}])"
    spread = f"(max_over_time({counter}[{window}]) - min_over_time({counter}[{window}]))"
    return f"({growth} < {spread}) or {spread}"


def applied(action: str, window: str) -> str:
    """Runs whose trainer applied `action` within `window`: rank 0 sets the time of each action it applied
    (`control_last_applied_timestamp_seconds`). Read over the window, not the instant value, so that an action
    applied just before a restart (whose page, and series, went with the old processes) still counts; a time
    rather than the actions counter because a restarted process's counter is born again at the old value, and
    its first action then reads as no growth (the loop-off campaign's plateau alert after a second rollback)."""
    last = f'{metric_name("control_last_applied_timestamp_seconds")}{{action="{action}"}}'
    return f"max by ({RUN}) (\n  max_over_time({last}[{window}]) > time() - {num(duration_seconds(window))}\n)"


def present_ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator series by series, NaN (no figure) where the denominator is 0: present for as long
    as the numerator is, so that a shard's recording of it does not come and go with its value (the global server
    would hold a vanished series' last value for its lookback delta). Any comparison with NaN is false."""
    return f"{numerator}\n/\n({denominator} > 0)\nor\n{numerator} * nan"


def rate_by(by: str, series: str, window: str, matchers: str = "") -> str:
    return f"sum by ({by}) (rate({series}{matchers}[{window}]))"


def ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator; no series (rather than NaN or Inf) where the denominator is 0."""
    return f"{numerator}\n/\n({denominator} > 0)"


def _quantile_name(q: float) -> str:
    return "p" + format(q * 100, "g").replace(".", "")


def _counter(short: str) -> str:
    return metric_name(short).removesuffix("_total")


# --- recorded series (level:metric:operation), by the area that records them -------------------------------
# performance
COMPUTE_BUSY = f"run_rank:{metric_name('compute_duration_seconds', 'sum')}:rate"
#: Ranks over the data-loader alert's lines (label `signal`), and ranks (one per node) whose mean step time is over
#: the slow-step line: present only then, valued the share or the mean.
DATA_WAIT_OVER = f"run_rank:{metric_name('data_wait_seconds')}:over_line"
STEP_MEAN_OVER = f"run_rank:{metric_name('step_duration_seconds')}:mean_over_line"
#: The slowest rank of each run by COMPUTE_BUSY (recorded by the sharded layout's global server only).
COMPUTE_SLOWEST = f"run_rank:{metric_name('compute_duration_seconds', 'sum')}:slowest"
COMPUTE_MEDIAN = f"run:{metric_name('compute_duration_seconds')}:median"
IMBALANCE = f"run:{metric_name('compute_duration_seconds')}:imbalance_ratio"
STRAGGLER = f"run:{metric_name('compute_duration_seconds')}:straggler_ratio"
STEP_BUCKET_RATE = f"run:{metric_name('step_duration_seconds', 'bucket')}:rate"
STEP_SUM_RATE = f"run:{metric_name('step_duration_seconds', 'sum')}:avg_rate"
COMM_SUM_RATE = f"run:{metric_name('comm_duration_seconds', 'sum')}:avg_rate"
COMM_SHARE = f"run:{metric_name('comm_duration_seconds')}:share"
#: Each node's sum and count of its ranks' comm-time rates: the sharded layout's COMM_SUM_RATE is their run's mean.
COMM_NODE_SUM_RATE = f"run_node:{metric_name('comm_duration_seconds', 'sum')}:rate"
COMM_NODE_RANKS = f"run_node:{metric_name('comm_duration_seconds', 'sum')}:ranks"
STEP_QUANTILES = {q: f"run:{metric_name('step_duration_seconds')}:{_quantile_name(q)}" for q in (0.5, 0.99)}
SAMPLES_RATE = f"run:{_counter('samples_total')}:rate"
TOKENS_RATE = f"run:{_counter('tokens_total')}:rate"
STEPS_RATE = f"run:{_counter('steps_total')}:rate"
#: Each node's part of the step-time figures read from its local rank 0 (sums of its local ranks 0's rates, and
#: how many there are): the sharded layout builds the run's from them.
STEP_BUCKET_NODE_RATE = f"run_node:{metric_name('step_duration_seconds', 'bucket')}:rate"
STEPS_NODE_RATE = f"run_node:{_counter('steps_total')}:rate"
STEPS_NODE_SOURCES = f"run_node:{_counter('steps_total')}:rate_count"
STEP_SUM_NODE_RATE = f"run_node:{metric_name('step_duration_seconds', 'sum')}:rate"
STEP_SUM_NODE_SOURCES = f"run_node:{metric_name('step_duration_seconds', 'sum')}:rate_count"
HANG_STEP_SUM_NODE_RATE = f"run_node:{metric_name('step_duration_seconds', 'sum')}:hang_rate"
HANG_STEP_COUNT_NODE_RATE = f"run_node:{metric_name('step_duration_seconds', 'count')}:hang_rate"
SAMPLES_NODE_RATE = f"run_node:{_counter('samples_total')}:rate"
TOKENS_NODE_RATE = f"run_node:{_counter('tokens_total')}:rate"
# training
LOSS_SMOOTHED = f"run:{metric_name('loss')}:smoothed"
LOSS_BASELINE = f"run:{metric_name('loss')}:window_median"
LOSS_WINDOW_LOW = f"run:{metric_name('loss')}:window_min"
LOSS_WINDOW_HIGH = f"run:{metric_name('loss')}:window_max"
#: The run's loss over the last few seconds, by its lower quartile (each rank's, then their mean): a leap in the
#: loss that the smoothed loss would take half its window to show.
LOSS_RECENT_LOW = f"run:{metric_name('loss')}:recent_lower_quartile"
VAL_LOSS = f"run:{metric_name('loss')}:val_mean"
#: Each node's sum and count of its ranks' smoothed training losses: the sharded layout's LOSS_SMOOTHED is their
#: run's mean.
LOSS_SMOOTHED_NODE_SUM = f"run_node:{metric_name('loss')}:smoothed_sum"
LOSS_SMOOTHED_NODE_COUNT = f"run_node:{metric_name('loss')}:smoothed_count"
LOSS_RECENT_LOW_NODE_SUM = f"run_node:{metric_name('loss')}:recent_lower_quartile_sum"
LOSS_RECENT_LOW_NODE_COUNT = f"run_node:{metric_name('loss')}:recent_lower_quartile_count"
#: Each node's sum and count of its ranks' latest validation loss: VAL_LOSS is their run's mean.
VAL_LOSS_NODE_SUM = f"run_node:{metric_name('loss')}:val_sum"
VAL_LOSS_NODE_COUNT = f"run_node:{metric_name('loss')}:val_count"
NONFINITE_MAX = f"run:{metric_name('nonfinite_steps_total')}:max"
GRAD_NORM_MAX = f"run:{metric_name('grad_norm')}:max"
NONFINITE_NODE_MAX = f"run_node:{metric_name('nonfinite_steps_total')}:max"
GRAD_NORM_NODE_MAX = f"run_node:{metric_name('grad_norm')}:max"
# convergence
#: The loss's rate of change is per this many steps (the unit of LOSS_CHANGE's name, not a threshold).
LOSS_CHANGE_STEPS = 1000
LOSS_CHANGE = f"run:{metric_name('loss')}:relative_change_per_1k_steps"
# liveness
PAUSED_MAX = f"run:{metric_name('paused')}:max"
RUN_FINISHED_RECENT = f"run:{metric_name('run_finished')}:min_recent"
RUN_ENDED = f"run:{metric_name('run_finished')}:ended"
#: Per scrape target: the newest run and rank it served within the rank-down lookback, valued the last time it did.
RANK_SEEN_AT = f"run_rank:{metric_name('run_info')}:last_seen_timestamp_seconds"
#: Ranks whose last word within the rank-down lookback was "finished", valued when they said it.
RANK_FINISHED_AT = f"run_rank:{metric_name('run_finished')}:finished_timestamp_seconds"
#: Each node's RUN_FINISHED_RECENT (present while a rank of it served within the window).
RUN_FINISHED_NODE_RECENT = f"run_node:{metric_name('run_finished')}:min_recent"
#: Scrape targets that cannot be scraped, with the run and rank they stand for (present only while down).
RANK_DOWN = "run_rank:up:down"
#: Ranks whose previous process vanished within the vanished window (present only then), valued when it did.
RANK_VANISHED_RECENT = f"run_rank:{metric_name('previous_process_vanished_timestamp_seconds')}:recent"
# hangs
HANG_STEP_SECONDS = f"run:{metric_name('step_duration_seconds')}:hang_reference_mean"
HANG_THRESHOLD = f"run:{metric_name('last_step_timestamp_seconds')}:hang_threshold_seconds"
HANG_STALLED = f"run:{metric_name('last_step_timestamp_seconds')}:stalled_seconds"
#: Present while a run is excused from the hang alert, valued the evaluation time: its last value is the end of
#: the run's last excused phase, to within an interval.
HANG_EXCUSED_AT = f"run:{metric_name('phase')}:hang_excused_timestamp_seconds"
HANG_SUSPECTS = f"run_rank:{metric_name('phase')}:hang_suspect"
#: The latest step of any rank of a run (0 before the first step).
LAST_STEP_AGE = f"run:{metric_name('last_step_timestamp_seconds')}:age_seconds"
#: How many ranks of a run are in each phase (label `phase`: the index as text).
PHASE_RANKS = f"run:{metric_name('phase')}:ranks_by_phase"
#: The most and the fewest collectives a rank of the run has started (summed over mesh dimensions).
COLLECTIVES_MAX = f"run:{metric_name('collectives_total')}:max"
COLLECTIVES_MIN = f"run:{metric_name('collectives_total')}:min"
#: Each node's part of those: its ranks, those in a collective, its collective extremes, and 1 while one of its
#: ranks excuses the run from the hang alert (else 0). The sharded layout's shards record them, present while
#: the node's ranks serve, and its global server builds the run's from them.
PHASE_NODE_RANKS = f"run_node:{metric_name('phase')}:ranks"
PHASE_NODE_IN_COLLECTIVE = f"run_node:{metric_name('phase')}:ranks_in_collective"
COLLECTIVES_NODE_MAX = f"run_node:{metric_name('collectives_total')}:max"
COLLECTIVES_NODE_MIN = f"run_node:{metric_name('collectives_total')}:min"
HANG_NODE_EXCUSED = f"run_node:{metric_name('phase')}:hang_excused"
#: Each rank's phase and collective count while its run may be hung (no step for half its hang threshold): what
#: the hang suspects compare, recorded by the shards only then, so a healthy run federates none of them.
HANG_CANDIDATE_PHASE = f"run_rank:{metric_name('phase')}:hang_candidate"
HANG_CANDIDATE_COLLECTIVES = f"run_rank:{metric_name('collectives_total')}:hang_candidate"
# reliability
CHECKPOINT_FAILURES_MAX = f"run:{metric_name('checkpoint_failures_total')}:max"
CHECKPOINT_FAILED_AT = f"run:{metric_name('checkpoint_failures_total')}:failure_timestamp_seconds"
LAST_CHECKPOINT_NODE_MAX = f"run_node:{metric_name('last_checkpoint_timestamp_seconds')}:max"
#: Each node's highest checkpoint failure count per reason: CHECKPOINT_FAILURES_MAX is their run's highest.
CHECKPOINT_FAILURES_NODE_MAX = f"run_node:{metric_name('checkpoint_failures_total')}:max"
# resources
HOST_MEMORY_NODE_MAX = f"run_node:{metric_name('host_memory_used_ratio')}:max"
#: Each rank's device memory of the configured kind (device_memory_kind) over its total; NaN where the total is 0.
DEVICE_MEMORY_RATIO = f"run_rank:{metric_name('device_memory_bytes')}:used_ratio"
#: Ranks whose DEVICE_MEMORY_RATIO is over the alert's line (present only then).
DEVICE_MEMORY_OVER = f"run_rank:{metric_name('device_memory_bytes')}:used_ratio_over_line"
# efficiency
GOODPUT_BUCKETS = f"run:{metric_name('goodput_seconds_total')}:by_bucket"
GOODPUT_WALL = f"run:{metric_name('goodput_seconds_total')}:wall"
GOODPUT_PRODUCTIVE = f"run:{metric_name('goodput_seconds_total')}:productive"
GOODPUT_RATIO = f"run:{metric_name('goodput_seconds_total')}:goodput_ratio"
GOODPUT_WINDOW_RATIO = f"run:{metric_name('goodput_seconds_total')}:goodput_window_ratio"
BADPUT_WINDOW = f"run:{metric_name('goodput_seconds_total')}:badput_window"
FLOPS_RATE = f"run:{_counter('model_flops_total')}:rate"
FLOPS_NODE_RATE = f"run_node:{_counter('model_flops_total')}:rate"
PEAK_FLOPS = f"run:{metric_name('peak_flops_per_second')}:sum"
PEAK_FLOPS_NODE = f"run_node:{metric_name('peak_flops_per_second')}:sum"
MFU = f"run:{_counter('model_flops_total')}:mfu_ratio"

_RECORDED_NAME = re.compile(r"\b[a-z_]+:[a-zA-Z0-9_]+:[a-zA-Z0-9_]+\b")


def recorded_names(expr: str) -> set[str]:
    """The recorded series (``level:metric:operation``) an expression reads."""
    return set(_RECORDED_NAME.findall(expr))


def recording_depth(rules: list[dict[str, str]]) -> dict[str, int]:
    """Recorded series -> its level: 1 reads only scraped series, n reads some series of level n - 1.

    A remote ruler (vmalert) sees a recorded series only after it wrote it, and Prometheus evaluates
    the groups side by side, so a series read from another group is one evaluation old: each level may
    add an evaluation to an alert's delay. Within a group Prometheus evaluates top to bottom in one pass.
    """
    depth: dict[str, int] = {}
    for rule in rules:  # in dependency order
        # A record that carries its own last value forward reads itself: that adds no level.
        own = rule["record"]
        depth[own] = 1 + expression_depth(rule["expr"], depth, ignore=own)
    return depth


def expression_depth(expr: str, depth: dict[str, int], ignore: str = "") -> int:
    """The highest level of the recorded series `expr` reads (0: only scraped ones), `ignore` left out."""
    read = recorded_names(expr) - {ignore}
    unknown = sorted(read - set(depth))
    if unknown:
        raise ValueError(f"{expr!r} reads {unknown} before any rule records it")
    return max((depth[n] for n in read), default=0)
