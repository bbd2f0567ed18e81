"""Benchmark 2: what a scrape costs one rank.

    .venv/bin/python -m benchmarks.scrape            # ~1-2 min
    .venv/bin/python -m benchmarks.scrape --quick    # ~40 s

Part 1, the page: a monitor that has trained the reference model for one
trial (so every series it will ever have exists) is scraped `--renders` times.
For each configuration it prints the time to render the page in-process
(`generate_latest` on the monitor's registry, resource probes included:
wall median and p99, and the median CPU time of the rendering thread, which
other processes disturb less), the time of a whole HTTP GET over loopback
(median and p99), the page size in bytes and the number of series (sample
lines) one rank exposes.

Part 2, scraping during training: the reference model trains with the
default monitor in one long run, in blocks of `--block` steps; in one block
of each pair a load generator in another process scrapes the rank `--rate`
times a second (100x the shipped config's 5 s scrape), in the other nobody
does (random order within each pair). Prints the step-time ratio
scraped/quiet (overall and per pair) and the same for the training process's
CPU time (all its threads, the metrics server's included), which the other
processes of a shared machine disturb less.
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from urllib.parse import urlsplit

import torch
from prometheus_client import generate_latest

from exporter import MonitorConfig

from .localstack import seconds, shipped_interval
from .timing import machine_line, percentile, ratio_line
from .workload import Variant, Workload, ensure_process_group, variants

__all__ = ["main", "page_stats"]


def _configs() -> dict[str, Variant]:
    found = variants()
    no_probes = replace(
        found["rankscope default"],
        name="default, no probes",
        monitor_config=lambda work: MonitorConfig(host="127.0.0.1", base_port=0, probes=()),
    )
    return {
        "rankscope default": found["rankscope default"],
        "default, no probes": no_probes,
        "rankscope trainer": found["rankscope trainer"],
        "rankscope all on": found["rankscope all on"],
    }


def page_stats(page: bytes) -> tuple[int, int]:
    """(bytes, series): a series is one sample line of the text format."""
    series = sum(1 for line in page.splitlines() if line and not line.startswith(b"#"))
    return len(page), series


def _timed(function, count: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (this thread's) seconds of `count` calls."""
    wall, cpu = [], []
    for _ in range(count):
        started, started_cpu = time.perf_counter(), time.thread_time()
        function()
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
    return wall, cpu


def _http_get(url: str) -> bytes:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    try:
        connection.request("GET", parts.path)
        return connection.getresponse().read()
    finally:
        connection.close()


def measure_pages(work: Workload, renders: int) -> None:
    print(f"\n1. one rank's /metrics page ({renders} renders each, after one trial of training)")
    print(f"{'configuration':<20} {'render median/p99':>19} {'render CPU':>10} {'HTTP GET median/p99':>21} "
          f"{'bytes':>8} {'series':>7}")  # fmt: skip
    for name, variant in _configs().items():
        try:
            run = variant.prepare(work)
            run.train()
            monitor = run.monitor
            assert monitor is not None and monitor.port is not None
            url = f"http://127.0.0.1:{monitor.port}/metrics"
            page = _http_get(url)
            size, series = page_stats(page)
            render, render_cpu = _timed(lambda m=monitor: generate_latest(m.registry), renders)
            fetch, _ = _timed(lambda u=url: _http_get(u), renders)
        finally:
            variant.close()
        print(
            f"{name:<20} {_ms(render):>19} {statistics.median(render_cpu) * 1e3:>7.2f} ms {_ms(fetch):>21} "
            f"{size:>8} {series:>7}",
            flush=True,
        )


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.2f} / {percentile(times, 99) * 1e3:.2f} ms"


class LoadGenerator:
    """benchmarks.loadgen in a child process, switched on and off between blocks of steps."""

    def __init__(self, url: str, rate: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.loadgen", url, "--rate", str(rate), "--off"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._expect("ready", timeout=60)  # its first scrape worked
        self._expect("off")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("")  # it exited

    def _expect(self, word: str, timeout: float = 30.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = f"nothing within {timeout:.0f}s"
        if line != word and word:
            self.proc.kill()
            raise RuntimeError(f"load generator said {line!r} instead of {word!r} (exit code {self.proc.poll()})")
        return line

    def switch(self, on: bool) -> None:
        """Returns once the generator is scraping (on) or has no scrape in flight any more (off)."""
        assert self.proc.stdin is not None
        word = "on" if on else "off"
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        self._expect(word)

    def stop(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # its signal to stop
        summary = json.loads(self._expect("") or "{}")  # its last line
        self.proc.wait(timeout=10)
        return summary


def measure_under_load(work: Workload, pairs: int, block: int, rate: float) -> None:
    """One long training run; blocks of `block` steps alternate between scraped and quiet, in pairs whose
    order is random, so slow drifts and bursts of noise hit both conditions alike."""
    print(f"\n2. step time while scraped {rate:g}x/s: {pairs} pairs of {block}-step blocks (one scraped, one quiet)")
    variant = variants()["rankscope default"]
    steps_needed = (pairs + 1) * 2 * block
    long = replace(work, batches=work.batches * -(-steps_needed // len(work.batches)))  # the same batches again
    shuffler = random.Random(0)
    wall = {"quiet": 0.0, "scraped": 0.0}
    cpu = {"quiet": 0.0, "scraped": 0.0}
    ratios = []
    try:
        run = variant.prepare(long)
        assert run.monitor is not None and run.monitor.port is not None
        load = LoadGenerator(f"http://127.0.0.1:{run.monitor.port}/metrics", rate)
        steps = run.steps()
        try:
            for pair in range(pairs + 1):  # pair 0 warms up
                order = ["quiet", "scraped"]
                shuffler.shuffle(order)
                took = {}
                for condition in order:
                    load.switch(condition == "scraped")
                    started, started_cpu = time.perf_counter(), time.process_time()
                    for _ in range(block):
                        next(steps)
                    took[condition] = time.perf_counter() - started
                    if pair > 0:
                        wall[condition] += took[condition]
                        cpu[condition] += time.process_time() - started_cpu
                if pair > 0:
                    ratios.append(took["scraped"] / took["quiet"])
            load.switch(False)
        finally:
            summary = load.stop()
    finally:
        variant.close()
    steps_each = pairs * block
    print(f"{'':<8} {'wall/step':>10} {'process CPU/step':>17}")
    for condition in ("quiet", "scraped"):
        per_step = wall[condition] / steps_each * 1e3, cpu[condition] / steps_each * 1e3
        print(f"{condition:<8} {per_step[0]:>7.2f} ms {per_step[1]:>14.2f} ms")
    print(f"ratio scraped/quiet: wall {wall['scraped'] / wall['quiet']:.3f} (per pair {ratio_line(ratios)}), "
          f"process CPU {cpu['scraped'] / cpu['quiet']:.3f}")  # fmt: skip
    print(f"load generator: {summary.get('scrapes')} scrapes, {summary.get('errors')} errors, scrape latency "
          f"median {summary['median_seconds'] * 1e3:.2f} ms, p99 {summary['p99_seconds'] * 1e3:.2f} ms")  # fmt: skip
    # The warm-up pair's scrapes are in the generator's count too: take the measured pairs' share.
    scrapes = (summary.get("scrapes") or 0) * pairs / (pairs + 1)
    if scrapes:
        per_scrape = (cpu["scraped"] - cpu["quiet"]) / scrapes
        interval = shipped_interval()[0]
        share = per_scrape / seconds(interval) * 100
        print(f"about {per_scrape * 1e3:.1f} ms of the training process's CPU per scrape: "
              f"{share:.2f}% of one core at the shipped {interval} interval")  # fmt: skip
    print("process CPU: all threads of the training process (the metrics server's included), not other processes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scrape", description=__doc__.splitlines()[0])
    parser.add_argument("--renders", type=int, default=300, help="renders/GETs per configuration")
    parser.add_argument("--pairs", type=int, default=30, help="pairs of blocks (one scraped, one quiet)")
    parser.add_argument("--block", type=int, default=10, help="training steps per block")
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes per second during training")
    parser.add_argument("--quick", action="store_true", help="100 renders, 12 pairs")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if min(args.renders, args.pairs, args.block) < 1 or args.rate <= 0:
        parser.error("--renders, --pairs and --block must be >= 1 and --rate > 0")
    renders, pairs = (100, 12) if args.quick else (args.renders, args.pairs)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_process_group()
    work = Workload.build(50)
    print(machine_line())
    measure_pages(work, renders)
    measure_under_load(work, pairs, args.block, args.rate)
    print(machine_line())


if __name__ == "__main__":
    main()
