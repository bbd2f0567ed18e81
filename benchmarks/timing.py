"""Side-by-side timing and robust summaries: what the benchmarks here report.

These machines are shared and noisy, so variants never run one after the
other as whole benchmarks. `lockstep` runs several training loops side by
side, one step of each in turn, in a fresh random order every step, so a
burst of noise hits every variant alike. (Shuffled, not rotated: a rotation
keeps the cyclic order, so one variant would always run right after the same
neighbour and pay for the caches it evicted.) Results are the median over
trials of each variant's time and the median of the per-trial ratios to the
baseline, with their range.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BlockTimes",
    "interleaved_blocks",
    "lockstep",
    "machine_line",
    "median_interval",
    "paired_ratios",
    "percentile",
    "ratio_line",
]


def machine_line() -> str:
    """CPU count, load averages and torch threads: the context every printed number needs."""
    import torch  # here, so that light tools (the load generator) need not import it

    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"machine: {os.cpu_count()} CPUs, load average {load} (1/5/15 min), torch threads {torch.get_num_threads()}"


def lockstep(loops: dict[str, Iterator[None]]) -> tuple[dict[str, float], dict[str, float]]:
    """Advance every loop by one step, in a shuffled order, until all are exhausted.

    Returns the wall seconds and the CPU seconds of this thread spent in each. The CPU time
    leaves out the time this thread waited while other processes ran (the noise of a shared
    machine), and also any work done on other threads (a writer thread, a gloo thread).
    """
    shuffler = random.Random(0)
    wall = dict.fromkeys(loops, 0.0)
    cpu = dict.fromkeys(loops, 0.0)
    active = list(loops)
    while active:
        order = list(active)
        shuffler.shuffle(order)
        for name in order:
            started, started_cpu = time.perf_counter(), time.thread_time()
            finished = next(loops[name], StopIteration) is StopIteration
            wall[name] += time.perf_counter() - started
            cpu[name] += time.thread_time() - started_cpu
            if finished:
                active.remove(name)
    return wall, cpu


@dataclass
class BlockTimes:
    """Per condition, one block's wall and process-CPU seconds per group (warm-up group left out)."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def ratios(self, condition: str, base: str) -> list[float]:
        """Group-by-group wall-time ratios condition/base."""
        return paired_ratios(self.wall[condition], self.wall[base])

    def total_ratio(self, condition: str, base: str, cpu: bool = False) -> float:
        times = self.cpu if cpu else self.wall
        return sum(times[condition]) / sum(times[base])


def interleaved_blocks(
    steps: Iterator[None],
    conditions: Sequence[str],
    switch: Callable[[str], None],
    groups: int,
    block: int,
    after_block: Callable[[str], None] = lambda condition: None,
) -> BlockTimes:
    """One long training run in groups of blocks: each group has one block of `block` steps per condition,
    in a fresh random order (group 0 warms up and is not counted), so slow drifts and bursts of noise hit
    every condition alike. `switch(condition)` sets the condition up before its block and returns once
    it is in effect; `after_block(condition)` runs after each block, outside the timing. CPU time is the
    whole process's (all its threads: the metrics server's included)."""
    shuffler = random.Random(0)
    times = BlockTimes({c: [] for c in conditions}, {c: [] for c in conditions})
    for group in range(groups + 1):
        order = list(conditions)
        shuffler.shuffle(order)
        for condition in order:
            switch(condition)
            started, started_cpu = time.perf_counter(), time.process_time()
            for _ in range(block):
                next(steps)
            wall, cpu = time.perf_counter() - started, time.process_time() - started_cpu
            after_block(condition)
            if group > 0:
                times.wall[condition].append(wall)
                times.cpu[condition].append(cpu)
    return times


def paired_ratios(values: Sequence[float], base: Sequence[float]) -> list[float]:
    """Round-by-round ratios value/base (both lists in round order)."""
    return [v / b for v, b in zip(values, base, strict=True)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank: an observed value, as a p99 should be."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def ratio_line(ratios: Sequence[float]) -> str:
    """`1.004 (0.981..1.032)`: median of paired ratios and their range."""
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median: the order statistics x(k) and x(n+1-k) with the
    largest k for which the median lies between them with at least `confidence` (binomial, p = 1/2). With
    fewer than 6 values no such k exists at 95 %: the whole range is returned."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan, math.nan
    below, k = 0.0, 0  # below: P(Binomial(n, 1/2) <= k - 1), the chance the median lies under x(k)
    while k + 1 <= n // 2:
        nxt = below + math.comb(n, k) / 2**n
        if 1 - 2 * nxt < confidence:
            break
        below, k = nxt, k + 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]
