"""What the monitor costs per training step, side by side in one process.

    .venv/bin/python -m benchmarks.overhead [--steps 200] [--trials 7]

The same model, seed and batches run with no monitoring and with rankscope's
Monitor at default settings, interleaved trial by trial so machine noise hits
both alike. Prints the median step time of each and their ratio (target:
at most 1.01). A ratio, not an absolute time, is the result: these machines
are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from exporter import Monitor, MonitorConfig, RankIdentity


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def make_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 3, 32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
            for _ in range(steps)]  # fmt: skip


def run_bare(batches: list, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    times = []
    for images, labels in batches:
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def run_monitored(batches: list, model: nn.Module, optimizer: torch.optim.Optimizer, monitor: Monitor) -> list[float]:
    times = []
    for images, labels in monitor.data(batches):
        start = time.perf_counter()
        with monitor.step(samples=len(labels)) as step:
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step.record(loss=loss, grad_norm=norm):
                optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per trial")
    parser.add_argument("--trials", type=int, default=7, help="interleaved trials of each variant")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = least noise)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    batches = make_batches(args.steps)
    identity = RankIdentity(run_id="bench", rank=0, local_rank=0, world_size=1, node="bench")
    monitor = Monitor(MonitorConfig(base_port=0), identity, device="cpu")
    monitor.start()  # served, as in a real run; nobody scrapes during this benchmark
    variants: dict[str, Callable[[nn.Module, torch.optim.Optimizer], list[float]]] = {
        "bare": lambda m, o: run_bare(batches, m, o),
        "rankscope default": lambda m, o: run_monitored(batches, m, o, monitor),
    }
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for trial in range(args.trials + 1):
        for name, run in variants.items():
            model = build_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if name != "bare":
                monitor.watch(model, optimizer)
            times = run(model, optimizer)
            if trial > 0:  # trial 0 warms up allocator and caches
                medians[name].append(statistics.median(times))
    monitor.close()
    base = statistics.median(medians["bare"])
    print(f"{'variant':<20} {'median step':>12} {'ratio':>7}   ({args.trials} trials x {args.steps} steps)")
    for name, values in medians.items():
        value = statistics.median(values)
        print(f"{name:<20} {value * 1e3:>10.3f}ms {value / base:>7.3f}")


if __name__ == "__main__":
    main()
