"""Liveness: a stalled run, a rank that cannot be scraped, a long pause."""

from __future__ import annotations

from rankscope.contract import PHASES
from rankscope.hang_threshold import duration_seconds
from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import (
    NODE,
    ONE_PER_NODE,
    PAUSED_MAX,
    RANK,
    RANK_DOWN,
    RANK_FINISHED_AT,
    RANK_SEEN_AT,
    RANK_VANISHED_RECENT,
    RUN,
    RUN_ENDED,
    RUN_FINISHED_NODE_RECENT,
    RUN_FINISHED_RECENT,
    metric_name,
    num,
)
from rankscope.mixin.rules import RANK_TEXT, Alert

#: The phases of a step lie between these two (rankscope.contract.PHASES): data wait, compute, collective.
_STEP_BOUNDARY, _CHECKPOINT = PHASES.index("step_boundary"), PHASES.index("checkpoint")


#: Present only while their condition holds (rankscope.mixin.rules: the global server reads their fresh samples).
TRANSIENT = (RUN_FINISHED_NODE_RECENT, RANK_DOWN, RANK_VANISHED_RECENT)
#: The ranks that finished cleanly, remembered by each shard for its own ranks (rankscope.mixin.layout): the global
#: server would otherwise read every rank's run_finished twice per evaluation for a handful of ranks.
SHARD_EVALUATED = (RANK_FINISHED_AT,)


def shard_records(t: Tunables) -> list[dict[str, str]]:
    """What the sharded layout's shards decide for their own ranks and targets: each node's part of whether its run
    still runs, the targets that are down (with the run and rank each stands for), and the ranks whose previous
    process vanished. One server computes them inside the rules that read them; the global server then reads one
    series per node and only the few down or vanished ranks, not every rank's."""
    return [
        # 0 while a rank of the node that served metrics within the window says it is running (see RUN_FINISHED_RECENT).
        {
            "record": RUN_FINISHED_NODE_RECENT,
            "expr": f"min by ({NODE}) (last_over_time({metric_name('run_finished')}[{t.live_window}]))",
        },
        {
            # The `up` series of a rank carries run_id/rank when service discovery sets them (file_sd from the
            # trainer, Kubernetes); with static targets they come from the metrics the rank served last
            # (RANK_SEEN_AT): a static target stands for the newest run it served within the lookback, an older run
            # on the same port is history, not a rank that is down now.
            "record": RANK_DOWN,
            "expr": f'max by ({RANK}, instance) (up{{run_id!="", rank!=""}} == 0)\n'
            f"or\n"
            f"max by ({RANK}, instance) (\n"
            f"  (up == 0)\n"
            f"  * on (job, instance) group_left ({RANK})\n"
            f"  topk by (job, instance) (1, {RANK_SEEN_AT})\n"
            f")",
        },
        {
            # Set by the rank's next process when the one before it left no word of its ending (rankscope.exits).
            "record": RANK_VANISHED_RECENT,
            "expr": f"{metric_name('previous_process_vanished_timestamp_seconds')} > time() - "
            f"{num(duration_seconds(t.vanished_window))}",
        },
    ]


def records(t: Tunables) -> list[dict[str, str]]:
    """Whether a run is paused (several alerts, here and in other areas, exclude paused runs), whether it
    has ended (every alert but RankscopeRankDown excludes ended runs: rankscope.mixin.rules.Alert), and what
    the rank-down alert needs to name a target that stopped answering."""
    finished = metric_name("run_finished")
    info = metric_name("run_info")
    lookback = num(duration_seconds(t.rank_down_lookback))
    return [
        # A pause is applied on every rank at the same step: one rank per node stands for all.
        {"record": PAUSED_MAX, "expr": f"max by ({RUN}) ({metric_name('paused')}{ONE_PER_NODE})"},
        # 0 while a rank that served metrics within the window says it is running, 1 when every such rank said
        # it finished, absent when none served any. A range, not an instant read: after a restart Prometheus
        # writes no staleness markers for targets gone meanwhile, and their last samples read as present for 5m.
        {"record": RUN_FINISHED_RECENT, "expr": f"min by ({RUN}) ({RUN_FINISHED_NODE_RECENT})"},
        # A run seen within the lookback that no running rank stands for: finished, or vanished.
        {
            "record": RUN_ENDED,
            "expr": f"max by ({RUN}) (last_over_time({RUN_FINISHED_RECENT}[{t.ended_lookback}])) * 0 + 1\n"
            f"unless on ({RUN})\n"
            f"({RUN_FINISHED_RECENT} == 0)",
        },
        # The rank-down alert's memory of a target (static targets carry no run_id or rank on `up`): the run and
        # rank it served last, valued when it last did. Carried forward by reading its own value (`or` keeps the
        # value read now where the target serves that run and rank), for the lookback; a target that fails a
        # scrape has its series marked stale, so only the carried value is left. A target that served an older
        # run within the lookback keeps that one too, older: the alert takes the newest. Equal to the newest
        # sample of a range read over the lookback, with one instant read per target instead of every sample of
        # the lookback (what a 30 minute range cost at thousands of ranks). What a range read would find and
        # this does not: data from before a gap longer than the lookback delta in Prometheus's own evaluations
        # (a restart of more than 5 minutes).
        {
            "record": RANK_SEEN_AT,
            "expr": f"max by (job, instance, {RANK}) (timestamp({info}))\nor\n{RANK_SEEN_AT} >= time() - {lookback}",
        },
        # Ranks whose last word within the lookback was "finished" (1): gone, not down. Valued the evaluation that
        # read it (the lookback ends up to a scrape interval after a range read's would), carried the same way,
        # and dropped as soon as the rank serves anything else (a resumed rank serves 0 again).
        {
            "record": RANK_FINISHED_AT,
            "expr": f"max by ({RANK}) ({finished} == 1) * 0 + time()\n"
            f"or\n"
            f"(\n  {RANK_FINISHED_AT} >= time() - {lookback}\n  unless on (run_id, rank)\n  {finished}\n)",
        },
    ]


def alerts(t: Tunables) -> list[Alert]:
    last_step = f"{metric_name('last_step_timestamp_seconds')}{ONE_PER_NODE}"
    started = f"{metric_name('phase_started_timestamp_seconds')}{ONE_PER_NODE}"
    phase = f"{metric_name('phase')}{ONE_PER_NODE}"
    return [
        Alert(
            "RankscopeRunStalled",
            # Every rank completes every step (ranks are at most a step apart): one rank per node stands for all.
            f"(\n"
            f"  time() - max by ({RUN}) ({last_step} > 0) > {num(t.stall_seconds)}\n"
            f"  or\n"
            # Before the first step: ranks inside it (reading data, computing, in a collective) with no phase change
            # for as long. A rank still loading its model is idle, not in a step, and not counted.
            f"  time() - max by ({RUN}) ({started} and on ({RANK}) ({phase} > {_STEP_BOUNDARY} < {_CHECKPOINT}))\n"
            f"  > {num(t.stall_seconds)}\n"
            f"  unless on ({RUN})\n"
            f"  ({last_step} > 0)\n"
            f")\n"
            f"unless on ({RUN})\n"
            f"{PAUSED_MAX} > 0",
            t.stall_for,
            t.stall_severity,
            "A run serves metrics but has not completed a step for a long time.",
            "Run {{ $labels.run_id }} has completed no step for {{ $value | humanizeDuration }} while its ranks "
            "still serve metrics and it is not paused. It is hung (a collective, the data loader, I/O).",
        ),
        Alert(
            "RankscopeRankDown",
            # A rank whose last word was "finished cleanly" (rankscope_run_finished) is gone, not down.
            f"{RANK_DOWN}\nunless on (run_id, rank)\n{RANK_FINISHED_AT}",
            t.rank_down_for,
            t.rank_down_severity,
            "A rank of a live run cannot be scraped.",
            f"Prometheus cannot scrape {RANK_TEXT} at {{{{ $labels.instance }}}} for {t.rank_down_for}. The process "
            "died or hangs so badly it cannot serve metrics; the other ranks will stall in their next collective.",
            ended_runs=True,  # a run whose ranks all vanished has ended: this is its alert
        ),
        Alert(
            "RankscopeRankVanished",
            # Set by the rank's next process when the one before it left no word of its ending (rankscope.exits):
            # torchrun restarts the group in seconds, before RankscopeRankDown's `for`, and only this names the
            # rank that died rather than those the agent stopped after it.
            RANK_VANISHED_RECENT,
            t.vanished_for,
            t.vanished_severity,
            "A rank's process died without a word and the group was restarted.",
            f"The previous process of {RANK_TEXT} ended without a word (killed by a signal it did not handle: "
            "SIGKILL, the OOM killer; or a crash in native code), and torchrun started the group again; it trains "
            "on from the newest checkpoint. Look at the node's kernel log (dmesg: the OOM killer) and torchrun's "
            f"output for the exit status. Resolves {t.vanished_window} after the restart.",
        ),
        Alert(
            "RankscopeRunPaused",
            f"{PAUSED_MAX} > 0",
            t.paused_for,
            t.paused_severity,
            "A run has been paused by a control action for a long time.",
            f"Run {{{{ $labels.run_id }}}} has been paused for more than {t.paused_for}. Resume it or stop it.",
        ),
    ]
