"""Time series as the report handles them: labels plus aligned numpy arrays of times and values."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Series", "broken", "by_rank", "rank_key", "times_union"]


@dataclass
class Series:
    """One series: unix times `t` (seconds) and values `v` (floats, NaN where Prometheus said NaN)."""

    labels: dict[str, str]
    t: np.ndarray
    v: np.ndarray
    #: Display name when the labels do not say it (e.g. "train loss").
    name: str = field(default="")

    def __post_init__(self) -> None:
        self.t = np.asarray(self.t, dtype=float)
        self.v = np.asarray(self.v, dtype=float)
        if self.t.shape != self.v.shape:
            raise ValueError(f"series {self.labels}: {self.t.shape[0]} times but {self.v.shape[0]} values")

    def __len__(self) -> int:
        return int(self.t.shape[0])

    @property
    def rank(self) -> int | None:
        """The `rank` label as a number, or None."""
        value = self.labels.get("rank")
        return int(value) if value is not None and value.lstrip("-").isdigit() else None

    def finite(self) -> Series:
        """The same series without its NaN and infinite points."""
        keep = np.isfinite(self.v)
        return Series(dict(self.labels), self.t[keep], self.v[keep], self.name)

    def at(self, times: np.ndarray) -> np.ndarray:
        """Values at exactly `times` (NaN where this series has no point at that time)."""
        out = np.full(len(times), np.nan)
        index = {float(t): i for i, t in enumerate(self.t)}
        for j, t in enumerate(np.asarray(times, dtype=float)):
            i = index.get(float(t))
            if i is not None:
                out[j] = self.v[i]
        return out

    @classmethod
    def from_prometheus(cls, item: dict) -> Series:
        """A matrix element of the HTTP API: {"metric": {...}, "values": [[t, "v"], ...]}."""
        values = item.get("values") or ([item["value"]] if "value" in item else [])
        t = [float(point[0]) for point in values]
        v = [float(point[1]) for point in values]  # "NaN", "+Inf" parse as floats
        return cls(dict(item.get("metric", {})), np.array(t), np.array(v))


def rank_key(series: Series) -> tuple[int, str]:
    """Sort key: numeric rank first, then the labels (series without a rank last)."""
    rank = series.rank
    return (rank if rank is not None else 1 << 30, str(sorted(series.labels.items())))


def by_rank(series: Iterable[Series]) -> list[Series]:
    """Series ordered by rank number (0, 1, 2, ..., 10, not 0, 1, 10, 2)."""
    return sorted(series, key=rank_key)


def times_union(series: Sequence[Series]) -> np.ndarray:
    """Every time any of `series` has a point, sorted."""
    if not series:
        return np.array([])
    return np.unique(np.concatenate([s.t for s in series]))


def broken(series: Series, segment: np.ndarray) -> Series:
    """`series` with a NaN point between its segments (`segment[i]` is point i's), so a plot breaks its line
    there instead of drawing across a stretch without data."""
    segment = np.asarray(segment)
    if len(series) < 2:
        return series
    cuts = np.flatnonzero(np.diff(segment) != 0) + 1
    t = np.insert(series.t, cuts, (series.t[cuts - 1] + series.t[cuts]) / 2)
    return Series(dict(series.labels), t, np.insert(series.v, cuts, np.nan), series.name)
