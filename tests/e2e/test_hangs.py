"""Hangs end to end (issue 26): a hung rank is named in seconds, its stacks written, the job trains again.

Each case starts its own stack (tests/e2e/harness.py: real Prometheus and Alertmanager at 1 s intervals
with the shipped rules' fast variant, the reference trainer on 2 gloo ranks under `torchrun
--max-restarts 1`). `faults.hang` blocks rank 1 at step HANG_AT in one of its three places; the test
follows the hang through RankscopeRankHung (rank and phase named), Alertmanager's webhook to the
trainer's `restart`, the stacks written beside the checkpoints, the group restarted by torchrun from the
newest checkpoint, and the restart settled `applied` by the new incarnation, with the lost steps counted.
It records hang -> alert and hang -> training again (goals: 10 s and 90 s at 1 s intervals).
A healthy run with checkpoints and validation raises no hang alert.
"""

from __future__ import annotations

import time

import pytest

from devstack.monitoring import unix_time
from tests.e2e.harness import LATENCIES, LOG_EVERY, UNTIL_STOPPED, Stack, step_started_at

pytestmark = pytest.mark.e2e

#: Checkpoints every CHECKPOINT_EVERY steps: the hang at step 31 leaves steps 21-30 after the newest one.
CHECKPOINT_EVERY = 20
HANG_AT = 31
LOST = HANG_AT - 1 - CHECKPOINT_EVERY
#: Goals at 1 s intervals (issue 31): the alert within 10 s of the hang with the shipped threshold (its 8 s
#: floor, then the scrape that shows the last step older than it and the evaluation after it, a second each at
#: most; these runs' steps are far below a tenth of it); the restart within 90 s.
ALERT_GOAL_SECONDS = 10.0
#: The healthy run's slow save: longer than the floor, so the gap it leaves before the next step is tested too.
SLOW_SAVE_SECONDS = 15.0
TRAINING_GOAL_SECONDS = 90.0

# kind -> (the phase the alert names for rank 1, the frame its stacks show)
KINDS = {
    "data": ("data_wait", "_hang_in_data_loader"),
    "compute": ("compute", "_hang_in_compute"),
    "collective": ("compute", "_hang_outside_the_collective"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_hung_rank_is_named_its_stacks_written_and_the_job_trains_again(stack, kind) -> None:
    phase, frame = KINDS[kind]
    st: Stack = stack(f"hang-{kind}")
    job = st.start_trainer(
        [
            f"faults.hang.at_step={HANG_AT}",
            "faults.hang.rank=1",
            f"faults.hang.kind={kind}",
            f"checkpoint.every_steps={CHECKPOINT_EVERY}",
        ],  # fmt: skip
        max_steps=UNTIL_STOPPED,
        resume="auto",
        max_restarts=1,
    )
    assert (HANG_AT - 1) % LOG_EVERY == 0
    alert = st.wait_for_firing("RankscopeRankHung", timeout=180)
    hung_at = step_started_at(job, HANG_AT)
    labels = alert["labels"]
    assert (labels["rank"], labels["phase"], labels["suspect"], labels["action"]) == (
        "1",
        phase,
        "outside_collective",
        "restart",
    ), labels
    alerted = unix_time(alert["activeAt"]) - hung_at

    (restart,) = st.wait(lambda: st.settled("restart"), "the restart applied by the new incarnation", 240)
    training_again = restart["settled_at"] - hung_at
    assert restart["source"] == "alert" and f"{LOST} step(s) after the newest checkpoint lost" in restart["detail"]
    # Rank 0 waited in the all-reduce its hung peer never joined: the restart did not wait for a boundary too.
    assert "s in all_reduce (data): no step boundary to wait for" in restart["detail"], restart["detail"]

    # Both ranks' stacks, taken while hung, beside the checkpoints; rank 1's shows where it blocks.
    (text,) = job.checkpoint_dir.glob("rankscope-stacks-restart-*.txt")
    summary = text.read_text().splitlines()[0]
    assert f"rank 1: {frame} in faults.py:" in summary, summary
    # Rank 0 waits in DDP's all-reduce, which runs in C++ under backward: its headline names the collective.
    assert "rank 0: in all_reduce (data): " in summary and "no stacks" not in summary, summary
    # The restarted group resumed from the newest checkpoint and trains on from it.
    assert [r["step"] for r in job.records("resume")] == [CHECKPOINT_EVERY]
    lost = f'rankscope_restart_lost_steps_total{{run_id="{st.run_id}"}}'
    st.wait(lambda: [s for s in st.query(lost) if float(s["value"][1]) == LOST], "the lost steps counted", 60)
    st.wait(lambda: not st.alerts("RankscopeRankHung"), "the hang alert to resolve", 60)
    # The restart raised no hang of its own: the new incarnation's start-up and first step, and the steps after
    # them, page nothing (a second page would carry another startsAt).
    st.wait_for_step(st.status()["step"] + CHECKPOINT_EVERY, timeout=120)  # past the resumed group's next save
    firing = {alert["startsAt"] for alert in st.pages("RankscopeRankHung") if alert.get("status") == "firing"}
    assert len(firing) <= 1, firing

    LATENCIES.append(
        f"hang ({kind}): alert {alerted:.1f}s after the hang (goal {ALERT_GOAL_SECONDS:g}s), training again "
        f"{training_again:.1f}s after it (goal {TRAINING_GOAL_SECONDS:g}s); {LOST} steps lost"
    )
    print(LATENCIES[-1])
    # The alert's activeAt is the evaluation that found the hang, its threshold the shipped one: no slack.
    assert alerted <= ALERT_GOAL_SECONDS, LATENCIES[-1]
    assert training_again <= TRAINING_GOAL_SECONDS + 30, LATENCIES[-1]
    assert st.stop_trainer() == 0


def test_a_healthy_run_with_checkpoints_and_validation_raises_no_hang_alert(stack) -> None:
    st: Stack = stack("hang-healthy")
    started = time.time()
    st.start_trainer(
        [f"checkpoint.every_steps={CHECKPOINT_EVERY // 2}", "faults.slow_checkpoint.at_step=40",
         f"faults.slow_checkpoint.seconds={SLOW_SAVE_SECONDS}"],
        max_steps=UNTIL_STOPPED,
    )  # fmt: skip
    # Long enough for the floor (8 s) to have passed many times over: start-up, the first step, checkpoints (one
    # of them longer than the floor, and the steps right after it), validation.
    st.wait_for_step(150, timeout=300)
    st.wait(lambda: time.time() - started > 60 or None, "a minute of training", 120)
    assert not [labels for labels in st.fired(started) if labels.get("alertname") == "RankscopeRankHung"]
    assert st.stop_trainer() == 0
