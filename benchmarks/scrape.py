"""Benchmark 2: what a scrape costs one rank, before (prometheus_client) and after (rankscope's own).

    .venv/bin/python -m benchmarks.scrape            # ~3.5 min
    .venv/bin/python -m benchmarks.scrape --quick    # ~1.5 min

Part 1, the page: a monitor that has trained the reference model for one
trial (so every series it will ever have exists). For each configuration the
page is rendered `--renders` times by prometheus_client's `generate_latest`
(before) and by `rankscope.serving.exposition.PageRenderer` without its cache (after),
interleaved call by call on the same registry, resource probes included. It
prints wall median and p99 of each, their ratio, the median CPU time of the
rendering thread (which other processes disturb less), a whole HTTP GET of
the served page over loopback (median and p99, the page cache on, as
shipped), the page size in bytes and the number of series (sample lines).

Part 2, scraping during training: the reference model trains with the
default monitor in one long run, in groups of `--block`-step blocks; each
group has two quiet blocks (the second an A/A control: its ratio to the
first is the measurement's own noise) and one block scraped `--rate` times a
second (100x the shipped config's 5 s scrape) through each of three servers
of the same registry: the monitor's own (cache on), the same without the
cache, and prometheus_client's `start_http_server` (what shipped before), in
random order within each group. A load generator in another process per server.
Prints the step-time ratio to quiet (overall and per group), the same for
the training process's CPU time (all its threads, the servers' included),
the training process's CPU per scrape and the scrape latency.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import torch
from prometheus_client import generate_latest, start_http_server
from rankscope import MonitorConfig
from rankscope.serving.exposition import PageRenderer
from rankscope.serving.metrics_endpoint import serve_metrics
from rankscope.serving.webconfig import web_config_for

from devstack.monitoring import seconds, shipped_interval

from .loadgen import scrape_once, use_tls
from .timing import interleaved_blocks, machine_line, percentile, ratio_line
from .workload import Variant, Workload, ensure_process_group, variants

__all__ = ["LoadGenerator", "main", "page_stats"]


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


def _side_by_side(functions: dict[str, Callable[[], object]], count: int) -> tuple[dict, dict]:
    """Wall and CPU (this thread's) seconds of `count` calls of each function, interleaved call by call
    (in alternating order), so noise hits them alike."""
    wall: dict[str, list[float]] = {name: [] for name in functions}
    cpu: dict[str, list[float]] = {name: [] for name in functions}
    names = list(functions)
    for index in range(count):
        for name in names if index % 2 else reversed(names):
            started, started_cpu = time.perf_counter(), time.thread_time()
            functions[name]()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.thread_time() - started_cpu)
    return wall, cpu


def _http_get(url: str) -> bytes:
    parts = urlsplit(url)
    return scrape_once(parts.hostname or "", parts.port or 0, parts.path, scheme=parts.scheme)


def measure_pages(work: Workload, renders: int) -> None:
    print(f"\n1. one rank's /metrics page ({renders} renders of each, interleaved, after one trial of training)")
    print("   before: prometheus_client.generate_latest; after: rankscope.serving.exposition.PageRenderer (no cache),")
    print("   both on the monitor's registry, resource probes included; GET: the served page (cached 1 s)")
    print(f"{'configuration':<20} {'before median/p99':>19} {'after median/p99':>18} {'ratio':>6} "
          f"{'CPU before/after':>17} {'GET median/p99':>17} {'bytes':>13} {'series':>9}")  # fmt: skip
    for name, variant in _configs().items():
        try:
            run = variant.prepare(work)
            run.train()
            monitor = run.monitor
            assert monitor is not None and monitor.port is not None
            url = monitor.start().url
            renderer = PageRenderer(monitor.registry)
            before_page, after_page = generate_latest(monitor.registry), renderer.render()
            wall, cpu = _side_by_side(
                {"before": lambda m=monitor: generate_latest(m.registry), "after": renderer.render}, renders
            )
            fetch, _ = _side_by_side({"get": lambda u=url: _http_get(u)}, renders)
        finally:
            variant.close()
        (size_before, series_before), (size_after, series_after) = page_stats(before_page), page_stats(after_page)
        ratio = statistics.median(wall["before"]) / statistics.median(wall["after"])
        cpu_line = f"{statistics.median(cpu['before']) * 1e3:.2f}/{statistics.median(cpu['after']) * 1e3:.2f} ms"
        print(
            f"{name:<20} {_ms(wall['before']):>19} {_ms(wall['after']):>18} {ratio:>5.1f}x {cpu_line:>17} "
            f"{_ms(fetch['get']):>17} {size_before:>6}/{size_after:<6} {series_before:>4}/{series_after:<4}",
            flush=True,
        )
    print("series: sample lines; before includes the _created series prometheus_client adds, after has none")


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.2f} / {percentile(times, 99) * 1e3:.2f} ms"


class LoadGenerator:
    """benchmarks.loadgen in a child process, switched on and off between blocks of steps."""

    def __init__(self, url: str, rate: float, hold: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.loadgen", url, "--rate", str(rate), "--off", "--hold", str(hold)],
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

    def switch(self, on: bool, timeout: float = 30.0) -> None:
        """Returns once the generator is scraping (on) or has no scrape in flight any more (off)."""
        assert self.proc.stdin is not None
        word = "on" if on else "off"
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        self._expect(word, timeout)

    def stop(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # its signal to stop
        summary = json.loads(self._expect("") or "{}")  # its last line
        self.proc.wait(timeout=10)
        return summary


#: Part 2's scraped conditions: which server answers the load generator.
SERVERS = {
    "after": "the monitor's own server: rankscope.serving.http_server + PageRenderer, page cached 1 s (the default)",
    "after, no cache": "the same server and renderer with page_cache_seconds=0: every scrape renders",
    "before": "prometheus_client.start_http_server on the same registry: what shipped before",
}


def measure_under_load(work: Workload, groups: int, block: int, rate: float) -> None:
    """One long training run in groups of blocks: a quiet block and one block scraped through each server
    in SERVERS, in random order within each group (benchmarks.timing.interleaved_blocks)."""
    print(f"\n2. step time while scraped {rate:g}x/s: {groups} groups of {block}-step blocks, one block per "
          "condition in random order")  # fmt: skip
    for name, what in SERVERS.items():
        print(f"   {name:<16} {what}")
    variant = variants()["rankscope default"]
    conditions = ["quiet", "quiet again", *SERVERS]  # quiet again: the measurement's own noise (A/A)
    steps_needed = (groups + 1) * len(conditions) * block
    long = replace(work, batches=work.batches * -(-steps_needed // len(work.batches)))  # the same batches again
    loads: dict[str, LoadGenerator] = {}
    extra_servers: list[Callable[[], None]] = []
    summaries: dict[str, dict] = {}
    try:
        run = variant.prepare(long)
        monitor = run.monitor
        assert monitor is not None and monitor.port is not None
        uncached = serve_metrics(monitor.registry, "127.0.0.1", 0, page_cache_seconds=0, web=web_config_for("metrics"))
        extra_servers.append(uncached.close)
        old_server, old_thread = start_http_server(0, addr="127.0.0.1", registry=monitor.registry)
        extra_servers.append(lambda: (old_server.shutdown(), old_server.server_close(), old_thread.join(5)))
        urls = {"after": monitor.start().url, "after, no cache": uncached.url,
                "before": f"http://127.0.0.1:{old_server.server_address[1]}/metrics"}  # fmt: skip
        loads = {name: LoadGenerator(url, rate) for name, url in urls.items()}

        def switch(condition: str) -> None:
            for name, load in loads.items():
                if name != condition:
                    load.switch(False)
            if condition in loads:
                loads[condition].switch(True)

        times = interleaved_blocks(run.steps(), conditions, switch, groups, block)
        switch("quiet")
    finally:
        for name, load in loads.items():
            summaries[name] = load.stop()
        for close in extra_servers:
            close()
        variant.close()
    steps_each = groups * block
    print(f"{'condition':<16} {'wall/step':>10} {'process CPU/step':>17} {'wall ratio to quiet (per group)':>34} "
          f"{'CPU ratio':>9} {'CPU/scrape':>10} {'scrape median/p99':>19} {'errors':>6}")  # fmt: skip
    for condition in conditions:
        wall, cpu = sum(times.wall[condition]) / steps_each, sum(times.cpu[condition]) / steps_each
        line = f"{condition:<16} {wall * 1e3:>7.2f} ms {cpu * 1e3:>14.2f} ms"
        if condition == "quiet again":
            line += f" {times.total_ratio(condition, 'quiet'):>9.3f} ({ratio_line(times.ratios(condition, 'quiet'))})"
            line += f" {times.total_ratio(condition, 'quiet', cpu=True):>9.3f}   (nobody scrapes: the A/A control)"
        elif condition in summaries:
            summary = summaries[condition]
            # The warm-up group's scrapes are in the generator's count too: take the measured groups' share.
            scrapes = (summary.get("scrapes") or 0) * groups / (groups + 1)
            per_scrape = (sum(times.cpu[condition]) - sum(times.cpu["quiet"])) / scrapes if scrapes else math.nan
            latency = f"{summary['median_seconds'] * 1e3:.2f} / {summary['p99_seconds'] * 1e3:.2f} ms"
            line += (
                f" {times.total_ratio(condition, 'quiet'):>9.3f} ({ratio_line(times.ratios(condition, 'quiet'))})"
                f" {times.total_ratio(condition, 'quiet', cpu=True):>9.3f} {per_scrape * 1e3:>7.2f} ms"
                f" {latency:>19} {summary.get('errors'):>6}"
            )
        print(line)
    interval = shipped_interval()[0]
    print(f"CPU/scrape: the training process's extra CPU per scrape; at the shipped {interval} interval a scrape")
    print(f"costs CPU/scrape / {seconds(interval):g} s of one core. Process CPU: all threads of the training process.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scrape", description=__doc__.splitlines()[0])
    parser.add_argument("--renders", type=int, default=300, help="renders/GETs per configuration")
    parser.add_argument("--groups", type=int, default=20, help="groups of blocks (one per condition)")
    parser.add_argument("--block", type=int, default=20, help="training steps per block")
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes per second during training")
    parser.add_argument("--quick", action="store_true", help="100 renders, 8 groups")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--tls", action="store_true", help="serve over mTLS ('before' stays plain)")
    args = parser.parse_args(argv)
    if args.tls:
        use_tls(Path(tempfile.mkdtemp(prefix="rankscope-bench-tls-")))
        print("over TLS: RequireAndVerifyClientCert, EC P-256; every scrape a fresh connection and a full handshake")
    if min(args.renders, args.groups, args.block) < 1 or args.rate <= 0:
        parser.error("--renders, --groups and --block must be >= 1 and --rate > 0")
    renders, groups = (100, 8) if args.quick else (args.renders, args.groups)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_process_group()
    work = Workload.build(50)
    print(machine_line())
    measure_pages(work, renders)
    measure_under_load(work, groups, args.block, args.rate)
    print(machine_line())


if __name__ == "__main__":
    main()
