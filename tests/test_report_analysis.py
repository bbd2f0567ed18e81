"""rankscope.report.analysis: loss rate of change, LR-loss correlation, alignment, the straggler."""

from __future__ import annotations

import numpy as np
import pytest
from rankscope.report.analysis import align, rate_of_change, ratio_to_median, rolling_correlation, straggler
from rankscope.report.series import Series

from tests.report_series import compute_per_rank

TIMES = 1_800_000_000.0 + 5.0 * np.arange(100)


def test_the_rate_of_change_of_a_line_is_its_slope_in_every_window() -> None:
    steps = np.arange(1.0, 201.0)
    x, slope = rate_of_change(steps, 3.0 * steps + 1.0, window=20)
    assert list(x) == list(steps[19:])
    assert np.allclose(slope, 3.0)


def test_the_rate_of_change_turns_positive_where_the_loss_climbs_and_skips_missing_points() -> None:
    steps = np.arange(1.0, 101.0)
    loss = np.where(steps <= 60, 2.0 - 0.02 * steps, 0.8 + 0.05 * (steps - 60))
    loss[30:35] = np.nan  # non-finite steps are left out, not read as zero
    x, slope = rate_of_change(steps, loss, window=10)
    assert np.all(slope[x <= 60] == pytest.approx(-0.02))
    assert np.all(slope[x >= 70] == pytest.approx(0.05))
    assert not np.isnan(slope).any()
    assert len(x) == 95 - 9  # 100 points, 5 missing, and the first 9 have no full window


def test_too_few_points_give_no_rate_and_a_one_point_window_is_refused() -> None:
    assert [len(a) for a in rate_of_change(np.arange(5.0), np.arange(5.0), 10)] == [0, 0]
    with pytest.raises(ValueError, match="window must be >= 2 points, got 1"):
        rate_of_change(np.arange(5.0), np.arange(5.0), 1)


def test_rolling_correlation_is_one_minus_one_or_undefined() -> None:
    a = np.sin(np.linspace(0, 10, 80))
    assert np.allclose(rolling_correlation(a, 2 * a + 1, 10)[9:], 1.0)
    assert np.allclose(rolling_correlation(a, -a, 10)[9:], -1.0)
    assert np.isnan(rolling_correlation(a, a, 10)[:9]).all()
    flat = rolling_correlation(np.full(80, 1e-3), a, 10)  # a constant learning rate correlates with nothing
    assert np.isnan(flat).all()
    with pytest.raises(ValueError, match="different lengths: 80 and 79"):
        rolling_correlation(a, a[:-1], 10)


def test_align_pairs_values_at_the_times_both_series_have() -> None:
    a = Series({}, TIMES[:60], np.arange(60.0))
    b = Series({}, TIMES[40:], np.arange(60.0) * 10)
    b.v[0] = np.nan
    x, y = align(a, b)
    assert list(x) == list(np.arange(41.0, 60.0)) and list(y) == list(np.arange(1.0, 20.0) * 10)


def _compute(ranks: int, slow: int | None = None, factor: float = 2.0, from_index: int = 0) -> list[Series]:
    return compute_per_rank(TIMES, ranks, slow, factor, from_index, seed=3)


def test_the_straggler_is_the_rank_far_above_the_median() -> None:
    found = straggler(_compute(8, slow=5, factor=2.0))
    assert found.stands_out and found.rank == 5
    assert found.ratio == pytest.approx(2.0, rel=0.05)
    assert [rank for rank, _ in found.ranking][0] == 5 and len(found.ranking) == 8


def test_a_straggler_of_the_last_fifth_of_the_run_still_counts() -> None:
    found = straggler(_compute(4, slow=2, factor=1.8, from_index=80))
    assert found.stands_out and found.rank == 2


def test_balanced_ranks_and_a_single_rank_have_no_straggler() -> None:
    balanced = straggler(_compute(8))
    assert not balanced.stands_out and balanced.ratio < 1.1
    single = straggler(_compute(1, slow=0, factor=5.0))
    assert not single.stands_out
    assert straggler([]).rank is None


def test_ratios_to_the_median_line_up_ranks_by_time() -> None:
    times, ranks, ratios = ratio_to_median(_compute(3, slow=1, factor=3.0))
    assert list(times) == list(TIMES) and ranks == [0, 1, 2]
    assert np.median(ratios[1]) == pytest.approx(3.0, rel=0.05)


def test_with_two_ranks_the_slow_one_is_compared_with_its_peer_not_with_the_mean_of_both() -> None:
    found = straggler(_compute(2, slow=1, factor=2.7))
    # Against the median of both (their mean) it would be 2.7 / 1.85 = 1.46: under the line.
    assert found.stands_out and found.rank == 1 and found.ratio == pytest.approx(2.7, rel=0.05)
