import math

import torch
from rankscope.guards import LossSpikeDetector, agree_on_skip, nonfinite_flag


def test_nonfinite_flag_sees_nan_and_inf_in_tensors_and_floats():
    assert not bool(nonfinite_flag(torch.tensor(1.0), torch.tensor(2.0)))
    assert bool(nonfinite_flag(torch.tensor(float("nan")), torch.tensor(2.0)))
    assert bool(nonfinite_flag(torch.tensor(1.0), torch.tensor(float("inf"))))
    assert bool(nonfinite_flag(torch.tensor(1.0), math.inf))
    assert nonfinite_flag(None, 1.0) is False


def test_single_process_skip_decision_is_the_local_flag():
    assert agree_on_skip(torch.tensor(True)) is True
    assert agree_on_skip(False) is False


def _feed(detector, values):
    return [detector.update(v) for v in values]


def test_a_spike_is_counted_once_per_episode():
    detector = LossSpikeDetector(window=5, ratio=2.0, patience=1)
    events = _feed(detector, [1.0] * 5 + [5.0, 6.0, 1.0, 1.0, 7.0])
    assert events == [False] * 5 + [True, False, False, False, True]


def test_patience_requires_consecutive_candidates():
    detector = LossSpikeDetector(window=4, ratio=2.0, patience=2)
    events = _feed(detector, [1.0] * 4 + [3.0, 1.0, 3.0, 3.0])
    assert events == [False] * 4 + [False, False, False, True]


def test_no_spike_before_the_window_is_full_or_for_nonfinite_losses():
    detector = LossSpikeDetector(window=10, ratio=2.0)
    assert not any(_feed(detector, [1.0, 100.0, float("nan"), 1.0]))


def test_a_slow_decline_is_never_a_spike():
    detector = LossSpikeDetector(window=5, ratio=1.5)
    assert not any(_feed(detector, [10.0 - 0.05 * i for i in range(100)]))
