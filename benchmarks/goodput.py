"""What the goodput ledger costs per training step, against the reference model's step (issue 25: <= 0.2 %).

    .venv/bin/python -m benchmarks.goodput              # 8 trials x 20000 steps each way, ~1 min
    .venv/bin/python -m benchmarks.goodput --quick      # 3 trials

The ledger's per-step work is the same whatever the model: so it is measured exactly on empty steps, where it
is not lost in the model's noise. Two Monitors as rank 0 (goodput on, writing its ledger every second from its
thread as in a real run; goodput off) run empty `monitor.step()` blocks side by side, in shuffled order
(benchmarks.timing.lockstep). The difference of their mean step times is the ledger's cost per step, on the
training thread (wall and CPU), and is divided by the reference model's step time (benchmark 1's `none` variant,
measured here on a few steps, or --step-ms) for the ratio the goal is about.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import replace

from prometheus_client import CollectorRegistry
from rankscope import Monitor, MonitorConfig
from rankscope.identity import RankIdentity

from .timing import lockstep, machine_line

BATCH = 1000  # empty steps per lockstep turn: one turn is long enough for the timer's resolution


def _steps(monitor: Monitor, turns: int) -> Iterator[None]:
    for _ in range(turns):
        for _ in range(BATCH):
            with monitor.step():
                pass
        yield


def _monitor(goodput: bool, directory: str) -> Monitor:
    identity = RankIdentity(run_id="bench", rank=0, local_rank=0, world_size=1, node="bench")
    config = MonitorConfig(base_port=0, probes=(), goodput=goodput, goodput_dir=directory if goodput else "")
    return Monitor(config, identity, device="cpu", registry=CollectorRegistry())


def _reference_step_seconds(steps: int) -> float:
    """The reference model's mean step time without monitoring (benchmark 1's `none`)."""
    import torch

    from .workload import Workload, ensure_process_group, variants

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_process_group()
    work = Workload.build(steps)
    variant = variants()["none"]
    try:
        run = variant.prepare(replace(work, batches=work.batches[:steps]))
        wall, _ = lockstep({"none": run.steps()})
    finally:
        variant.close()
    return wall["none"] / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20, help=f"lockstep turns per trial ({BATCH} steps each)")
    parser.add_argument("--quick", action="store_true", help="3 trials")
    parser.add_argument("--step-ms", type=float, default=0.0, help="reference step time (default: measure it)")
    args = parser.parse_args(argv)
    trials = 3 if args.quick else args.trials
    print(machine_line())
    with tempfile.TemporaryDirectory() as directory:
        on, off = _monitor(True, directory), _monitor(False, directory)
        wall: dict[str, list[float]] = {"on": [], "off": []}
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        try:
            for trial in range(trials + 1):  # trial 0 warms up
                trial_wall, trial_cpu = lockstep({"on": _steps(on, args.turns), "off": _steps(off, args.turns)})
                if trial:
                    for name in ("on", "off"):
                        wall[name].append(trial_wall[name] / (args.turns * BATCH))
                        cpu[name].append(trial_cpu[name] / (args.turns * BATCH))
        finally:
            on.close()
            off.close()
    cost_wall = statistics.median(a - b for a, b in zip(wall["on"], wall["off"], strict=True))
    cost_cpu = statistics.median(a - b for a, b in zip(cpu["on"], cpu["off"], strict=True))
    print(f"empty step: goodput off {statistics.median(wall['off']) * 1e6:.2f} us, "
          f"on {statistics.median(wall['on']) * 1e6:.2f} us")  # fmt: skip
    print(f"ledger cost per step: {cost_wall * 1e6:+.2f} us wall, {cost_cpu * 1e6:+.2f} us CPU (median of {trials})")
    step = args.step_ms / 1e3 if args.step_ms else _reference_step_seconds(10)
    print(f"reference model step (none): {step * 1e3:.1f} ms")
    print(f"ratio: {1 + cost_wall / step:.5f} wall, {1 + cost_cpu / step:.5f} CPU (goal <= 1.002)")
    print(machine_line())


if __name__ == "__main__":
    main()
