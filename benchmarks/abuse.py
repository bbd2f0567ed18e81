"""Benchmark 5: a rank under abuse: thousands of idle connections, then 200 scrapes a second.

    .venv/bin/python -m benchmarks.abuse             # ~2 min
    .venv/bin/python -m benchmarks.abuse --quick     # ~1 min

The reference model trains with the default monitor in one long run, in groups of `--block`-step
blocks, one block per condition in random order within each group (benchmarks.timing.interleaved_blocks):

- `quiet`: nobody connects; `quiet again` the same, a second time: its ratio to `quiet` is the
  measurement's own noise (an A/A control).
- `idle`: an abuser process opens `--connections` connections to the metrics port that send nothing,
  and holds them for the block (the server closes the oldest past its cap; the abuser never notices).
  The block starts once the server has accepted all of them (the kernel's accept queue is empty):
  the cost of absorbing that flood is printed on its own.
- `idle + scrapes`: the same, plus `--rate` scrapes a second over fresh connections (what a
  misconfigured scraper or a scan looks like), each of which must still get the page.

Each abuser is a benchmarks.loadgen process with `--hold`. (No "before" run: prometheus_client's
server, with its listen backlog of 5 and a thread per connection, could not even take a few hundred
idle connections on this machine within minutes; `benchmarks.scrape --rate 200` compares the two
servers under the scrape load alone.) Prints per condition the step time and
its ratio to `quiet` (wall, per group, and the process's CPU), the most threads the training process
had at the end of a block, and the abusers' scrapes, errors and latency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from .loadgen import use_tls
from .scrape import LoadGenerator
from .timing import interleaved_blocks, machine_line, ratio_line
from .workload import Workload, ensure_process_group, variants

__all__ = ["main", "process_threads"]


def process_threads() -> int:
    """Threads of this process, as the kernel counts them."""
    return len(os.listdir("/proc/self/task"))


def accept_queue(port: int) -> int:
    """Connections the kernel holds for the listener on `port` that the server has not accepted yet."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                    return int(fields[4].split(":")[1], 16)  # rx_queue of a listener: its accept queue
    raise RuntimeError(f"nothing listens on port {port}")


def wait_accepted(port: int, timeout: float = 60.0) -> None:
    """Returns once the server has taken every connection out of the kernel's accept queue."""
    deadline = time.monotonic() + timeout
    while accept_queue(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server on port {port} left connections unaccepted for {timeout:.0f} s")
        time.sleep(0.01)


def measure(work: Workload, groups: int, block: int, connections: int, rate: float) -> None:
    variant = variants()["rankscope default"]
    abused = {"idle": 0.0, "idle + scrapes": rate}
    # quiet again: nobody connects either; its ratio to quiet is the measurement's own noise (A/A).
    conditions = ["quiet", "quiet again", *abused]
    steps_needed = (groups + 1) * len(conditions) * block
    long = replace(work, batches=work.batches * -(-steps_needed // len(work.batches)))
    loads: dict[str, LoadGenerator] = {}
    summaries: dict[str, dict] = {}
    most_threads = dict.fromkeys(conditions, 0)
    absorbed: dict[str, list[tuple[float, float]]] = {condition: [] for condition in conditions}
    try:
        run = variant.prepare(long)
        assert run.monitor is not None and run.monitor.port is not None
        ports = {name: run.monitor.port for name in abused}
        for condition in ports:
            loads[condition] = LoadGenerator(run.monitor.start().url, abused[condition], hold=connections)
        print(f"threads at the start: {process_threads()} (training process, with its metrics server)")

        def switch(condition: str) -> None:
            for name, load in loads.items():
                if name != condition:
                    load.switch(False)
            if condition in loads:
                # The flood of new connections is absorbed before the block: the block measures holding them.
                started, started_wall = time.process_time(), time.perf_counter()
                loads[condition].switch(True, timeout=600)  # returns once every idle connection is open
                wait_accepted(ports[condition])
                absorbed[condition].append((time.process_time() - started, time.perf_counter() - started_wall))

        def after_block(condition: str) -> None:
            most_threads[condition] = max(most_threads[condition], process_threads())

        times = interleaved_blocks(run.steps(), conditions, switch, groups, block, after_block)
        switch("quiet")
    finally:
        for name, load in loads.items():
            summaries[name] = load.stop()
        variant.close()
    steps_each = groups * block
    columns = f"{'CPU ratio':>9} {'threads':>7} {'held':>5} {'scrapes':>7} {'errors':>6} {'scrape median/p99':>19}"
    print(f"\n{'condition':<22} {'wall/step':>10} {'CPU/step':>10} {'wall ratio to quiet (per group)':>34} {columns}")
    for condition in conditions:
        wall, cpu = sum(times.wall[condition]) / steps_each, sum(times.cpu[condition]) / steps_each
        line = f"{condition:<22} {wall * 1e3:>7.2f} ms {cpu * 1e3:>7.2f} ms"
        if condition == "quiet":
            line += f" {'1':>9} {'':>24} {'1':>9} {most_threads[condition]:>7}"
        elif condition == "quiet again":
            line += (
                f" {times.total_ratio(condition, 'quiet'):>9.3f} ({ratio_line(times.ratios(condition, 'quiet'))})"
                f" {times.total_ratio(condition, 'quiet', cpu=True):>9.3f} {most_threads[condition]:>7}   (A/A control)"
            )
        else:
            summary = summaries[condition]
            latency = (
                f"{summary['median_seconds'] * 1e3:.2f} / {summary['p99_seconds'] * 1e3:.2f} ms"
                if summary.get("scrapes")
                else "-"
            )
            line += (
                f" {times.total_ratio(condition, 'quiet'):>9.3f} ({ratio_line(times.ratios(condition, 'quiet'))})"
                f" {times.total_ratio(condition, 'quiet', cpu=True):>9.3f} {most_threads[condition]:>7}"
                f" {summary.get('held'):>5} {summary.get('scrapes'):>7} {summary.get('errors'):>6} {latency:>19}"
            )
        print(line)
    print("threads: the most the training process had at the end of a block; held: idle connections the abuser")
    print("had open; scrapes/errors: the abuser's scrapes over fresh connections (all groups, warm-up included)")
    for condition, costs in absorbed.items():
        if costs:
            cpu, wall = (statistics.median(c[i] for c in costs) for i in (0, 1))
            print(f"opening the {connections} connections before a '{condition}' block took {wall:.2f} s and "
                  f"{cpu * 1e3:.0f} ms of the training process's CPU (medians)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.abuse", description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=3000, help="idle connections the abuser holds")
    parser.add_argument("--rate", type=float, default=200.0, help="abusive scrapes per second")
    parser.add_argument("--groups", type=int, default=12, help="groups of blocks (one per condition)")
    parser.add_argument("--block", type=int, default=20, help="training steps per block")
    parser.add_argument("--quick", action="store_true", help="4 groups")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--tls", action="store_true", help="serve over TLS with client certificates: the held "
                        "connections then stall before their handshake")  # fmt: skip
    args = parser.parse_args(argv)
    if args.tls:
        use_tls(Path(tempfile.mkdtemp(prefix="rankscope-bench-tls-")))
        print("over TLS: RequireAndVerifyClientCert, EC P-256; every scrape a fresh connection and a full handshake")
    if min(args.connections, args.groups, args.block) < 1 or args.rate <= 0:
        parser.error("--connections, --groups and --block must be >= 1 and --rate > 0")
    groups = 4 if args.quick else args.groups

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_process_group()
    work = Workload.build(50)
    print(machine_line())
    print(f"abuse: {args.connections} idle connections held, then also {args.rate:g} scrapes/s; "
          f"{groups} groups of {args.block}-step blocks")  # fmt: skip
    measure(work, groups, args.block, args.connections, args.rate)
    print(machine_line())


if __name__ == "__main__":
    main()
