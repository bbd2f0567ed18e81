"""Hangs: a run that makes no progress, with the rank that holds it up and what that rank is doing.

Every rank serves its phase (``rankscope_phase``, an index into ``rankscope.contract.PHASES``) and how many
collectives it has started (``rankscope_collectives_total``) from its metrics thread, which a blocked
training thread cannot freeze. A run is hung once no rank has completed a step, and no rank has ended a
checkpoint, validation or pause, for longer than the run's threshold (``hang_step_multiple`` times its recent
step time, never below ``hang_floor_seconds``): the definition the goodput ledger's ``hang`` bucket uses
(:mod:`rankscope.hang_threshold`), so both date the hang from the same last activity. The suspects are:

- ``outside_collective``: a rank that is not in a collective while other ranks of the run wait in one (a
  data loader that never delivers, a forward that never ends, a rank that took another branch);
- ``lagging_collectives``: a rank that waits in a collective but has started fewer than the others (it
  skipped or reordered one, so it waits in a collective the others have passed);
- ``every_rank_in_collective``: every rank waits in a collective, all started alike: no single rank is
  behind (the network, NCCL, a wedged switch or device). One alert for the run, without a rank.

A paused run, a checkpoint or validation within its own limit (``hang_checkpoint_limit_seconds``,
``hang_validation_limit_seconds``), the time until the threshold after one ends, start-up and each
incarnation's first step (no step completed yet: ``rankscope_last_step_timestamp_seconds`` is 0) and a run
that still completes steps never fire it. Its value is the time since the run's last activity: its last step
or, where later, the last evaluation that found it excused (the end of that phase, to within an interval).
`RankscopeRunStalled` (liveness) stays as the catch-all for loops that serve no phase and for a first step
that never ends (after ``stall_seconds`` with no phase change); Alertmanager inhibits it while this alert fires.
"""

from __future__ import annotations

from rankscope.contract import PHASES
from rankscope.mixin.config import Tunables, effect, sentence
from rankscope.mixin.promql import (
    COLLECTIVES_MAX,
    COLLECTIVES_MIN,
    COLLECTIVES_NODE_MAX,
    COLLECTIVES_NODE_MIN,
    HANG_CANDIDATE_COLLECTIVES,
    HANG_CANDIDATE_PHASE,
    HANG_EXCUSED_AT,
    HANG_NODE_EXCUSED,
    HANG_STALLED,
    HANG_STEP_COUNT_NODE_RATE,
    HANG_STEP_SECONDS,
    HANG_STEP_SUM_NODE_RATE,
    HANG_SUSPECTS,
    HANG_THRESHOLD,
    LAST_STEP_AGE,
    NODE,
    ONE_PER_NODE,
    PHASE_NODE_IN_COLLECTIVE,
    PHASE_NODE_RANKS,
    PHASE_RANKS,
    RANK,
    RUN,
    metric_name,
    num,
    rate_by,
)
from rankscope.mixin.rules import Alert

_COLLECTIVE = PHASES.index("collective")
_CHECKPOINT, _VALIDATION, _PAUSED = PHASES.index("checkpoint"), PHASES.index("validation"), PHASES.index("paused")


def _phase(name: str) -> str:
    return f"{metric_name('phase')} == {PHASES.index(name)}"


def _within(started: str, limit: float, phases: str) -> str:
    """Ranks in one of `phases` (a filter on the phase's value) for less than `limit` seconds."""
    return f"((time() - {started} < {num(limit)}) and on ({RANK}) ({metric_name('phase')} {phases}))"


def _counts() -> str:
    return f"sum by ({RANK}) ({metric_name('collectives_total')})"


def _phase_excuses(t: Tunables, started: str) -> list[str]:
    """Ranks in a phase that excuses their run: checkpoint and validation within their limits, and paused.

    With equal limits (the default) one read of the phase and one of its start serve all three: a rank's age in
    its phase times 1 for a checkpoint or a validation, times 0 when paused (0 is below any limit). The
    phases are neighbours in rankscope.contract.PHASES (checked here)."""
    assert _VALIDATION == _CHECKPOINT + 1 and _PAUSED == _VALIDATION + 1, "the excused phases must be neighbours"
    phase = metric_name("phase")
    if t.hang_checkpoint_limit_seconds == t.hang_validation_limit_seconds:
        factor = f"clamp_max({_PAUSED} - ({phase} >= {_CHECKPOINT}), 1)"
        return [f"((time() - {started}) * {factor} < {num(t.hang_checkpoint_limit_seconds)})"]
    return [
        _within(started, t.hang_checkpoint_limit_seconds, f"== {_CHECKPOINT}"),
        _within(started, t.hang_validation_limit_seconds, f"== {_VALIDATION}"),
        f"({_phase('paused')})",
    ]


def _excuses(t: Tunables) -> list[str]:
    """Ranks whose phase excuses their run from the hang alert, and the paused runs' local ranks 0 (a pause is
    applied on every rank at one step: one rank per node stands for all)."""
    started = metric_name("phase_started_timestamp_seconds")
    return [*_phase_excuses(t, started), f"({metric_name('paused')}{ONE_PER_NODE} > 0)"]


#: Run-level records each shard of the sharded layout also evaluates over its own ranks (renamed there,
#: rankscope.mixin.layout): the hang candidates' gate. A shard's view of its run's last step is at least as old as
#: the run's (its nodes are some of the run's), and its step time the run's (every rank completes every step).
SHARD_VIEWS = (HANG_STEP_SECONDS, LAST_STEP_AGE)
#: Shard records present only while their condition holds, or that must not outlive their node (an excuse): the
#: global server reads only their fresh samples (a federated series that vanished keeps its last sample there for
#: the lookback delta). What decides when the alert fires is present for as long as the node serves (a phase
#: count, the excuse's 0 or 1), so that its end reaches the global server within the federation's interval.
TRANSIENT = (HANG_CANDIDATE_PHASE, HANG_CANDIDATE_COLLECTIVES, HANG_NODE_EXCUSED)
#: The candidates are recorded from half the hang threshold on: before the run-level alert condition can hold,
#: so that they have reached the global server by then.
_CANDIDATE_SHARE = 0.5


def shard_records(t: Tunables) -> list[dict[str, str]]:
    """Each node's part of what the suspects compare, and each rank's phase and collective count while its run may
    be hung. One server computes them inside the records below; the sharded layout's shards record them, so that
    the global server reads one series per node (and per rank only for a run that may be hung), not four per rank
    at every evaluation."""
    phase = metric_name("phase")
    excuses = _excuses(t)
    # Half the threshold (HANG_THRESHOLD's expression, halved), read from the same level-1 series as the threshold so
    # that the suspects stay two recording levels above the scraped data.
    floor = t.hang_floor_seconds * _CANDIDATE_SHARE
    half = (
        f"clamp_min(last_over_time({HANG_STEP_SECONDS}[{t.hang_step_lookback}]) * "
        f"{num(t.hang_step_multiple * _CANDIDATE_SHARE)}, {num(floor)})"
    )
    may_be_hung = f"({LAST_STEP_AGE} > on ({RUN}) ({half} or on ({RUN}) {LAST_STEP_AGE} * 0 + {num(floor)}))"
    step = metric_name("step_duration_seconds")
    return [
        # Each node's part of HANG_STEP_SECONDS (its local ranks 0's rates), for its sharded layout's form.
        {"record": HANG_STEP_SUM_NODE_RATE, "expr": rate_by(NODE, f"{step}_sum", t.hang_step_window, ONE_PER_NODE)},
        {"record": HANG_STEP_COUNT_NODE_RATE, "expr": rate_by(NODE, f"{step}_count", t.hang_step_window, ONE_PER_NODE)},
        {"record": PHASE_NODE_RANKS, "expr": f"count by ({NODE}) ({phase})"},
        {"record": PHASE_NODE_IN_COLLECTIVE, "expr": f"sum by ({NODE}) ({phase} == bool {_COLLECTIVE})"},
        {"record": COLLECTIVES_NODE_MAX, "expr": f"max by ({NODE}) ({_counts()})"},
        {"record": COLLECTIVES_NODE_MIN, "expr": f"min by ({NODE}) ({_counts()})"},
        {
            "record": HANG_NODE_EXCUSED,
            "expr": f"max by ({NODE}) (\n  " + "\n  or\n  ".join(excuses) + f"\n) * 0 + 1\n"
            # 0 while the node's local rank 0 serves and nothing excuses: one rank per node, not every rank's phase.
            f"or\nmax by ({NODE}) ({metric_name('paused')}{ONE_PER_NODE}) * 0",
        },
        {"record": HANG_CANDIDATE_PHASE, "expr": f"{phase} and on ({RUN}) {may_be_hung}"},
        {"record": HANG_CANDIDATE_COLLECTIVES, "expr": f"{_counts()} and on ({RUN}) {may_be_hung}"},
    ]


def sharded_forms(t: Tunables) -> dict[str, str]:
    """The run's step time from its nodes' rates: the global server reads no rank's series over a window."""
    in_collective = f"sum by ({RUN}) ({PHASE_NODE_IN_COLLECTIVE})"
    return {
        HANG_STEP_SECONDS: f"sum by ({RUN}) ({HANG_STEP_SUM_NODE_RATE})\n/\n"
        f"(sum by ({RUN}) ({HANG_STEP_COUNT_NODE_RATE}) > 0)",
        # The ranks in a collective and the others: all the suspects read of the phase counts.
        PHASE_RANKS: f'label_replace({in_collective} > 0, "phase", "{_COLLECTIVE}", "", "")\nor\n'
        f'label_replace(sum by ({RUN}) ({PHASE_NODE_RANKS}) - {in_collective} > 0, "phase", "other", "", "")',
        HANG_EXCUSED_AT: f"max by ({RUN}) ({HANG_NODE_EXCUSED} == 1) * 0 + time()",
    }


def records(t: Tunables) -> list[dict[str, str]]:
    """Every rank's phase, phase start, last step and collective count is read at most three times per
    evaluation (each read of a per-rank series costs about its number of ranks in series lookups): the run-level
    facts the suspects need are recorded first, and the suspects themselves only for a run past its threshold."""
    in_collective = f'{PHASE_RANKS}{{phase="{_COLLECTIVE}"}}'
    excuses = _excuses(t)
    # A run that may be hung: it completed a step, but none for longer than the floor (below which the alert
    # cannot fire).
    maybe_hung = f"({LAST_STEP_AGE} > {num(t.hang_floor_seconds)})"
    since_excused = f"(time() - max_over_time({HANG_EXCUSED_AT}[{t.hang_step_lookback}]))"
    last_step = metric_name("last_step_timestamp_seconds")
    step = metric_name("step_duration_seconds")
    return [
        {
            # Absent while no step completes (0/0 is left out), so the lookback keeps the last real value. The
            # latest mean, not the highest in the lookback: a long first step (compilation) would otherwise hold
            # the threshold up for the whole lookback, and the hang alert late by as much.
            "record": HANG_STEP_SECONDS,
            "expr": f"sum by ({RUN}) (rate({metric_name('step_duration_seconds', 'sum')}{ONE_PER_NODE}"
            f"[{t.hang_step_window}]))\n"
            f"/\n"
            f"(sum by ({RUN}) (rate({step}_count{ONE_PER_NODE}[{t.hang_step_window}])) > 0)",
        },
        {
            # How old the run's last step was when its ranks were last scraped: the newest evidence, never the age
            # of the scrape (between two 15 s scrapes a healthy run's newest sample is up to 15 s old, more than
            # the 8 s floor). Absent until a rank of the run completed a step (0: start-up, the first step). A
            # hang is seen at the first scrape past the threshold, at most a scrape interval after it began.
            # Every rank completes every step, so ranks are at most a step apart: one rank per node stands for all.
            "record": LAST_STEP_AGE,
            "expr": f"min by ({RUN}) (timestamp({last_step}{ONE_PER_NODE}) - ({last_step}{ONE_PER_NODE} > 0))",
        },
        {
            "record": HANG_THRESHOLD,
            "expr": f"clamp_min(last_over_time({HANG_STEP_SECONDS}[{t.hang_step_lookback}]) * "
            f"{num(t.hang_step_multiple)}, {num(t.hang_floor_seconds)})\n"
            f"or on ({RUN})\n"
            f"({LAST_STEP_AGE} * 0 + {num(t.hang_floor_seconds)})",
        },
        {
            # A run with a rank checkpointing or validating within its limit, or paused, is not hung. Valued the
            # evaluation time: the last value is when the phase ended (to within an interval), as the ledger
            # dates it; a run is not hung the moment a long checkpoint ends, only once nothing followed it for
            # the threshold.
            "record": HANG_EXCUSED_AT,
            "expr": f"max by ({RUN}) (\n  " + "\n  or\n  ".join(excuses) + "\n) * 0 + time()",
        },
        {
            # From the last activity; absent until the run's ranks completed a step (start-up, the first step).
            # The smaller of the last step's age (as last scraped) and the time since the run was last excused.
            "record": HANG_STALLED,
            "expr": f"({LAST_STEP_AGE} <= on ({RUN}) {since_excused})\n"
            f"or on ({RUN})\n"
            f"({since_excused} < on ({RUN}) {LAST_STEP_AGE})\n"
            f"or on ({RUN})\n"
            f"{LAST_STEP_AGE}",
        },
        # What the suspects compare each rank with: one read of the phase, and the counts from each node's part.
        {"record": PHASE_RANKS, "expr": f'count_values by ({RUN}) ("phase", {metric_name("phase")})'},
        {"record": COLLECTIVES_MAX, "expr": f"max by ({RUN}) ({COLLECTIVES_NODE_MAX})"},
        {"record": COLLECTIVES_MIN, "expr": f"min by ({RUN}) ({COLLECTIVES_NODE_MIN})"},
        {
            # Value: the suspect's phase index; label `suspect`: why it is one (see the module docstring). Only
            # for a run without a step for longer than the floor, below which the alert cannot fire: a healthy
            # run, whose ranks are in and out of collectives at every scrape, records none. Each branch joins
            # with those few runs before it labels anything.
            "record": HANG_SUSPECTS,
            "expr": f"label_replace(\n"
            f"  {HANG_CANDIDATE_PHASE} != {_COLLECTIVE} and on ({RUN}) ({in_collective} and on ({RUN}) {maybe_hung}),\n"
            f'  "suspect", "outside_collective", "", ""\n'
            f")\n"
            f"or\n"
            f"label_replace(\n"
            f"  ({HANG_CANDIDATE_PHASE} == {_COLLECTIVE})\n"
            f"  and on ({RANK})\n"
            f"  ({HANG_CANDIDATE_COLLECTIVES} < on ({RUN}) group_left ()"
            f" ({COLLECTIVES_MAX} and on ({RUN}) {maybe_hung})),\n"
            f'  "suspect", "lagging_collectives", "", ""\n'
            f")\n"
            f"or\n"
            f"label_replace(\n"
            f"  max by ({RUN}) ({in_collective} and on ({RUN}) {maybe_hung}) * 0 + {_COLLECTIVE}\n"
            f"  and on ({RUN}) (sum by ({RUN}) ({in_collective}) == sum by ({RUN}) ({PHASE_RANKS}))\n"
            f"  and on ({RUN}) ({COLLECTIVES_MIN} == {COLLECTIVES_MAX}),\n"
            f'  "suspect", "every_rank_in_collective", "", ""\n'
            f")",
        },
    ]


def _named_suspects() -> str:
    """The suspects with their phase's name as a label (few series: only the recorded suspects are read)."""
    return "\nor\n".join(
        f'label_replace({HANG_SUSPECTS} == {index}, "phase", "{name}", "", "")' for index, name in enumerate(PHASES)
    )


def alerts(t: Tunables) -> list[Alert]:
    if t.hang_action:
        acts, said = effect(t.hang_action)
        then = (f"; {acts}", f" {sentence(said)}.")
    else:
        then = ("", " Run `rankscope-ctl stacks` to see every rank's stacks, then restart the job.")
    who = (
        '{{ if eq $labels.suspect "every_rank_in_collective" }}every rank waits in the same collective, all '
        "having started as many: no single rank is behind (the network, NCCL, a wedged switch or device)"
        '{{ else if eq $labels.suspect "outside_collective" }}rank {{ $labels.rank }} (node {{ $labels.node }}) '
        "is in phase {{ $labels.phase }}, outside the collective the other ranks wait in"
        "{{ else }}rank {{ $labels.rank }} (node {{ $labels.node }}) waits in a collective but has started fewer "
        "than the other ranks: it skipped or reordered one{{ end }}"
    )
    return [
        Alert(
            "RankscopeRankHung",
            f"(\n{_named_suspects()}\n) * 0\n"
            f"+ on ({RUN}) group_left ()\n"
            f"({HANG_STALLED} > {HANG_THRESHOLD})\n"
            f"unless on ({RUN})\n"
            f"{HANG_EXCUSED_AT}",
            t.hang_for,
            t.hang_severity,
            f"A run makes no progress and one rank (or the network) holds it up{then[0]}.",
            "Run {{ $labels.run_id }} has made no progress for {{ $value | humanizeDuration }}: no step, no "
            "checkpoint, validation or pause ended (threshold: "
            f"{num(t.hang_step_multiple)}x its recent step time, at least {num(t.hang_floor_seconds)}s): {who}."
            f"{then[1]}",
            t.hang_action,
        ),
    ]
