"""The loop on VictoriaMetrics: a real fault goes vmagent -> VictoriaMetrics -> vmalert -> Alertmanager -> trainer.

The stack is the end-to-end harness's (tests/e2e/harness.py) with ``engine="victoriametrics"``:
vmagent scrapes the ranks with the shipped scrape job, VictoriaMetrics stores, vmalert evaluates
the generated rule files (the same as Prometheus's, same fast settings) and notifies the same
Alertmanager, whose route calls the trainer's control endpoint. The fault is the divergence
scenario's (a learning-rate spike), because its alert reads recorded series two levels deep
(the smoothed loss and its window minimum): each level is a round trip through VictoriaMetrics,
which is where vmalert is slower than Prometheus (devstack/vmstack.py says why and which flags
keep it short). The action must reach both ranks within the same bound as through Prometheus.

The fault comes once every recorded series the alert reads exists: VictoriaMetrics 1.79 makes a
series it has never seen searchable only after about 9 s, so in a run's first seconds each
recording level appears that much later (a property of a cold start, not of the loop). The test
pauses the run through its control endpoint until then, so the fault step stays the one tuned
for the Prometheus scenario.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import UNTIL_STOPPED, Stack, record_latency, step_started_at
from tests.e2e.test_scenarios import DIVERGE_AT, DIVERGE_FACTOR, LATENCY_LIMIT_SECONDS, REDUCE_FACTOR, _lr_drops
from tests.support import sample_value

pytestmark = pytest.mark.e2e

#: The run is paused this many steps before the fault (a step takes ~0.06-0.2 s here: room for the request).
PAUSE_BEFORE = 30


def _rank_uses_the_reduced_rate(st: Stack, rank: int, reduced_at: int) -> bool:
    """Rank `rank`'s learning rate, on its own page, is the rate rank 0 logged for the step it reached (the
    gauge holds the rate a step ended with, logged for the next step or the one after), after the reduction."""
    used = {r["step"]: r["lr"] for r in st.job.records("train")}
    page = st.metrics(rank)
    step = int(sample_value(page, "rankscope_global_step") or 0)
    rate = sample_value(page, "rankscope_learning_rate", param_group="0")
    logged = [used[s] for s in (step, step + 1, step + 2) if s in used]
    reduced = rate is not None and step > reduced_at + 1 and rate < 0.5 * used[reduced_at]
    return reduced and any(rate == pytest.approx(lr, rel=1e-6) for lr in logged)


def test_a_diverging_loss_is_acted_on_by_both_ranks_through_victoriametrics_and_vmalert(stack) -> None:
    st = stack("vm-divergence", engine="victoriametrics")
    job = st.start_trainer(
        [
            f"faults.diverge.at_step={DIVERGE_AT}",
            f"faults.diverge.lr_factor={DIVERGE_FACTOR}",
            f"control.lr_factor={REDUCE_FACTOR}",
        ],
        max_steps=UNTIL_STOPPED,
    )
    # Held just before the fault, the model trained, until both ranks' series are in VictoriaMetrics (through
    # vmagent, under the ranks' own identity labels) and the recorded loss the alert reads has caught up.
    st.wait_for_step(DIVERGE_AT - PAUSE_BEFORE)
    with st.paused("wait for the recorded series") as step:
        assert step < DIVERGE_AT - 1, "the run reached the fault before it paused"
        sel = f'run_id="{st.run_id}"'
        st.wait(lambda: len(st.query(f"rankscope_global_step{{{sel}}} > 0")) == 2, "both ranks stored", 60)
        caught_up = (
            f"run:rankscope_loss:window_median{{{sel}}} and on (run_id) abs(run:rankscope_loss:smoothed{{{sel}}}"
            f' - on (run_id) avg by (run_id) (rankscope_loss{{{sel}, split="train"}})) < 0.05'
        )
        st.wait(lambda: st.query(caught_up), "the recorded loss and its baseline to catch up", 120)
    st.wait_for_firing("RankscopeLossDiverging", timeout=180)
    (applied,) = st.wait(lambda: st.settled("reduce_lr"), "reduce_lr to be applied", timeout=30)
    assert (applied["source"], applied["reason"]) == ("alert", "alert:RankscopeLossDiverging"), applied
    latency = record_latency(
        "divergence via VictoriaMetrics", step_started_at(job, DIVERGE_AT), st, applied, "RankscopeLossDiverging"
    )
    assert latency < LATENCY_LIMIT_SECONDS, f"{latency:.1f}s from the fault to the action on all ranks"

    # Both ranks train on the reduced rate.
    for rank in (0, 1):
        st.wait(lambda r=rank: _rank_uses_the_reduced_rate(st, r, applied["step"]), f"rank {rank} on the new rate", 30)
    # The alert went through vmalert (its ALERTS series is in VictoriaMetrics) and no other alert acted.
    in_store = lambda: any(labels["alertname"] == "RankscopeLossDiverging" for labels in st.fired())  # noqa: E731
    st.wait(in_store, "vmalert's ALERTS series in VictoriaMetrics", timeout=30)
    assert [r["action"] for r in st.status()["recent"] if r["source"] == "alert"] == ["reduce_lr"]
    assert st.stop_trainer() == 0
    # Applied once, at one step boundary: rank 0's complete log shows one drop, right after it.
    records = job.records("train")
    assert _lr_drops(records) == [applied["step"] + 1], _lr_drops(records)
