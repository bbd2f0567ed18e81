"""benchmarks.fakeranks serves pages that are not all alike: a straggler, a hung run, a paused run, a down page,
and the series a job keeps once on each run's rank 0 only (issue 32: rules measured on varied pages)."""

from __future__ import annotations

import collections
import math

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fakeranks import build_pages, parse_template

_TEMPLATE = """\
# HELP rankscope_phase What this rank is doing now.
# TYPE rankscope_phase gauge
rankscope_phase{run_id="t",rank="0",local_rank="0",node="n"} 3.0
# HELP rankscope_collectives_total Collectives started by this rank.
# TYPE rankscope_collectives_total counter
rankscope_collectives_total{run_id="t",rank="0",local_rank="0",node="n",dim="data"} 500.0
# HELP rankscope_last_step_timestamp_seconds Unix time at which this rank last completed a step.
# TYPE rankscope_last_step_timestamp_seconds gauge
rankscope_last_step_timestamp_seconds{run_id="t",rank="0",local_rank="0",node="n"} 1.7e+09
# HELP rankscope_compute_duration_seconds Per-rank compute time of a step.
# TYPE rankscope_compute_duration_seconds histogram
rankscope_compute_duration_seconds_bucket{run_id="t",rank="0",local_rank="0",node="n",le="+Inf"} 100.0
rankscope_compute_duration_seconds_count{run_id="t",rank="0",local_rank="0",node="n"} 100.0
rankscope_compute_duration_seconds_sum{run_id="t",rank="0",local_rank="0",node="n"} 5.25
# HELP rankscope_goodput_seconds_total The job's wall time by bucket.
# TYPE rankscope_goodput_seconds_total counter
rankscope_goodput_seconds_total{run_id="t",rank="0",local_rank="0",node="n",bucket="training"} 10.0
"""


def _samples(page, now: float) -> dict[str, list]:
    by_name = collections.defaultdict(list)
    for family in text_string_to_metric_families(page.render(now).decode()):
        for sample in family.samples:
            by_name[sample.name].append(sample)
    return by_name


def test_the_pages_hold_a_straggler_a_hung_run_a_paused_run_and_a_down_page():
    pages = build_pages(parse_template(_TEMPLATE), 256, 32, 8, "sim", 60.0, hang_after=0.0, down_after=5.0)
    assert len(pages) == 8
    started = pages[0].started
    now = started + 1.0
    # The large run: ranks in compute or in a collective, about half each, with equal collective counts.
    main = _samples(pages[0], now)
    assert {s.value for s in main["rankscope_phase"]} == {3, 4}
    assert len({s.value for s in main["rankscope_collectives_total"]}) == 1
    compute = {s.labels["rank"]: s.value for s in main["rankscope_compute_duration_seconds_sum"]}
    assert compute["1"] > 1.8 * compute["0"], compute  # the straggler
    assert [s.labels["rank"] for s in main["rankscope_goodput_seconds_total"]] == ["0"]  # rank 0's, once
    # The hung run (second-last page): one rank waits for data with one collective fewer, the others in one.
    hung = _samples(pages[6], now)
    assert {s.labels["run_id"] for s in hung["rankscope_phase"]} == {"sim-hung"}
    phases = {s.labels["rank"]: s.value for s in hung["rankscope_phase"]}
    assert phases.pop("1") == 2 and set(phases.values()) == {4}
    counts = {s.labels["rank"]: s.value for s in hung["rankscope_collectives_total"]}
    assert counts.pop("1") < min(counts.values()) == max(counts.values())
    # ...and its steps stopped: the last step's time and the counters hold still from the hang on.
    later = _samples(pages[6], now + 30.0)
    assert {s.value for s in later["rankscope_last_step_timestamp_seconds"]} == {
        s.value for s in hung["rankscope_last_step_timestamp_seconds"]
    }
    assert (
        later["rankscope_compute_duration_seconds_sum"][0].value
        == hung["rankscope_compute_duration_seconds_sum"][0].value
    )
    assert [s.labels["rank"] for s in hung["rankscope_goodput_seconds_total"]] == ["0"]
    # The paused run (last page): every rank paused.
    paused = _samples(pages[7], now)
    assert {(s.labels["run_id"], s.value) for s in paused["rankscope_phase"]} == {("sim-paused", 7)}
    # One page of the large run goes down (the third-last), the others stay up.
    assert [math.isfinite(page.down_at) for page in pages] == [False] * 5 + [True] + [False] * 2


def test_uniform_pages_are_one_run_of_ranks_alike():
    pages = build_pages(parse_template(_TEMPLATE), 64, 16, 8, "sim", 60.0, scenarios=False)
    samples = [s for page in pages for s in _samples(page, page.started + 1.0)["rankscope_phase"]]
    assert {s.labels["run_id"] for s in samples} == {"sim"} and len(samples) == 64
    assert all(not math.isfinite(page.down_at) for page in pages)
