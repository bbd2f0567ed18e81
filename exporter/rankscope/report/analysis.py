"""The analyses the report draws, on plain arrays (no Prometheus, no plotting).

- :func:`rate_of_change`: the loss's slope over a trailing window (least squares), so a
  person sees *when* it stopped falling or started climbing;
- :func:`rolling_correlation`: Pearson correlation of two aligned series (learning rate and
  loss) over a trailing window;
- :func:`align`: pairs of two series' values at shared times (memory against sequence length);
- :func:`straggler`: each rank's compute time against the median of all ranks, over time.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankscope.report.series import Series

__all__ = ["Straggler", "align", "rate_of_change", "ratio_to_median", "rolling_correlation", "straggler"]


def _finite_pairs(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep]


def rate_of_change(x: np.ndarray, y: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares slope dy/dx over each trailing window of `window` finite points.

    Returns (x at each window's end, slope); empty arrays if there are fewer than `window` points.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 points, got {window}")
    x, y = _finite_pairs(x, y)
    if len(x) < window:
        return np.array([]), np.array([])
    # Sliding sums make it O(n): slope = (n Sxy - Sx Sy) / (n Sxx - Sx^2).
    xc = x - x[0]  # centred for precision (unix times are large)
    kernel = np.ones(window)
    sx, sy = np.convolve(xc, kernel, "valid"), np.convolve(y, kernel, "valid")
    sxx, sxy = np.convolve(xc * xc, kernel, "valid"), np.convolve(xc * y, kernel, "valid")
    denominator = window * sxx - sx * sx
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(denominator > 0, (window * sxy - sx * sy) / denominator, np.nan)
    return x[window - 1 :], slope


def rolling_correlation(a: np.ndarray, b: np.ndarray, window: int) -> np.ndarray:
    """Pearson correlation of `a` and `b` over each trailing window (NaN where either is constant).

    The result has one value per input point; the first `window - 1` are NaN.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"series of different lengths: {a.shape[0]} and {b.shape[0]}")
    if window < 3:
        raise ValueError(f"window must be >= 3 points, got {window}")
    out = np.full(a.shape, np.nan)
    for end in range(window, len(a) + 1):
        x, y = _finite_pairs(a[end - window : end], b[end - window : end])
        if len(x) < 3:
            continue
        sx, sy = x.std(), y.std()
        # Constant within float noise (a flat learning rate): no correlation to speak of.
        if sx <= 1e-12 * max(1.0, abs(x.mean())) or sy <= 1e-12 * max(1.0, abs(y.mean())):
            continue
        out[end - 1] = float(np.mean((x - x.mean()) * (y - y.mean())) / (sx * sy))
    return out


def align(a: Series, b: Series) -> tuple[np.ndarray, np.ndarray]:
    """Values of `a` and `b` at the times both have a finite point (same time grid, as range queries give)."""
    times = np.intersect1d(a.t, b.t)
    x, y = a.at(times), b.at(times)
    return _finite_pairs(x, y)


def ratio_to_median(per_rank: Sequence[Series]) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(times, ranks, ratios[rank, time]): each rank's value over the median of the *other* ranks at each time.

    The other ranks, not all of them: with two ranks the median of both is their mean, and a rank
    three times slower than its peer would read as only 1.5x.
    """
    ranked = [s for s in per_rank if s.rank is not None and len(s)]
    if not ranked:
        return np.array([]), [], np.zeros((0, 0))
    times = np.unique(np.concatenate([s.t for s in ranked]))
    values = np.vstack([s.at(times) for s in ranked])
    ratios = np.full(values.shape, np.nan)
    if len(ranked) > 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (no rank reported yet) stay NaN
            for i in range(len(ranked)):
                others = np.nanmedian(np.delete(values, i, axis=0), axis=0)
                with np.errstate(invalid="ignore", divide="ignore"):
                    ratios[i] = values[i] / np.where(others > 0, others, np.nan)
    return times, [s.rank for s in ranked], ratios  # type: ignore[misc]


@dataclass(frozen=True)
class Straggler:
    """The slowest rank by compute time, and whether it stands out."""

    rank: int | None
    """The slowest rank (None without per-rank data)."""
    ratio: float
    """Its compute time over the other ranks' median, sustained: the 90th percentile over the run's rate windows."""
    ranking: list[tuple[int, float]]
    """(rank, sustained ratio), slowest first."""
    threshold: float

    @property
    def stands_out(self) -> bool:
        return self.rank is not None and len(self.ranking) > 1 and self.ratio >= self.threshold


def straggler(compute_per_rank: Sequence[Series], threshold: float = 1.5) -> Straggler:
    """Which rank computes slowest, against the median of the other ranks (the imbalance alert's idea).

    A rank's score is the 90th percentile of its ratio over time, so a straggler of the last
    part of a run counts and one noisy rate window does not; it "stands out" at `threshold` (the
    shipped straggler alert's line, which compares with the median of all ranks).
    """
    _, ranks, ratios = ratio_to_median(compute_per_rank)
    if not ranks:
        return Straggler(None, 1.0, [], threshold)
    if len(ranks) == 1:
        return Straggler(ranks[0], 1.0, [(ranks[0], 1.0)], threshold)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        score = np.nan_to_num(np.nanpercentile(ratios, 90, axis=1), nan=0.0)
    order = sorted(range(len(ranks)), key=lambda i: -score[i])
    ranking = [(ranks[i], float(score[i])) for i in order]
    return Straggler(ranking[0][0], ranking[0][1], ranking, threshold)
