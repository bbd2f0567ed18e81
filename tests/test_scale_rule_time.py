"""benchmarks.scale's rule time per evaluation interval: a group evaluated less often pays its time less often."""

from __future__ import annotations

import pytest

from benchmarks.scale import rule_seconds


def test_each_group_counts_as_often_as_it_runs_in_the_interval() -> None:
    medians = {"/etc/rules/hangs.yml;rankscope.hangs": 0.24, "rankscope.performance": 0.6}
    intervals = {"rankscope.hangs": 5.0, "rankscope.performance": 30.0}
    # hangs every 5 s: all of it; performance every 30 s: a sixth of it per 5 s.
    assert rule_seconds(medians, intervals, 5.0) == pytest.approx(0.24 + 0.1)


def test_a_group_the_rules_api_did_not_report_counts_at_the_evaluation_interval() -> None:
    assert rule_seconds({"rankscope.old": 0.5}, {}, 5.0) == pytest.approx(0.5)
