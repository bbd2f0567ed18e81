"""Benchmark 4: how Prometheus's cost grows with the number of ranks, in simulation.

    .venv/bin/python -m benchmarks.scale                        # 8, 64 and 256 ranks, 45 s each, ~4 min
    .venv/bin/python -m benchmarks.scale --quick                # 64 and 256 ranks, 30 s each, ~1.5 min
    .venv/bin/python -m benchmarks.scale --ranks 512 --duration 120

First one real rank's page is captured: the exporter, set up as
trainer/configs/demo.yaml sets it up, after training the reference model for
a while (module norms, multimodal statistics and all). Then, for each rank
count, one `benchmarks.fakeranks` process serves that page on N ports as N
ranks of one run (8 per node) with live-looking values, and a Prometheus with
the shipped config and the shipped recording and alert rules (derived as the
stack launcher derives it: one scrape target per rank, 5 s scrape and
evaluation) scrapes them all for `--duration` seconds. Printed per rank count,
from Prometheus's own metrics: head series, resident memory
(`process_resident_memory_bytes`), CPU, the duration of each rule group's
evaluation (`prometheus_rule_group_last_duration_seconds`, median and max
over the window) and missed evaluations. A fresh TSDB each time; the memory
is after `--duration` seconds, not a steady state (Prometheus keeps two hours
of samples in memory before it compacts them to disk, so it grows further).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import psutil
import torch
from prometheus_client import generate_latest

from trainer.processes import Child, Children

from .localstack import MonitoringStack, local_ports, shipped_interval
from .scrape import page_stats
from .timing import machine_line
from .workload import Workload, ensure_process_group, variants

__all__ = ["capture_page", "main"]


def capture_page(steps: int = 50) -> tuple[bytes, float]:
    """One rank's /metrics page after `steps` steps of the reference model, monitored as demo.yaml does,
    and the seconds those steps took (so a replay can grow the counters at the same rate)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_process_group()
    variant = variants()["rankscope trainer"]
    try:
        run = variant.prepare(Workload.build(steps))
        seconds = run.train()
        assert run.monitor is not None
        return generate_latest(run.monitor.registry), seconds
    finally:
        variant.close()


def _wait_ready(children: Children, child: Child, deadline_s: float) -> None:
    """Until the fake ranks' log says `ready` (it listens on every port)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if child.popen.poll() is not None:
            raise RuntimeError(f"fake ranks exited with {child.popen.returncode}:\n{child.log_tail()}")
        if "ready" in child.log_tail(5):
            return
        time.sleep(0.1)  # polling a log file for a readiness line
    raise RuntimeError(f"fake ranks not ready after {deadline_s:.0f}s:\n{child.log_tail()}")


def _poll(stack: MonitoringStack, expr: str, want: float, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        last = stack.value(expr)
        if last is not None and last >= want:
            return
        time.sleep(0.5)  # polling Prometheus's API
    raise RuntimeError(f"{what}: {expr} = {last} after {deadline_s:.0f}s, wanted {want}\n{stack.log_tails()}")


def measure(ranks: int, template: Path, age: float, workdir: Path, duration: float) -> dict[str, object]:
    """Serve `ranks` simulated ranks, let Prometheus scrape them for `duration` s, read its own metrics."""
    children = Children()
    ports = local_ports(ranks)
    workdir.mkdir(parents=True, exist_ok=True)
    fake = children.start(
        "fakeranks",
        [sys.executable, "-m", "benchmarks.fakeranks", "--template", str(template),
         "--ranks", str(ranks), "--base-port", str(ports.metrics), "--age", f"{age:.3f}"],
        log_path=workdir / "fakeranks.log",
    )  # fmt: skip
    stack = MonitoringStack(workdir / "stack", ports, ranks, alertmanager=False)
    try:
        _wait_ready(children, fake, 60)
        stack.start()
        _poll(stack, 'count(up{job="rankscope"} == 1)', ranks, 60, "every rank scraped")
        started = time.monotonic()
        window = f"{int(duration)}s"
        while time.monotonic() - started < duration:
            if fake.popen.poll() is not None:
                raise RuntimeError(f"fake ranks exited during the measurement:\n{fake.log_tail()}")
            time.sleep(1.0)  # the measurement window itself
        fake_cpu = psutil.Process(fake.pid).cpu_times()
        groups = {
            r["metric"]["rule_group"].rsplit(";", 1)[-1]: r["value"][1]
            for r in stack.query(f"max_over_time(prometheus_rule_group_last_duration_seconds[{window}])")
        }
        medians = {
            r["metric"]["rule_group"].rsplit(";", 1)[-1]: r["value"][1]
            for r in stack.query(f"quantile_over_time(0.5, prometheus_rule_group_last_duration_seconds[{window}])")
        }
        return {
            "ranks": ranks,
            "up": stack.value('count(up{job="rankscope"} == 1)'),
            "head_series": stack.value("prometheus_tsdb_head_series"),
            "scraped_per_cycle": stack.value('sum(scrape_samples_scraped{job="rankscope"})'),
            "rss_bytes": stack.value('process_resident_memory_bytes{job="prometheus"}'),
            "heap_bytes": stack.value('go_memstats_heap_inuse_bytes{job="prometheus"}'),
            "cpu_cores": stack.value(f'rate(process_cpu_seconds_total{{job="prometheus"}}[{window}])'),
            "scrape_seconds": stack.value(f'avg(avg_over_time(scrape_duration_seconds{{job="rankscope"}}[{window}]))'),
            "rule_max": {name: float(value) for name, value in groups.items()},
            "rule_median": {name: float(value) for name, value in medians.items()},
            "missed": stack.value("sum(prometheus_rule_group_iterations_missed_total)") or 0.0,
            "fake_cpu_seconds": fake_cpu.user + fake_cpu.system,
        }
    finally:
        stack.close()
        children.stop_all({})


def _report(results: list[dict], series_per_rank: int) -> None:
    print(f"\n{'ranks':>6} {'series/rank x ranks':>20} {'head series':>12} {'RSS':>9} {'heap':>9} {'CPU':>6} "
          f"{'scrape':>8} {'recording rules':>18} {'alert rules':>18} {'missed':>6} {'sim CPU':>8}")  # fmt: skip
    for r in results:
        rules = {
            name: f"{r['rule_median'].get(name, 0) * 1e3:.1f}/{r['rule_max'].get(name, 0) * 1e3:.1f} ms"
            for name in ("rankscope.recording", "rankscope.alerts")
        }
        print(f"{r['ranks']:>6} {series_per_rank * r['ranks']:>20} {r['head_series']:>12.0f} "
              f"{r['rss_bytes'] / 2**20:>6.0f} MiB {r['heap_bytes'] / 2**20:>5.0f} MiB {r['cpu_cores']:>6.2f} "
              f"{r['scrape_seconds'] * 1e3:>5.1f} ms {rules['rankscope.recording']:>18} "
              f"{rules['rankscope.alerts']:>18} {r['missed']:>6.0f} {r['fake_cpu_seconds']:>6.1f} s")  # fmt: skip
    if len(results) >= 2:
        low, high = results[0], results[-1]
        per_series = (high["rss_bytes"] - low["rss_bytes"]) / max(1.0, high["head_series"] - low["head_series"])
        print(f"\nmarginal resident memory: {per_series / 1024:.1f} KiB per head series "
              f"({low['ranks']} -> {high['ranks']} ranks)")  # fmt: skip
    print("rule columns: median/max evaluation time over the window; CPU: Prometheus's cores in use (rate); "
          "sim CPU: what the simulated ranks used in all")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256], help="rank counts to simulate")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds Prometheus scrapes each rank count")
    parser.add_argument("--quick", action="store_true", help="64 and 256 ranks, 30 s each")
    parser.add_argument("--keep", type=Path, default=None, help="keep the template page, configs and logs here")
    args = parser.parse_args(argv)
    ranks, duration = ([64, 256], 30.0) if args.quick else (sorted(args.ranks), args.duration)
    if min(ranks) < 1 or duration < 15:
        parser.error("--ranks must be >= 1 and --duration >= 15 (three scrape intervals)")
    scrape, evaluation = shipped_interval()
    print(machine_line())
    page, age = capture_page()
    size, series_per_rank = page_stats(page)
    print(f"one rank's page (demo.yaml's monitor after 50 steps): {size} bytes, {series_per_rank} series")
    print(f"Prometheus: shipped config and rules, scrape every {scrape}, evaluate every {evaluation}, "
          f"{duration:.0f} s per rank count")  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory(prefix="rankscope-scale-") as tmp:
        workdir = args.keep.resolve() if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        template = workdir / "template.txt"
        template.write_bytes(page)
        for count in ranks:
            print(f"  {count} ranks ...", flush=True)
            results.append(measure(count, template, age, workdir / f"ranks-{count}", duration))
    _report(results, series_per_rank)
    print(machine_line())
    if any(r["up"] != r["ranks"] for r in results):
        print("warning: not every simulated rank was up at the end; see the logs (--keep DIR)")


if __name__ == "__main__":
    main()
