"""The whole product end to end: failures in a real run fire the right alerts and the right actions.

Each scenario starts its own stack (tests/e2e/harness.py): the real Prometheus and
Alertmanager with the repository's rules and routes (1 s intervals, short `for`s),
the reference trainer on 2 CPU ranks under torchrun with its control endpoint, and
a pager sink. A fault switch of the trainer (trainer/rankscope_trainer/faults.py) injects a real
failure; the test follows it through Prometheus, Alertmanager, the pager and the
trainer's control endpoint, polling each with a deadline.

A healthy run of the same kind fires nothing, and every dashboard panel's query
returns data from its Prometheus.
"""

from __future__ import annotations

import re
import statistics
import time

import psutil
import pytest
from rankscope.mixin.dashboards.queries import panel_queries
from rankscope_trainer.checkpoint import read_checkpoint

from devstack.jobs import TrainerJob
from devstack.narrator import Narrator
from tests.e2e.harness import (
    LINGER_SECONDS,
    RATE_INTERVAL,
    UNTIL_STOPPED,
    Stack,
    record_latency,
    short_labels,
    step_started_at,
    unix_time,
)
from tests.support import sample_value

pytestmark = pytest.mark.e2e

GIB = 1024**3

#: The host-memory alert line sits this far above what the machine uses once the trainer runs.
MEMORY_MARGIN = GIB
#: Latency that fails a scenario: well above the 5 s target, so a loaded CI machine does not flake.
LATENCY_LIMIT_SECONDS = 20.0


def _action_alerts_fired(stack: Stack) -> list[str]:
    return [short_labels(labels) for labels in stack.fired() if "action" in labels]


def _expect_page_if_rule_says_so(stack: Stack, alertname: str) -> None:
    """A page for `alertname` arrives if its rule says severity=page; otherwise none has (by now, seconds
    after the alert fired, Alertmanager's 1 s group_wait is long over)."""
    if stack.rules[alertname]["labels"]["severity"] == "page":
        stack.pager.wait_for(lambda d: any(a["labels"]["alertname"] == alertname for a in d.body["alerts"]), 30,
                             stack.diagnose)  # fmt: skip
    else:
        assert not stack.pages(alertname), f"{alertname} is not a page, yet the pager got {stack.pages(alertname)}"


# --- 1. divergence ------------------------------------------------------------------------------

# The fault must make the loss diverge for certain, and leave a model that a lower rate can save. At step
# 251 (just after a log boundary, as `step_started_at` needs) the schedule has decayed to its floor (2e-4)
# and the model is trained (loss ~0.3); x40 (8e-3) throws the loss to 4-7x and holds it there. A smaller
# blow-up is a gamble: the model re-adapts, and how far the loss climbs depends on floating-point noise,
# which differs between CPUs (x9 at step 101 reached the alert's 2x on some machines and seeds, not on
# others: a CI run never fired). x60 kills the model (a constant log 16) within 10 steps, before the
# alert's seconds reach the loop. Measured with the fault at step 250 over seeds 0-5, the rule replayed on
# their logs at every scrape phase, a reduction 40 or 80 steps after the fault: all crossed the line
# within 41 steps, none died, all met the recovery check below. Revisit if the test config's model,
# optimiser or schedule changes.
DIVERGE_AT = 251
DIVERGE_FACTOR = 40
#: Back near the schedule (x4 its floor): a lower rate, not the fault undone exactly.
REDUCE_FACTOR = 0.1


def _lr_drops(records: list[dict]) -> list[int]:
    """Steps whose learning rate is under half the previous step's (rank 0's log)."""
    lrs = {r["step"]: r["lr"] for r in records}
    return [step for step in sorted(lrs) if step - 1 in lrs and lrs[step] < 0.5 * lrs[step - 1]]


def test_a_diverging_loss_gets_the_learning_rate_reduced_once_on_both_ranks_and_recovers(stack) -> None:
    st = stack("divergence")
    job = st.start_trainer(
        [
            f"faults.diverge.at_step={DIVERGE_AT}",
            f"faults.diverge.lr_factor={DIVERGE_FACTOR}",
            f"control.lr_factor={REDUCE_FACTOR}",
        ],
        max_steps=UNTIL_STOPPED,
    )
    st.wait_for_firing("RankscopeLossDiverging", timeout=180)
    (applied,) = st.wait(lambda: st.settled("reduce_lr"), "reduce_lr to be applied", timeout=30)
    assert (applied["source"], applied["reason"]) == ("alert", "alert:RankscopeLossDiverging"), applied
    reduced_at = applied["step"]
    latency = record_latency("divergence", step_started_at(job, DIVERGE_AT), st, applied, "RankscopeLossDiverging")
    assert latency < LATENCY_LIMIT_SECONDS

    # The loss recovers: the mean of the last 20 steps falls under 60 % of the mean of the 20 steps after the
    # reduction.
    def recovered() -> bool:
        losses = job.losses()
        after = [losses[s] for s in range(reduced_at + 1, reduced_at + 21) if losses.get(s) is not None]
        latest = [losses[s] for s in sorted(losses)[-20:] if s > reduced_at + 20 and losses[s] is not None]
        return len(after) == 20 and len(latest) == 20 and statistics.mean(latest) < 0.6 * statistics.mean(after)

    st.wait(recovered, "the loss to recover after the reduction", timeout=120)

    # Once: one applied reduction (a repeat of the alert is a duplicate), counted by rank 0's endpoint.
    assert [r["step"] for r in st.settled("reduce_lr")] == [reduced_at]
    counted = sample_value(st.metrics(0), "rankscope_control_actions_total", action="reduce_lr", result="applied")
    assert counted == 1
    # At one step on both ranks: rank 0's log shows the one drop right after that boundary, and every
    # (step, rate) pair Prometheus scraped from either rank matches the rate rank 0 logged for that step.
    records = job.records("train")
    assert _lr_drops(records) == [reduced_at + 1], _lr_drops(records)
    # The comparison below needs a few scrapes of each rank after the reduction: on a fast machine the loss
    # recovers within a few seconds, so wait for them (counted as the comparison counts them) before stopping.
    for rank in (0, 1):
        st.wait(lambda r=rank: _scrapes_past(st, r, reduced_at + 2) >= 6, f"rank {rank} scraped after the cut", 60)
    assert st.stop_trainer() == 0
    # The whole log, read after those scrapes: a scrape is compared only where the log holds its next steps.
    records = job.records("train")
    for rank in (0, 1):
        _every_scraped_rate_matches_rank_0s_log(st, rank, records, changed_at=(DIVERGE_AT - 1, reduced_at))
    _expect_page_if_rule_says_so(st, "RankscopeLossDiverging")


def _scrapes_past(st: Stack, rank: int, step: int) -> int:
    """Prometheus's scrapes of rank `rank` that found it past `step`."""
    found = st.query_range(f'rankscope_global_step{{run_id="{st.run_id}", rank="{rank}"}} > {step}',
                           st.started_at, time.time())  # fmt: skip
    return len(found[0]["values"]) if found else 0


def _every_scraped_rate_matches_rank_0s_log(st: Stack, rank: int, records: list[dict], changed_at: tuple) -> None:
    """Rank `rank`'s learning rate, at each scrape, is what rank 0 logged for the step it had reached.

    The gauge holds the rate a step ended with, which the log records for the next step. A scrape is
    not atomic: the step counter and the rate may come from neighbouring steps (the schedule moves them
    ~1 % apart; a missed or doubled reduction, 70 %). Scrapes next to the boundaries in `changed_at`
    (the fault, the reduction) are left out.
    """
    used = {r["step"]: r["lr"] for r in records}
    window = (st.started_at, job_end(st.job))
    selector = f'run_id="{st.run_id}", rank="{rank}"'
    (steps,) = st.query_range(f"rankscope_global_step{{{selector}}}", *window)
    (rates,) = st.query_range(f'rankscope_learning_rate{{{selector}, param_group="0"}}', *window)
    step_at = {t: int(float(value)) for t, value in steps["values"]}  # one target: same scrape timestamps
    near_change = {step + offset for step in changed_at for offset in (-1, 0, 1)}
    compared = [
        (step_at[t], float(rate))
        for t, rate in rates["values"]
        if t in step_at and step_at[t] not in near_change and step_at[t] in used and step_at[t] + 2 in used
    ]
    wrong = [
        f"after step {step}: {rate:.6g}, rank 0 logged {[used[s] for s in (step, step + 1, step + 2)]}"
        for step, rate in compared
        if not any(rate == pytest.approx(used[s], rel=1e-6) for s in (step, step + 1, step + 2))
    ]
    assert not wrong, f"rank {rank}'s learning rate differs from rank 0's: {wrong}"
    assert sum(step > changed_at[-1] for step, _ in compared) >= 3, f"rank {rank}: too few scrapes to compare"


def job_end(job: TrainerJob) -> float:
    """When the run finished (rank 0's log)."""
    return float(job.records("finished")[-1]["time"])


# --- 2. memory pressure ---------------------------------------------------------------------------

BALLOON_AT = 61


def test_host_memory_pressure_gets_a_checkpoint_written_for_the_alert_that_loads(stack) -> None:
    balloon = 2 * MEMORY_MARGIN
    available = psutil.virtual_memory().available
    if available < balloon + 2 * GIB:
        pytest.fail(
            f"this scenario needs {(balloon + 2 * GIB) / GIB:.0f} GiB of free memory, {available / GIB:.1f} here"
        )
    st = stack("memory")
    job = st.start_trainer(
        [
            f"faults.memory_balloon.at_step={BALLOON_AT}",
            "faults.memory_balloon.rank=1",
            f"faults.memory_balloon.bytes={balloon}",
        ],
        max_steps=UNTIL_STOPPED,
    )
    st.wait_for_step(21)  # after the first validation: the trainer's own memory is all there
    with st.paused("set the memory line before the balloon") as step:  # a fast machine would reach it first
        assert step < BALLOON_AT, "the run reached the balloon before it paused; raise BALLOON_AT"
        threshold = st.calibrate_host_memory(MEMORY_MARGIN)

    st.wait_for_firing("RankscopeHostMemoryHigh", timeout=60)
    saved = st.wait(lambda: st.settled("checkpoint"), "the alert's checkpoint", timeout=30)
    assert [(r["source"], r["reason"]) for r in saved] == [("alert", "alert:RankscopeHostMemoryHigh")], saved
    record_latency("memory pressure", step_started_at(job, BALLOON_AT), st, saved[0], "RankscopeHostMemoryHigh")
    assert saved[0]["settled_at"] - step_started_at(job, BALLOON_AT) < LATENCY_LIMIT_SECONDS

    (written,) = [r for r in job.records("checkpoint") if r["reason"] == "alert:RankscopeHostMemoryHigh"]
    state = read_checkpoint(written["path"])  # complete and a rankscope checkpoint, or CheckpointError
    assert (state["step"], state["reason"]) == (saved[0]["step"], "alert:RankscopeHostMemoryHigh")
    for rank in (0, 1):  # every rank took part
        assert sample_value(st.metrics(rank), "rankscope_checkpoints_total", reason="alert") == 1
    print(f"host memory line {threshold:.3f}, balloon {balloon / GIB:.0f} GiB on rank 1")
    _expect_page_if_rule_says_so(st, "RankscopeHostMemoryHigh")
    assert st.stop_trainer() == 0


# --- 3. straggler -------------------------------------------------------------------------------


def test_a_straggler_is_named_in_the_imbalance_alert_and_paged_and_nothing_acts(stack) -> None:
    st = stack("straggler")
    st.start_trainer(["faults.straggler.at_step=31", "faults.straggler.rank=1", "faults.straggler.seconds=0.5"],
                     max_steps=UNTIL_STOPPED)  # fmt: skip
    st.wait_for_firing("RankscopeRankImbalance", timeout=120)
    named = {a["labels"]["rank"] for a in st.alerts("RankscopeRankImbalance")}
    assert named == {"1"}, named
    page = st.pager.wait_for(
        lambda d: any(a["labels"]["alertname"] == "RankscopeRankImbalance" for a in d.body["alerts"]), 30, st.diagnose
    )
    assert [a["labels"]["rank"] for a in page.body["alerts"]] == ["1"]
    assert page.body["status"] == "firing"
    # Nothing acts: no alert with an action fired, the control endpoint received and applied nothing.
    assert _action_alerts_fired(st) == []
    assert st.status()["recent"] == [] and st.status()["pending"] == []
    assert st.stop_trainer() == 0


# --- 4. non-finite loss ---------------------------------------------------------------------------

NAN_AT, NAN_STEPS = 41, 5


def test_non_finite_losses_are_skipped_on_every_rank_alike_counted_and_alerted(stack) -> None:
    st = stack("nonfinite")
    job = st.start_trainer(
        [f"faults.nonfinite.at_step={NAN_AT}", f"faults.nonfinite.steps={NAN_STEPS}", "faults.nonfinite.rank=0"],
        max_steps=UNTIL_STOPPED,
    )
    # The demo's commentary watches this run as it would `make demo`'s.
    said: list[str] = []
    narrator = Narrator(st.prometheus_url, f"http://127.0.0.1:{st.ports.control}", st.token, said.append, 0.5)
    narrator.start()
    st.wait_for_firing("RankscopeNonFiniteSteps", timeout=120)
    st.wait(lambda: max(job.losses(), default=0) > NAN_AT + NAN_STEPS, "rank 0's log past the NaN steps", 60)
    for rank in (0, 1):  # NaN on rank 0 reaches rank 1 through the all-reduce: both skip the same steps
        page = st.metrics(rank)
        assert sample_value(page, "rankscope_nonfinite_steps_total") == NAN_STEPS, f"rank {rank}"
        assert sample_value(page, "rankscope_skipped_steps_total") == NAN_STEPS, f"rank {rank}"
    losses = job.losses()
    assert [s for s in sorted(losses) if losses[s] is None] == list(range(NAN_AT, NAN_AT + NAN_STEPS))
    assert all(losses[s] is not None for s in losses if s >= NAN_AT + NAN_STEPS)  # the weights stayed finite

    def skipped_in_prometheus() -> float:
        found = st.query(f'max(rankscope_skipped_steps_total{{run_id="{st.run_id}"}})')
        return float(found[0]["value"][1]) if found else 0.0

    # Polled: the alert fires on the third NaN step, and the last scrape may predate the fifth.
    st.wait(lambda: skipped_in_prometheus() == NAN_STEPS, f"Prometheus to see {NAN_STEPS} skipped steps", 30)
    _expect_page_if_rule_says_so(st, "RankscopeNonFiniteSteps")
    # The rule's action: the learning rate is reduced once.
    applied = st.wait(lambda: st.settled("reduce_lr"), "the alert's reduce_lr", timeout=30)
    assert [r["reason"] for r in applied] == ["alert:RankscopeNonFiniteSteps"]
    told = f": reduce_lr from alert:RankscopeNonFiniteSteps: applied on all 2 ranks at step {applied[0]['step']}"
    st.wait(lambda: any(_timed(line, told) for line in said), "the narrator to tell the action", 10)
    narrator.stop()
    assert any(_timed(line, ": alert RankscopeNonFiniteSteps firing") for line in said), said
    assert st.stop_trainer() == 0


def _timed(line: str, text: str) -> bool:
    """A narration line `demo HH:MM:SS: ...` whose text after the time starts with `text` (which starts ": ")."""
    return re.match(r"demo \d\d:\d\d:\d\d", line) is not None and line[len("demo HH:MM:SS") :].startswith(text)


# --- 5. rank crash -------------------------------------------------------------------------------

CRASH_AT = 25  # checkpoints every 10 steps (test.yaml): the restart resumes from step 20


def test_a_crashed_rank_fires_rank_down_and_rank_vanished_and_the_job_resumes_from_its_last_checkpoint(stack) -> None:
    st = stack("crash")
    job = st.start_trainer(
        [f"faults.crash.at_step={CRASH_AT}", "faults.crash.rank=1"],
        max_steps=UNTIL_STOPPED,
        resume="auto",
        max_restarts=1,
    )
    st.wait_for_firing("RankscopeRankDown", timeout=120, rank="1")
    st.pager.wait_for(
        lambda d: any(
            a["labels"]["alertname"] == "RankscopeRankDown" and a["labels"].get("rank") == "1" for a in d.body["alerts"]
        ),
        30,
        st.diagnose,
    )
    st.wait_for_step(CRASH_AT + 10, timeout=180)  # the restarted group, past the step that crashed
    # The crash left no word of its ending (os._exit, as a segfault or the OOM killer): rank 1's next process
    # says so, and only rank 1 is named (rank 0 was stopped by torchrun, and said so).
    st.wait_for_firing("RankscopeRankVanished", timeout=60, rank="1")
    assert [a["labels"]["rank"] for a in st.alerts("RankscopeRankVanished")] == ["1"]
    resumes = job.records("resume")
    assert [r["step"] for r in resumes] == [20], resumes
    starts = [i for i, r in enumerate(job.records()) if r["type"] == "start"]
    assert len(starts) == 2
    after = [r["step"] for r in job.records()[starts[1] :] if r["type"] == "train"]
    assert after[0] == 21 and after == list(range(21, 21 + len(after)))
    # Prometheus sees both ranks again, stepping on from the checkpoint.
    st.wait(lambda: not st.alerts("RankscopeRankDown"), "RankscopeRankDown to resolve", 60)

    def slowest_rank_step() -> float:
        found = st.query(f'min(rankscope_global_step{{run_id="{st.run_id}"}})')
        return float(found[0]["value"][1]) if found else 0.0

    # Polled: the first scrape of the restarted rank may still read a step at or before the crash.
    st.wait(lambda: slowest_rank_step() > CRASH_AT, "both ranks past the crash step in Prometheus", 60)
    assert st.stop_trainer() == 0


# --- 6. data-loader bottleneck --------------------------------------------------------------------

SLOW_DATA_AT = 31
#: Slow steps watched after the data-loader alert fired: ~13 s, over the 5 s rate window plus the imbalance
#: alert's 5 s `for`.
WATCHED_STEPS = 20


@pytest.fixture(scope="module")
def slow_loader(module_stack) -> Stack:
    st = module_stack("slowdata")
    st.start_trainer(
        [f"faults.slow_data.at_step={SLOW_DATA_AT}", "faults.slow_data.rank=0", "faults.slow_data.seconds=0.6"],
        max_steps=UNTIL_STOPPED,
    )
    st.wait_for_firing("RankscopeDataLoaderBottleneck", timeout=120, rank="0")
    st.wait_for_step(st.status()["step"] + WATCHED_STEPS)
    assert st.stop_trainer() == 0
    return st


def test_a_slow_data_loader_on_one_rank_fires_the_data_loader_alert_for_that_rank(slow_loader) -> None:
    st = slow_loader
    ranks = {labels["rank"] for labels in st.fired() if labels["alertname"] == "RankscopeDataLoaderBottleneck"}
    assert ranks == {"0"}, "only the slow rank's loader is a bottleneck; the other waits in the all-reduce"
    _expect_page_if_rule_says_so(st, "RankscopeDataLoaderBottleneck")


def test_a_slow_data_loader_does_not_get_the_rank_waiting_for_it_paged_as_a_straggler(slow_loader) -> None:
    st = slow_loader
    blamed = [short_labels(a) for a in st.fired() if a["alertname"] == "RankscopeRankImbalance"]
    assert blamed == [], blamed


# --- 7. healthy run, and the dashboards on its data ----------------------------------------------

HEALTHY_STEPS = 150


@pytest.fixture(scope="module")
def healthy(module_stack) -> Stack:
    st = module_stack("healthy")
    job = st.start_trainer(max_steps=HEALTHY_STEPS)
    st.wait_for_step(21)
    st.calibrate_host_memory(MEMORY_MARGIN)  # the same line the memory scenario uses
    assert job.wait_exit(timeout=300) == 0, job.tail()
    return st


def _training_window(st: Stack) -> dict[str, float]:
    """From the trainer's start to its end (after which its targets are down: see the last test)."""
    return {"start": float(st.job.records("start")[0]["time"]), "end": job_end(st.job)}


def test_a_healthy_run_fires_no_alert_at_all(healthy) -> None:
    st = healthy
    window = _training_window(st)
    assert [r["step"] for r in st.job.records("train")][-1] == HEALTHY_STEPS
    fired = st.fired(**window)
    assert fired == [], [short_labels(labels) for labels in fired]
    assert [p for p in st.pages() if unix_time(p["startsAt"]) <= window["end"]] == []
    actions = st.query(f'rankscope_control_actions_total{{run_id="{st.run_id}"}} > 0')
    assert actions == [], actions
    assert not [r for r in st.job.records("checkpoint") if r["reason"].startswith("alert:")]


def test_every_dashboard_panel_returns_data_from_the_live_prometheus(healthy) -> None:
    st = healthy
    window = _training_window(st)
    queries = [q for q in panel_queries(run=st.run_id, rank=".*", rate_interval=RATE_INTERVAL) if not q.requires_gpu]
    assert len(queries) > 30, "the dashboards lost their panels"
    empty = []
    for query in queries:
        result = st.query_range(query.expr, window["start"], window["end"])
        if not any(series["values"] for series in result):
            empty.append(f"{query.dashboard} / {query.panel} [{query.ref_id}]: {query.expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_a_run_that_finished_cleanly_pages_no_one(healthy) -> None:
    st = healthy
    end = job_end(st.job)
    # The static targets are down once the linger is over; rank down would fire a scrape and the test
    # rules' `for` later. The ranks said rankscope_run_finished=1 while lingering, so nothing fires.
    finished = st.query(f'rankscope_run_finished{{run_id="{st.run_id}"}}[5m]')
    assert sorted(s["metric"]["rank"] for s in finished if float(s["values"][-1][1]) == 1) == ["0", "1"], finished
    settled = end + LINGER_SECONDS + 5
    st.wait(lambda: st.last_evaluation() > settled, "rule evaluations well past the linger", 30, trainer_alive=False)
    assert not st.query('up{job="rankscope"} == 1'), "the finished ranks' targets should be down"
    fired = [short_labels(labels) for labels in st.fired(start=end, end=time.time())]
    assert fired == [], fired
