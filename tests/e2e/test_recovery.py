"""Recovery actions end to end: a fault in, the real alert, the action on both ranks at the same step.

- Poisoned data (faults.poison: a stretch of batches with scrambled captions) makes the loss diverge;
  with the shipped `divergence_action=rollback` (the e2e pack sets reduce_lr), RankscopeLossDiverging makes every rank
  load the checkpoint from before the incident and skip the window, and the loss falls back under its
  level before the poison.
- Host memory pressure (the memory balloon) with `memory_action=reduce_micro_batch`: every rank
  checkpoints, then halves its micro-batch and doubles gradient accumulation at the same step.

The stack is tests/e2e/harness.py's (real Prometheus and Alertmanager, 2 ranks under torchrun).
"""

from __future__ import annotations

import statistics

import psutil
import pytest

from tests.e2e.harness import UNTIL_STOPPED, record_latency, step_started_at
from tests.support import records_after_last, replay_rollback, sample_value

pytestmark = pytest.mark.e2e

GIB = 1024**3

# By step 120 the test model is trained (loss ~0.4); scrambled captions throw it far above twice that.
POISON_AT, POISON_BATCHES = 121, 40
#: Covers the poison left after the newest checkpoint before the alert's startsAt (checkpoints every 10 steps).
MARGIN = POISON_BATCHES + 10
#: The e2e rules' loss smoothing window and `for` (tests/e2e/harness.py): the rollback goes back that much before
#: startsAt (the time the alert fired).
LOOKBACK_SECONDS = 5.0 + 1.0
#: The run pauses from about this step until the rules' loss baseline (the median of the smoothed loss over
#: loss_baseline_window) is the trained loss. Without it the poison came 3 s into training, its baseline still
#: the first seconds' fall: whether twice that stayed under the collapsed loss (and so whether the alert fired)
#: hung on which batches the first scrapes caught, and one CI run's alert came only 137 s later.
PAUSE_FROM = 60
#: The baseline is the paused run's loss: its smoothed loss has held one value for the smoothing window, and the
#: baseline's median is that value (most of the window's evaluations were paused).
BASELINE_SETTLED = (
    "abs(run:rankscope_loss:window_median - run:rankscope_loss:smoothed) < 0.01"
    " and max_over_time(run:rankscope_loss:smoothed[5s]) == min_over_time(run:rankscope_loss:smoothed[5s])"
)


def test_poisoned_data_fires_divergence_and_every_rank_rolls_back_past_it(stack, trainer_job, tmp_path) -> None:
    st = stack("rollback")
    st.retune("divergence_action=rollback")
    poison = [f"faults.poison.at_batch={POISON_AT}", f"faults.poison.batches={POISON_BATCHES}"]
    job = st.start_trainer(
        ["checkpoint.every_steps=10", "checkpoint.keep=50", *poison, f"control.rollback_margin_batches={MARGIN}"],
        max_steps=UNTIL_STOPPED,
    )  # fmt: skip
    st.wait_for_step(PAUSE_FROM)
    with st.paused("let the loss baseline settle on the trained loss before the poison") as step:
        assert step < POISON_AT, "the run reached the poison before it paused"
        st.wait(lambda: st.query(BASELINE_SETTLED), "the loss baseline at the trained loss", timeout=90)
    st.wait_for_firing("RankscopeLossDiverging", timeout=240)
    (applied,) = st.wait(lambda: st.settled("rollback"), "the rollback to be applied", timeout=60)
    assert (applied["source"], applied["reason"]) == ("alert", "alert:RankscopeLossDiverging"), applied
    record_latency("rollback", step_started_at(job, POISON_AT), st, applied, "RankscopeLossDiverging")

    (event,) = job.wait_for(lambda: job.records("rollback"), "the rollback record")
    (skip,) = job.wait_for(lambda: job.records("skip"), "the skip record")
    restored = event["step"]
    # Back to before the poison: the alert's startsAt (when it fired, after the poison began) less its smoothing
    # window and `for` (the alert's incident_lookback_seconds), then the newest checkpoint before that (every 10
    # steps).
    poisoned_at = step_started_at(job, POISON_AT)
    logged = {r["step"]: r["time"] for r in job.records("train")}
    earliest = max((s for s, t in logged.items() if t <= poisoned_at - LOOKBACK_SECONDS), default=0) - 10
    assert earliest <= restored < POISON_AT, (event, applied, earliest)
    # The window skipped (data batches restored+1 .. restored+n) covers every poisoned batch not yet trained.
    assert restored + skip["batches"] >= POISON_AT + POISON_BATCHES - 1, skip
    for rank in (0, 1):
        skipped = job.wait_for(
            lambda r=rank: sample_value(st.metrics(r), "rankscope_skipped_batches_total"), f"rank {rank}'s skip count"
        )
        assert skipped == skip["batches"]

    records = job.records()
    before = {r["step"]: r["loss"] for r in records[: records.index(event)] if r["type"] == "train"}
    clean = statistics.mean(before[s] for s in range(POISON_AT - 10, POISON_AT))

    def recovered() -> bool:
        after = [r["loss"] for r in records_after_last(job.records(), "skip") if r["type"] == "train"]
        return len(after) >= 20 and statistics.mean(after[-10:]) < clean

    st.wait(recovered, f"the loss back under its pre-poison level {clean:.3f}", timeout=180)
    assert [r["status"] for r in st.settled("rollback", status=None)] == ["applied"]  # once
    assert st.stop_trainer() == 0
    # Resumed from the checkpoint it rolled back to, a run skips the same window and trains the same curve.
    replay_rollback(trainer_job, job, tmp_path, restored + 20, poison)


def test_host_memory_pressure_halves_the_micro_batch_on_both_ranks_after_a_checkpoint(stack) -> None:
    balloon = 2 * GIB
    if psutil.virtual_memory().available < balloon + 2 * GIB:
        pytest.fail(f"this scenario needs {(balloon + 2 * GIB) / GIB:.0f} GiB of free memory")
    st = stack("micro-batch")
    st.retune("memory_action=reduce_micro_batch")
    job = st.start_trainer(
        ["faults.memory_balloon.at_step=61", "faults.memory_balloon.rank=1", f"faults.memory_balloon.bytes={balloon}"],
        max_steps=UNTIL_STOPPED,
    )
    st.wait_for_step(21)
    with st.paused("set the memory line before the balloon") as step:  # a fast machine would reach it first
        assert step < 61, "the run reached the balloon before it paused"
        st.calibrate_host_memory(GIB)
    st.wait_for_firing("RankscopeHostMemoryHigh", timeout=90)
    applied = st.wait(lambda: st.settled("reduce_micro_batch"), "reduce_micro_batch to be applied", timeout=60)
    assert applied[0]["status"] == "applied" and applied[0]["reason"] == "alert:RankscopeHostMemoryHigh", applied
    record_latency("micro-batch", step_started_at(job, 61), st, applied[0], "RankscopeHostMemoryHigh")
    (event,) = job.records("micro_batch")[:1]
    assert (event["step"], event["micro_batch"], event["accumulation"]) == (applied[0]["step"], 8, 2)
    # The checkpoint first, at that very step.
    assert any(r["step"] == event["step"] and r["reason"].startswith("alert:") for r in job.records("checkpoint"))
    for rank in (0, 1):  # both ranks now train in micro-batches of 8
        job.wait_for(lambda r=rank: sample_value(st.metrics(r), "rankscope_micro_batch_size") == 8,
                     f"rank {rank} to report micro-batches of 8")  # fmt: skip
    # Training goes on with the same global batch: every step after the change trained and logged.
    job.wait_for(lambda: max(job.losses()) >= event["step"] + 20, "20 steps after the change")
    assert st.stop_trainer() == 0
