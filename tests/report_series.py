"""Synthetic per-rank series for the run report's unit tests (analysis and plots)."""

from __future__ import annotations

import numpy as np
from rankscope.report.series import Series


def compute_per_rank(
    times: np.ndarray,
    ranks: int,
    slow: int | None = None,
    factor: float = 2.0,
    from_index: int = 0,
    *,
    seed: int = 0,
    noise: float = 0.02,
) -> list[Series]:
    """Compute seconds per second near 0.1 on every rank (relative noise `noise`); rank `slow`, if any, is
    `factor` times slower from sample `from_index` on."""
    rng = np.random.default_rng(seed)
    out = []
    for rank in range(ranks):
        values = 0.1 * (1 + noise * rng.standard_normal(len(times)))
        if rank == slow:
            values[from_index:] *= factor
        out.append(Series({"rank": str(rank), "node": "n0"}, times, values))
    return out
