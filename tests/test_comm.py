from rankscope.comm import CommTimer, interval_union


def test_overlapping_bucket_reductions_count_once():
    assert interval_union([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]) == 1.5 + 1.0


def test_no_reductions_is_zero_time():
    assert interval_union([]) == 0.0


def test_take_step_hands_over_and_clears_the_step_intervals():
    timer = CommTimer()
    timer._host.extend([(1.0, 2.0), (1.5, 2.5)])  # what the hook appends from DDP's threads
    assert timer.take_step() == (1.5, [])
    assert timer.take_step() == (0.0, [])
