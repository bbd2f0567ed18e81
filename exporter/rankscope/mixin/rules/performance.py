"""Performance: throughput, step-time quantiles, compute imbalance (the straggler), the data loader,
communication overhead and slow steps."""

from __future__ import annotations

from rankscope.mixin.config import IMBALANCE_ALERT, Tunables, effect, sentence
from rankscope.mixin.promql import (
    COMM_NODE_RANKS,
    COMM_NODE_SUM_RATE,
    COMM_SHARE,
    COMM_SUM_RATE,
    COMPUTE_BUSY,
    COMPUTE_MEDIAN,
    COMPUTE_SLOWEST,
    DATA_WAIT_OVER,
    IMBALANCE,
    NODE,
    ONE_PER_NODE,
    PAUSED_MAX,
    RANK,
    RUN,
    SAMPLES_NODE_RATE,
    SAMPLES_RATE,
    STEP_BUCKET_NODE_RATE,
    STEP_BUCKET_RATE,
    STEP_MEAN_OVER,
    STEP_QUANTILES,
    STEP_SUM_NODE_RATE,
    STEP_SUM_NODE_SOURCES,
    STEP_SUM_RATE,
    STEPS_NODE_RATE,
    STEPS_NODE_SOURCES,
    STEPS_RATE,
    STRAGGLER,
    TOKENS_NODE_RATE,
    TOKENS_RATE,
    le,
    metric_name,
    num,
    rate_by,
    ratio,
)
from rankscope.mixin.rules import RANK_TEXT, Alert

#: Evaluated every `slow_interval`: every value here is a rate over `rate_window` (2 minutes) and every alert waits
#: 10 minutes or more, while at 4096 ranks this group costs as much as all the others together.
SLOW = True


def records(t: Tunables) -> list[dict[str, str]]:
    """Rates of the scraped series, each computed once (level 1), and what is built from them.

    No quantile per rank is recorded: a panel asks for the ranks it shows, when someone looks.
    """
    w = t.rate_window
    step = metric_name("step_duration_seconds")
    busy_median = f"quantile by ({RUN}) (0.5, {COMPUTE_BUSY})"
    slowest = f"topk by ({RUN}) (1, {COMPUTE_BUSY})"
    return [
        # --- level 1 ----------------------------------------------------------------------------------------
        # Compute time (step - comm - data wait) is the per-rank signal: under DDP the all-reduce makes every
        # rank's step equally long, and a fast rank's waiting is counted in its comm time. Compute seconds per
        # second: every rank completes every step, so ranks compare as their means per step would.
        {"record": COMPUTE_BUSY, "expr": rate_by(RANK, metric_name("compute_duration_seconds", "sum"), w)},
        {"record": STEPS_RATE, "expr": f"avg by ({RUN}) (rate({metric_name('steps_total')}{ONE_PER_NODE}[{w}]))"},
        {"record": STEP_BUCKET_RATE, "expr": rate_by(f"{RUN}, le", f"{step}_bucket", w, ONE_PER_NODE)},
        {"record": STEP_SUM_RATE, "expr": f"avg by ({RUN}) (rate({step}_sum{ONE_PER_NODE}[{w}]))"},
        # All ranks: a fast rank's comm time includes its waiting for the slow one.
        {"record": COMM_SUM_RATE, "expr": f"avg by ({RUN}) (rate({metric_name('comm_duration_seconds', 'sum')}[{w}]))"},
        # Every rank counts its own share of the global batch, so the run's throughput is the sum: each node's
        # first (where its ranks' series are), then the run's below.
        {"record": SAMPLES_NODE_RATE, "expr": rate_by(NODE, metric_name("samples_total"), w)},
        {"record": TOKENS_NODE_RATE, "expr": rate_by(NODE, metric_name("tokens_total"), w)},
        # --- level 2: from level 1 only ---------------------------------------------------------------------
        {"record": SAMPLES_RATE, "expr": f"sum by ({RUN}) ({SAMPLES_NODE_RATE})"},
        {"record": TOKENS_RATE, "expr": f"sum by ({RUN}) ({TOKENS_NODE_RATE})"},
        *({"record": record, "expr": f"histogram_quantile({num(q)}, {STEP_BUCKET_RATE})"}
          for q, record in STEP_QUANTILES.items()),
        {"record": COMM_SHARE, "expr": ratio(COMM_SUM_RATE, STEP_SUM_RATE)},
        # Seconds of compute per step of the median rank.
        {"record": COMPUTE_MEDIAN, "expr": ratio(busy_median, STEPS_RATE)},
        {
            # The slowest rank of each run over the median of the other ranks; its `rank` and `node` labels name
            # the straggler. The others only: with two ranks a median of both is their mean, and a rank twice as
            # slow as the other would read 1.33x. A run of one rank has no others: ratio 1, below any
            # imbalance_ratio. Taken here, not read from a recorded median, so the alert stays two levels above
            # the scraped data.
            "record": STRAGGLER,
            "expr": f"{slowest}\n/ on ({RUN}) group_left ()\n(\n"
            f"  quantile by ({RUN}) (0.5, {COMPUTE_BUSY} unless {slowest}) > 0\n"
            f"  or\n  max by ({RUN}) ({COMPUTE_BUSY}) > 0\n)",
        },
        # --- level 3: dashboards only ----------------------------------------------------------------------
        # The slowest rank over the median one is the straggler's ratio: read from it, not from every rank again.
        {"record": IMBALANCE, "expr": f"max by ({RUN}) ({STRAGGLER})"},
    ]  # fmt: skip


#: Present only while a rank is over a line (rankscope.mixin.rules: the global server reads their fresh samples).
TRANSIENT = (DATA_WAIT_OVER, STEP_MEAN_OVER)


def _rank_ratios(t: Tunables) -> tuple[str, str, str]:
    """What the data-loader and slow-step alerts compare with their lines, per rank: each rank's own rates in one
    expression (a ratio of rates taken at different times is noise, and at a 10 % line noise pages). The mean step
    time of local rank 0 of each node, the share of batches over the p90 line, and the share of step time spent
    waiting for data. NaN, not absent, where the rank did not step: a comparison with NaN is false. A histogram's
    sum and any bucket move only with its count, so a plain ratio of them is NaN (0/0) there, never +Inf."""
    w = t.rate_window
    step = metric_name("step_duration_seconds")
    data = metric_name("data_wait_seconds")
    slow = f'{{le="{le(t.data_wait_p90_seconds)}"}}'
    # Every rank's step takes the same wall time under DDP (the all-reduce waits for the slowest): one rank per
    # node stands for all, as in the run's step-time histogram.
    mean = f"rate({step}_sum{ONE_PER_NODE}[{w}])\n/\nrate({step}_count{ONE_PER_NODE}[{w}])"
    # More than 10 % of a rank's batches above the boundary is a p90 above it (data_wait_p90_seconds). `ignoring
    # (le)` drops the bucket's `le` in the one match, where `sum without (le)` grouped every rank first.
    slow_share = f"1 - rate({data}_bucket{slow}[{w}])\n/ ignoring (le)\nrate({data}_count[{w}])"
    # The step time of local rank 0 of the rank's node (the highest where a node has several local ranks 0: one
    # process per container). Data wait can grow while no step ends (x/0: +Inf): `% +Inf` keeps a finite share and
    # makes +Inf NaN (Go's math.Mod), in the same single pass over the ranks.
    step_share = (
        f"(\n  rate({data}_sum[{w}])\n  / on ({NODE}) group_left ()\n"
        f"  max by ({NODE}) (rate({step}_sum{ONE_PER_NODE}[{w}]))\n)\n% +Inf"
    )
    return mean, slow_share, step_share


def shard_records(t: Tunables) -> list[dict[str, str]]:
    """Recorded on the sharded layout's shards only: each node's parts of the run's step-time and comm figures,
    and the ranks over the data-loader and slow-step lines (present only then), which the global server federates
    instead of every rank's series. One server computes them inside the rules that read them
    (rankscope.mixin.rules). The per-rank ratios themselves are computed inside the over-line records, not
    recorded: writing three values for every rank each evaluation costs more than the comparisons."""
    w = t.rate_window
    step = metric_name("step_duration_seconds")
    mean, slow_share, step_share = _rank_ratios(t)
    indent = "\n    "
    return [
        # Each node's part of the run's step-time figures (its local ranks 0), for their sharded layout's forms.
        {"record": STEP_BUCKET_NODE_RATE, "expr": rate_by(f"{NODE}, le", f"{step}_bucket", w, ONE_PER_NODE)},
        {"record": STEPS_NODE_RATE, "expr": rate_by(NODE, metric_name("steps_total"), w, ONE_PER_NODE)},
        {
            "record": STEPS_NODE_SOURCES,
            "expr": f"count by ({NODE}) (rate({metric_name('steps_total')}{ONE_PER_NODE}[{w}]))",
        },
        {"record": STEP_SUM_NODE_RATE, "expr": rate_by(NODE, f"{step}_sum", w, ONE_PER_NODE)},
        {"record": STEP_SUM_NODE_SOURCES, "expr": f"count by ({NODE}) (rate({step}_sum{ONE_PER_NODE}[{w}]))"},
        # Each node's part of the run's mean comm time, for the sharded layout's form of COMM_SUM_RATE.
        {"record": COMM_NODE_SUM_RATE, "expr": rate_by(NODE, metric_name("comm_duration_seconds", "sum"), w)},
        {
            "record": COMM_NODE_RANKS,
            "expr": f"count by ({NODE}) (rate({metric_name('comm_duration_seconds', 'sum')}[{w}]))",
        },
        # What the two alerts compare, on the shards: the global server reads only the ranks over a line. Each
        # rank's shares as recorded (series by series), aggregated at the end, where only those ranks are left.
        {
            "record": DATA_WAIT_OVER,
            "expr": f"max by ({RANK}, signal) (\n"
            f"  label_replace((\n    {slow_share.replace(chr(10), indent)}\n  ) > 0.1, "
            f'"signal", "p90_wait", "", "")\n'
            f"  or\n"
            f"  label_replace((\n    {step_share.replace(chr(10), indent)}\n  ) > {num(t.data_wait_share)}, "
            f'"signal", "wait_share", "", "")\n'
            f")",
        },
        # A run that stopped stepping has no mean (NaN: its count's rate is 0): a stall, not slow steps.
        {
            "record": STEP_MEAN_OVER,
            "expr": f"max by ({RANK}) (\n  {mean.replace(chr(10), chr(10) + '  ')}\n)\n> {num(t.slow_step_seconds)}",
        },
    ]  # fmt: skip


def global_records(t: Tunables) -> list[dict[str, str]]:
    """The slowest rank of each run, read once by the straggler's sharded form (one server takes it inside the
    straggler's expression, twice, to keep the alert two recording levels above the scraped data; a global server
    evaluates its group in one pass, so a level costs it no evaluation, and every read of every rank's compute time
    costs it 16,384 series at that size)."""
    return [{"record": COMPUTE_SLOWEST, "expr": f"topk by ({RUN}) (1, {COMPUTE_BUSY})"}]


def sharded_forms(t: Tunables) -> dict[str, str]:
    """The run's figures from its nodes' parts: the means one server takes in one read of every rank (or of every
    node's local rank 0) from the nodes' sums and counts, the step-time buckets from the nodes' bucket rates. The
    global server then reads no rank's series over a window."""

    def mean(total: str, count: str) -> str:
        return f"sum by ({RUN}) ({total})\n/\nsum by ({RUN}) ({count})"

    return {
        COMM_SUM_RATE: mean(COMM_NODE_SUM_RATE, COMM_NODE_RANKS),
        STEPS_RATE: mean(STEPS_NODE_RATE, STEPS_NODE_SOURCES),
        STEP_SUM_RATE: mean(STEP_SUM_NODE_RATE, STEP_SUM_NODE_SOURCES),
        STEP_BUCKET_RATE: f"sum by ({RUN}, le) ({STEP_BUCKET_NODE_RATE})",
        # Two reads of every rank's compute time instead of four (the slowest rank, recorded, read twice).
        STRAGGLER: f"{COMPUTE_SLOWEST}\n/ on ({RUN}) group_left ()\n(\n"
        f"  quantile by ({RUN}) (0.5, {COMPUTE_BUSY} unless {COMPUTE_SLOWEST}) > 0\n"
        f"  or\n  max by ({RUN}) ({COMPUTE_SLOWEST}) > 0\n)",
    }


def alerts(t: Tunables) -> list[Alert]:
    if t.slow_step_action:  # the summary's and the description's last words
        acts, said = effect(t.slow_step_action)
        slow_steps = (f"; {acts}", f" {sentence(said)}.")
    else:
        slow_steps = ("", " The run trains far slower than planned.")
    return [
        Alert(
            IMBALANCE_ALERT,
            f"{STRAGGLER} > {num(t.imbalance_ratio)}",
            t.imbalance_for,
            t.imbalance_severity,
            "One rank is a straggler: its compute time per step is far above the other ranks' median.",
            f'Straggler: {RANK_TEXT} computes {{{{ $value | printf "%.2f" }}}}x as long per step as the median '
            f"of the other ranks (threshold {num(t.imbalance_ratio)}) for {t.imbalance_for}. Every other rank waits "
            "for it in the all-reduce.",
        ),
        Alert(
            "RankscopeDataLoaderBottleneck",
            DATA_WAIT_OVER,
            t.data_loader_for,
            t.data_loader_severity,
            "A rank waits too long for its data loader.",
            f"Data loader of {RANK_TEXT} is a bottleneck: "
            f'{{{{ if eq $labels.signal "p90_wait" }}}}p90 wait per batch is above {num(t.data_wait_p90_seconds)}s '
            "({{ $value | humanizePercentage }} of batches waited longer)"
            "{{ else }}waiting for data takes {{ $value | humanizePercentage }} of step time "
            f"(threshold {t.data_wait_share:.0%}){{{{ end }}}} for {t.data_loader_for}.",
        ),
        Alert(
            "RankscopeCommOverheadHigh",
            f"{COMM_SHARE} > {num(t.comm_share)}",
            t.comm_for,
            t.comm_severity,
            "Gradient all-reduce takes a large share of step time.",
            "Run {{ $labels.run_id }} spends {{ $value | humanizePercentage }} of its step time in gradient "
            f"all-reduce (threshold {t.comm_share:.0%}) for {t.comm_for}.",
        ),
        Alert(
            "RankscopeSlowSteps",
            # Each rank's mean step time over the window, from its own rates (the ratio of two rates taken at one
            # time). A paused run is excluded at once, as the stall alert excludes it.
            f"{STEP_MEAN_OVER}\nunless on ({RUN})\n{PAUSED_MAX} > 0",
            t.slow_step_for,
            t.slow_step_severity,
            f"Training steps are slow: a rank's mean step time is above its threshold{slow_steps[0]}.",
            f"The mean step time of {RANK_TEXT} is {{{{ $value | humanizeDuration }}}} over the last {t.rate_window} "
            f"(threshold {num(t.slow_step_seconds)}s) for {t.slow_step_for}.{slow_steps[1]}",
            t.slow_step_action,
        ),
    ]
