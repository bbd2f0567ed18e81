"""A live rank of the reference trainer at demo.yaml's settings stays within the series budget.

Prometheus's memory and rule time grow with series per rank times ranks (benchmarks/README.md, "Scale"):
at 4096 ranks every series a rank adds costs about 4096 stored series. The budget (issue 32) is at most 100
series per rank with the reference trainer's settings, after its first validation and checkpoint, when every
split, checkpoint series and control outcome it will expose mid-run exists. Everything on the page counts:
the collective view and the phase (docs/collectives.md), the probes, the trainer's own metrics.

One exemption: rank 0's goodput ledger (`rankscope_goodput_seconds_total`, one series per bucket; issue 25,
docs/goodput.md) is the job's wall time, served by rank 0 alone, so it is stored once per job, not once per
rank, and does not grow with the ranks. It is left out of the count on rank 0 (no other rank serves it).
"""

from __future__ import annotations

import collections

import pytest

from tests.support import samples

#: Issue 32's goal: "Series per rank <= 100 on a live trainer rank (demo.yaml), everything counted".
SERIES_PER_RANK_BUDGET = 100
#: Series a job keeps once (on rank 0), not once per rank: they do not grow with the ranks.
_JOB_FAMILIES = ("rankscope_goodput_seconds_total",)


@pytest.mark.integration
def test_a_demo_rank_serves_at_most_the_budget_of_series(trainer_job) -> None:
    job = trainer_job("budget", ["run.max_steps=100000"], config="trainer/rankscope_trainer/configs/demo.yaml")
    validated_and_saved = lambda: job.records("val") and job.records("checkpoint")  # noqa: E731
    job.wait_for(validated_and_saved, "the first validation and checkpoint", timeout=600)
    for rank in (0, 1):
        found = [name for name, _ in samples(job.page(rank)) if name not in _JOB_FAMILIES]
        biggest = ", ".join(f"{name} {count}" for name, count in collections.Counter(found).most_common(8))
        assert len(found) <= SERIES_PER_RANK_BUDGET, f"rank {rank} serves {len(found)} series; most: {biggest}"
