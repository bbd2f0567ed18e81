"""Benchmark 4: what Prometheus (or VictoriaMetrics) pays per rank, up to 16,384 simulated ranks.

    .venv/bin/python -m benchmarks.scale                                # 1024 and 4096 ranks, Prometheus, ~10 min
    .venv/bin/python -m benchmarks.scale --page page.txt --page-age 3   # a page captured before, no training
    .venv/bin/python -m benchmarks.scale --baseline 81ac88b             # + that revision's page and rules, side by side
    .venv/bin/python -m benchmarks.scale --ranks 16384 --duration 60    # where a Llama-3-sized job stands
    .venv/bin/python -m benchmarks.scale --engine victoriametrics --ranks 4096

First one real rank's page is captured: the exporter, set up as
trainer/rankscope_trainer/configs/demo.yaml sets it up, after training the reference model for
a while (module norms, multimodal statistics and all), fetched from its
/metrics endpoint as Prometheus would. Then, for each rank count, one
`benchmarks.fakeranks` process serves that page as N ranks (8 per node,
`--ranks-per-page` ranks to a scrape target, which `honor_labels` keeps apart:
see benchmarks/fakeranks.py for why), not all alike: a large run with a
straggler and a page of ranks that goes down, a hung run and a paused run
(fakeranks' scenarios; `--uniform` serves every rank alike), and the engine scrapes
them with the shipped scrape config and the shipped recording and alert rules,
every 5 s (the performance group every 30 s, the rule pack's `slow_interval`), for
`--warm-up` seconds (120: the rules' 2-minute rates fill, as in a long run) and then
`--duration` seconds, the measurement window:

- ``prometheus``: one Prometheus, as the stack launcher derives its config.
  Read from its own metrics: head series, resident memory, CPU, each rule
  group's evaluation time (`prometheus_rule_group_last_duration_seconds`,
  median and max over the window) and missed evaluations.
- ``victoriametrics``: vmagent -> victoria-metrics <- vmalert with the same
  scrape jobs and rule files (devstack/vmstack.py). Memory and CPU of the
  three processes; rule time from vmalert's `vmalert_iteration_duration_seconds`
  (median and max since start) and `vmalert_iteration_missed_total`.

For each rank count it prints the issue-32 table: the seconds of rule evaluation per 5 s
evaluation interval, each group's median as often as it runs (what the server's CPU pays:
the groups run side by side, on the same cores; a group evaluated every 30 s pays its time
once in six intervals), beside every group's median summed (the interval in which every
group runs); the costliest single rules (each rule's `evaluationTime` from the rules API,
its mean over the window, per evaluation of its group), missed evaluations, series per
rank (the captured page), Prometheus memory per rank and the captured rank's GET /metrics
median, each beside its budget.

`--baseline REV` also measures revision REV's page and rule files (taken with
`git archive`, its page captured by its own code) at each rank count up to
`--baseline-max-ranks`, in the same invocation, and prints the ratios. A
fresh store each time; memory is after the warm-up and the window, not a steady
state (Prometheus keeps two hours of samples in memory before it compacts
them, so it grows further; rules over windows longer than the warm-up, such as the
rank-down alert's 30 minutes, see only the seconds of data there are).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rankscope.hang_threshold import duration_seconds
from rankscope.report.prom import Prometheus

from devstack.monitoring import REPO, MonitoringStack, prometheus_config, shipped_interval
from devstack.ports import free_port, local_ports
from devstack.processes import Child, Children
from devstack.vmstack import VictoriaPorts, VictoriaStack

from .fakeranks import pages_needed
from .scrape import page_stats
from .timing import machine_line

__all__ = ["Setup", "capture_page", "main"]

ENGINES = ("prometheus", "victoriametrics")
RULES_DIR = REPO / "prometheus" / "rules"


@dataclass(frozen=True)
class Setup:
    """What is measured: one rank's page (and the seconds of training its counters hold) and the rule files."""

    name: str
    page: Path
    age: float
    rules: list[Path]

    @property
    def series_per_rank(self) -> int:
        return page_stats(self.page.read_bytes())[1]


#: Budgets of issue 32 at 4096 ranks (and below).
RULE_BUDGET_S = 1.0
SERIES_BUDGET = 100
MEMORY_BUDGET_MIB = 0.5


def capture_page(steps: int = 50) -> tuple[bytes, float]:
    """One rank's /metrics page as its endpoint serves it, after `steps` steps of the reference model monitored
    as demo.yaml does, and the seconds those steps took (so a replay grows the counters at the same rate)."""
    page, seconds, _ = capture(steps)
    return page, seconds


def capture(steps: int = 50, gets: int = 101) -> tuple[bytes, float, float]:
    """capture_page's page and seconds, and the median seconds of `gets` GET /metrics of that live rank."""
    import torch  # here: the simulator's and the engines' side of this module need no torch

    from .workload import Workload, ensure_process_group, variants

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    ensure_process_group()
    variant = variants()["rankscope trainer"]
    try:
        run = variant.prepare(Workload.build(steps))
        seconds = run.train()
        assert run.monitor is not None and run.monitor.port is not None
        url = f"http://127.0.0.1:{run.monitor.port}/metrics"
        took = []
        for _ in range(gets):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as answer:
                page = answer.read()
            took.append(time.perf_counter() - started)
        return page, seconds, statistics.median(took)
    finally:
        variant.close()


_CAPTURE = """
import sys
from benchmarks.scale import capture_page
page, age = capture_page()
open(sys.argv[1], "wb").write(page)
print(age)
"""


def baseline_setup(revision: str, workdir: Path) -> Setup:
    """Revision `revision`'s page (captured by that revision's own code) and rule files."""
    tree = workdir / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"scale: git archive {revision} failed: {archive.stderr.decode().strip()}")
    archive_path = workdir / "tree.tar"
    archive_path.write_bytes(archive.stdout)
    with tarfile.open(archive_path) as tar:
        tar.extractall(tree, filter="data")
    page = workdir / "page.txt"
    env = {**os.environ, "PYTHONPATH": str(tree), "RANKSCOPE_LOG_LEVEL": "off"}
    captured = subprocess.run(
        [sys.executable, "-c", _CAPTURE, str(page)], cwd=tree, env=env, capture_output=True, text=True, timeout=600
    )
    if captured.returncode != 0:
        raise SystemExit(f"scale: capturing {revision}'s page failed:\n{captured.stderr[-3000:]}")
    age = float(captured.stdout.strip().splitlines()[-1])
    return Setup(f"{revision[:10]}", page, age, sorted((tree / "prometheus" / "rules").glob("*.yml")))


def _start_fakeranks(children: Children, setup: Setup, ranks: int, per_page: int, base_port: int,
                     workdir: Path) -> Child:  # fmt: skip
    fake = children.start(
        "fakeranks",
        [sys.executable, "-m", "benchmarks.fakeranks", "--template", str(setup.page), "--ranks", str(ranks),
         "--ranks-per-page", str(per_page), "--base-port", str(base_port), "--age", f"{setup.age:.3f}",
         "--scenarios" if SCENARIOS[0] else "--no-scenarios"],
        log_path=workdir / "fakeranks.log",
        cwd=REPO,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if fake.popen.poll() is not None:
            raise RuntimeError(f"fake ranks exited with {fake.popen.returncode}:\n{fake.log_tail()}")
        if "ready" in fake.log_tail(5):
            return fake
        time.sleep(0.2)  # polling a log file for a readiness line
    raise RuntimeError(f"fake ranks not ready after 120 s:\n{fake.log_tail()}")


#: Whether fakeranks serves its scenarios (main's --uniform turns them off).
SCENARIOS = [True]
#: Every simulated rank stored: counted over a range, since the down page's ranks go stale once it stops.
_STORED = "count(last_over_time(rankscope_run_info[5m]))"


def _instant(url: str, expr: str) -> list[dict]:
    """The raw result of an instant query (the one Prometheus client, rankscope.report.prom)."""
    return Prometheus(url).api("/api/v1/query", {"query": expr})["result"]


def _value(url: str, expr: str) -> float | None:
    result = _instant(url, expr)
    return float(result[0]["value"][1]) if result else None


def _wait_value(url: str, expr: str, want: float, deadline_s: float, what: str, fake: Child) -> None:
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        if fake.popen.poll() is not None:
            raise RuntimeError(f"fake ranks exited:\n{fake.log_tail()}")
        try:
            last = _value(url, expr)
        except OSError as exc:  # not answering yet
            last = repr(exc)
        if isinstance(last, float) and last >= want:
            return
        time.sleep(1.0)  # polling a query API
    raise RuntimeError(f"{what}: {expr} = {last} after {deadline_s:.0f}s, wanted {want}")


def _hold(fake: Child, seconds: float, rules_url: str) -> dict[str, float]:
    """The measurement window itself (fails early if the simulator dies); returns each rule's mean evaluation
    time over the window, from the rules API read every 5 s (it reports each rule's latest evaluation)."""
    deadline = time.monotonic() + seconds
    seen: dict[str, list[float]] = {}
    next_read = time.monotonic()
    while time.monotonic() < deadline:
        if fake.popen.poll() is not None:
            raise RuntimeError(f"fake ranks exited during the measurement:\n{fake.log_tail()}")
        if time.monotonic() >= next_read:
            for rule, took in _rule_times(rules_url).items():
                seen.setdefault(rule, []).append(took)
            next_read += 5.0
        time.sleep(1.0)
    return {rule: sum(times) / len(times) for rule, times in seen.items()}


def group_intervals(url: str) -> dict[str, float]:
    """Rule group name -> seconds between its evaluations (the rules API of Prometheus and of vmalert)."""
    return {group["name"]: float(group["interval"]) for group in Prometheus(url).api("/api/v1/rules")["groups"]}


def rule_seconds(medians: dict[str, float], intervals: dict[str, float], evaluation: float) -> float:
    """Seconds of rule evaluation per `evaluation` seconds (the shipped interval): each group's median evaluation
    time as often as it runs in that time. A group evaluated every 30 s (the slow areas' `slow_interval`) costs a
    sixth of its time per 5 s: the server's CPU pays it once in six intervals. `medians` may be keyed
    ``file;group`` (Prometheus's own metrics) or by group name."""
    return sum(
        median * evaluation / intervals.get(group.rsplit(";", 1)[-1], evaluation) for group, median in medians.items()
    )


def _rule_times(url: str) -> dict[str, float]:
    """Rule name -> seconds its last evaluation took (the rules API of Prometheus and of vmalert)."""
    groups = Prometheus(url).api("/api/v1/rules")["groups"]
    return {rule["name"]: float(rule.get("evaluationTime", 0.0)) for group in groups for rule in group["rules"]}


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure_prometheus(
    setup: Setup, ranks: int, per_page: int, workdir: Path, duration: float, warm_up: float = 0.0
) -> dict:
    """Prometheus with the shipped config and `setup`'s rules scraping `ranks` simulated ranks."""
    children = Children()
    pages = pages_needed(ranks, per_page)
    ports = local_ports(pages)
    workdir.mkdir(parents=True, exist_ok=True)
    stack = MonitoringStack(workdir / "stack", ports, pages, alertmanager=False, rule_files=setup.rules)
    try:
        fake = _start_fakeranks(children, setup, ranks, per_page, ports.metrics, workdir)
        stack.start()
        url = stack.prometheus_url
        _wait_value(url, _STORED, ranks, 300, "every simulated rank stored", fake)
        _hold(fake, warm_up, url)  # the rules' rate windows fill: a long run's cost, not a fresh store's
        fake_cpu = _cpu_seconds(fake.pid)
        started = time.monotonic()
        rule_times = _hold(fake, duration, url)
        window = f"{int(time.monotonic() - started)}s"
        fake_cores = (_cpu_seconds(fake.pid) - fake_cpu) / (time.monotonic() - started)

        def per_group(expr: str) -> dict[str, float]:
            return {r["metric"]["rule_group"].rsplit(";", 1)[-1]: float(r["value"][1]) for r in _instant(url, expr)}

        return {
            "head_series": _value(url, "prometheus_tsdb_head_series"),
            "rss_bytes": _value(url, 'process_resident_memory_bytes{job="prometheus"}'),
            "cpu_cores": _value(url, f'rate(process_cpu_seconds_total{{job="prometheus"}}[{window}])'),
            "rule_max": per_group(f"max_over_time(prometheus_rule_group_last_duration_seconds[{window}])"),
            "rule_median": per_group(f"quantile_over_time(0.5, prometheus_rule_group_last_duration_seconds[{window}])"),
            "group_interval": group_intervals(url),
            "evaluations": _value(url, f"min(increase(prometheus_rule_group_iterations_total[{window}]))") or 0.0,
            "missed": _value(url, "sum(prometheus_rule_group_iterations_missed_total)") or 0.0,
            "sim_cores": fake_cores,
            "rule_times": rule_times,
            "alerts": _alerts(url),
        }
    finally:
        stack.close()
        children.stop_all({})


def _alerts(url: str) -> list[str]:
    """The alerts pending or firing at the end of the window (what the simulator's scenarios raised)."""
    found = _instant(url, 'count by (alertname, alertstate, run_id) (ALERTS{alertname=~"Rankscope.+"})')
    return sorted(f"{r['metric']['alertname']} {r['metric'].get('alertstate', '')} {r['metric'].get('run_id', '')} "
                  f"x{float(r['value'][1]):.0f}" for r in found)  # fmt: skip


def _own_metric(url: str, name: str, **labels: str) -> float:
    """One sample of a server's own /metrics page."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise RuntimeError(f"{url}/metrics has no {name} {labels}")


def _vmalert_metrics(url: str) -> dict[tuple[str, str, str], float]:
    """(name, group, quantile) -> value of vmalert's own metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("group", ""), sample.labels.get("quantile", ""))
            found[key] = sample.value
    return found


def measure_victoria(
    setup: Setup, ranks: int, per_page: int, workdir: Path, duration: float, warm_up: float = 0.0
) -> dict:
    """vmagent + VictoriaMetrics + vmalert with the shipped scrape jobs and `setup`'s rules."""
    children = Children()
    pages = pages_needed(ranks, per_page)
    ports = local_ports(pages)
    workdir.mkdir(parents=True, exist_ok=True)
    config = prometheus_config(ports, pages, rule_files=setup.rules, alerting=False)
    vports = VictoriaPorts(storage=ports.prometheus, vmagent=ports.alertmanager, vmalert=ports.control)
    # Nothing listens there: no alert fires on a healthy simulated run, and none is needed for the measurement.
    stack = VictoriaStack(children, workdir / "stack", config, setup.rules, vports,
                          alertmanager_url=f"http://127.0.0.1:{free_port()}")  # fmt: skip
    try:
        fake = _start_fakeranks(children, setup, ranks, per_page, ports.metrics, workdir)
        stack.start()
        url = stack.query_url
        _wait_value(url, _STORED, ranks, 300, "every simulated rank stored", fake)
        _hold(fake, warm_up, stack.rules_url)
        processes = {child.name: child.pid for child in children if child.name != "fakeranks"}
        before = {name: _cpu_seconds(pid) for name, pid in processes.items()} | {"sim": _cpu_seconds(fake.pid)}
        started = time.monotonic()
        rule_times = _hold(fake, duration, stack.rules_url)
        elapsed = time.monotonic() - started
        rss = {name: psutil.Process(pid).memory_info().rss for name, pid in processes.items()}
        cores = {name: (_cpu_seconds(pid) - before[name]) / elapsed for name, pid in processes.items()}
        vm = _vmalert_metrics(stack.rules_url)
        groups = {group for (name, group, _) in vm if name == "vmalert_iteration_total"}
        return {
            # Series with samples in the current hour (VictoriaMetrics' own count; a query counting every
            # series would exceed its -search.maxUniqueTimeseries).
            "head_series": _own_metric(url, "vm_cache_entries", type="storage/hour_metric_ids"),
            "rss_bytes": sum(rss.values()),
            "rss_parts": rss,
            "cpu_cores": sum(cores.values()),
            "rule_max": {g: vm[("vmalert_iteration_duration_seconds", g, "1")] for g in groups},
            "rule_median": {g: vm[("vmalert_iteration_duration_seconds", g, "0.5")] for g in groups},
            "group_interval": group_intervals(stack.rules_url),
            "evaluations": min(vm[("vmalert_iteration_total", g, "")] for g in groups),
            "missed": sum(vm.get(("vmalert_iteration_missed_total", g, ""), 0.0) for g in groups),
            "sim_cores": (_cpu_seconds(fake.pid) - before["sim"]) / elapsed,
            "rule_times": rule_times,
        }
    finally:
        children.stop_all({})


MEASURE = {"prometheus": measure_prometheus, "victoriametrics": measure_victoria}


def _report(results: list[dict], top: int = 6) -> None:
    print(f"\n{'engine':<16} {'setup':<11} {'ranks':>6} {'series/rank':>11} {'stored series':>13} "
          f"{'memory':>9} {'per rank':>9} {'CPU':>5} {'rules (all groups)':>18} "
          f"{'evals':>5} {'missed':>6} {'sim CPU':>7}")  # fmt: skip
    for r in results:
        # Per shipped interval: every group's median as often as it runs (Prometheus runs the groups side by side,
        # on the same cores); then every group's max summed, the worst interval.
        total = f"{_per_interval(r) * 1e3:.0f}/{sum(r['rule_max'].values()) * 1e3:.0f} ms"
        print(f"{r['engine']:<16} {r['setup']:<11} {r['ranks']:>6} {r['series_per_rank']:>11} "
              f"{r['head_series']:>13.0f} {r['rss_bytes'] / 2**20:>5.0f} MiB "
              f"{r['rss_bytes'] / r['ranks'] / 2**20:>5.2f} MiB {r['cpu_cores']:>5.2f} "
              f"{total:>18} {r['evaluations']:>5.0f} "
              f"{r['missed']:>6.0f} {r['sim_cores']:>7.2f}")  # fmt: skip
        groups = ", ".join(
            f"{group.removeprefix('rankscope.')} {median * 1e3:.0f}/{r['rule_max'].get(group, 0) * 1e3:.0f}"
            + (f" every {every:g} s" if (every := r["group_interval"].get(group, r["evaluation"])) != r["evaluation"]
               else "")
            for group, median in sorted(r["rule_median"].items())
        )  # fmt: skip
        print(f"{'':<16} rule groups (median/max ms per evaluation): {groups}")
        if "rss_parts" in r:
            parts = ", ".join(f"{name} {rss / 2**20:.0f} MiB" for name, rss in r["rss_parts"].items())
            print(f"{'':<16} memory: {parts}")
    for r in results:
        slowest = sorted(r["rule_times"].items(), key=lambda item: -item[1])[:top]
        if slowest:
            rules = ", ".join(f"{name} {seconds * 1e3:.0f}" for name, seconds in slowest)
            print(f"slowest rules (ms, mean over the window), {r['engine']}, {r['setup']}, {r['ranks']} ranks: {rules}")
    print("rules: seconds of rule evaluation per evaluation interval (each group's median over the window, as often")
    print("as it runs) / every group's max summed; memory: resident (all processes of the engine), per rank = memory")
    print("/ ranks; CPU and sim CPU: cores used by the engine and by the simulator")


def _per_interval(r: dict) -> float:
    """A measurement's rule seconds per shipped evaluation interval (rule_seconds)."""
    return rule_seconds(r["rule_median"], r["group_interval"], r["evaluation"])


def _budget_table(r: dict, get_median: float | None, top: int = 5) -> None:
    """Issue 32's table for one measurement, each figure beside its budget."""
    total = _per_interval(r)
    groups = ", ".join(
        f"{g.removeprefix('rankscope.')} {v * r['evaluation'] / r['group_interval'].get(g, r['evaluation']):.2f}"
        for g, v in sorted(r["rule_median"].items(), key=lambda item: -item[1])
    )
    costliest = ", ".join(f"`{name}` {seconds:.3f} s" for name, seconds in
                          sorted(r["rule_times"].items(), key=lambda item: -item[1])[:top])  # fmt: skip
    per_rank = r["rss_bytes"] / r["ranks"] / 2**20
    get = f"{get_median * 1e3:.2f} ms" if get_median is not None else "not measured (--page)"
    print(f"\n| {r['engine']}, {r['setup']}, at {r['ranks']} ranks | measured | budget |")
    print("|---|---|---|")
    print(f"| rule time per {r['evaluation']:g} s evaluation interval (each group's median, as often as it runs) "
          f"| {total:.2f} s ({groups}) | {RULE_BUDGET_S:g} s |")  # fmt: skip
    print(f"| every group's median in one interval (the groups evaluated less often included) "
          f"| {sum(r['rule_median'].values()):.2f} s | |")  # fmt: skip
    print(f"| costliest single rules (mean evaluation time) | {costliest} | |")
    print(f"| missed evaluations | {r['missed']:.0f} | 0 |")
    print(f"| series per rank (the captured rank's page) | {r['series_per_rank']} | {SERIES_BUDGET} |")
    print(f"| Prometheus memory per rank | {per_rank:.2f} MiB | {MEMORY_BUDGET_MIB:g} MiB |")
    print(f"| GET /metrics median (the captured rank) | {get} | |")
    if r.get("alerts"):
        print(f"alerts pending or firing at the end (alert, state, run, count): {'; '.join(r['alerts'])}")


def _ratios(results: list[dict], baseline: str) -> None:
    """New/old for every (engine, ranks) measured with both setups."""
    print(f"\nratios to {baseline} (same engine, same rank count)")
    print(f"{'engine':<16} {'ranks':>6} {'series/rank':>11} {'memory':>7} {'rules total':>11}")  # fmt: skip
    for new in results:
        old = next((r for r in results if r["setup"] == baseline and (r["engine"], r["ranks"]) ==
                    (new["engine"], new["ranks"])), None)  # fmt: skip
        if new["setup"] == baseline or old is None:
            continue
        # The groups differ between revisions (they were split by area): compare the sums over every group.
        total = _per_interval(new) / max(1e-9, _per_interval(old))
        print(
            f"{new['engine']:<16} {new['ranks']:>6} {new['series_per_rank'] / old['series_per_rank']:>11.2f} "
            f"{new['rss_bytes'] / old['rss_bytes']:>7.2f} {total:>11.3f}"
        )
    print("rule ratios: of the rule time per evaluation interval; below 1 is faster or smaller than the baseline")


def _rule_count(paths: list[Path]) -> int:
    return sum(len(group.get("rules", [])) for path in paths for group in yaml.safe_load(path.read_text())["groups"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096], help="rank counts to simulate")
    parser.add_argument(
        "--duration", type=float, default=90.0, help="seconds of the measurement window at each rank count"
    )
    parser.add_argument(
        "--warm-up",
        type=float,
        default=120.0,
        help="seconds the engine scrapes and evaluates before the window (the 2-minute rates fill)",
    )
    parser.add_argument("--engine", choices=ENGINES, nargs="+", default=["prometheus"])
    parser.add_argument("--ranks-per-page", type=int, default=64, help="simulated ranks per scrape target")
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision's page and rules")
    parser.add_argument("--baseline-max-ranks", type=int, default=4096, help="largest rank count for --baseline")
    parser.add_argument("--quick", action="store_true", help="4096 ranks only, 30 s")
    parser.add_argument("--keep", type=Path, default=None, help="keep the pages, configs and logs here")
    parser.add_argument("--page", type=Path, help="a rank's page captured before (skips the training)")
    parser.add_argument("--page-age", type=float, default=3.0, help="seconds of training --page's counters hold")
    parser.add_argument("--uniform", action="store_true", help="every simulated rank alike (no scenarios)")
    parser.add_argument("--json", type=Path, help="write every measurement (each rule's time too) here")
    args = parser.parse_args(argv)
    SCENARIOS[0] = not args.uniform
    ranks, duration = ([4096], 60.0) if args.quick else (sorted(args.ranks), args.duration)
    warm_up = 0.0 if args.quick else args.warm_up
    if min(ranks) < 1 or duration < 15 or args.ranks_per_page < 1 or warm_up < 0:
        parser.error(
            "--ranks and --ranks-per-page must be >= 1, --duration >= 15 (three scrape intervals) and --warm-up >= 0"
        )
    scrape, evaluation = shipped_interval()
    print(machine_line())
    results = []
    with tempfile.TemporaryDirectory(prefix="rankscope-scale-") as tmp:
        workdir = args.keep.resolve() if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.page:
            page, age, get_median = args.page.read_bytes(), args.page_age, None
        else:
            page, age, get_median = capture()
        (workdir / "page.txt").write_bytes(page)
        setups = [Setup("this tree", workdir / "page.txt", age, sorted(RULES_DIR.glob("*.yml")))]
        if args.baseline:
            print(f"capturing revision {args.baseline}'s page ...", flush=True)
            setups.insert(0, baseline_setup(args.baseline, workdir / "baseline"))
        for setup in setups:
            print(f"{setup.name}: one rank's page (demo.yaml's monitor after 50 steps) has {setup.series_per_rank} "
                  f"series; {_rule_count(setup.rules)} rules")  # fmt: skip
        print(f"scrape every {scrape}, evaluate every {evaluation}, {warm_up:.0f} s of warm-up then "
              f"{duration:.0f} s per measurement, "
              f"{args.ranks_per_page} simulated ranks per scrape target")  # fmt: skip
        for count in ranks:
            for engine in args.engine:
                for setup in setups:
                    if setup.name != "this tree" and count > args.baseline_max_ranks:
                        continue
                    print(f"  {engine}, {setup.name}, {count} ranks ...", flush=True)
                    where = workdir / f"{engine}-{setup.name.replace(' ', '-')}-{count}"
                    found = MEASURE[engine](setup, count, args.ranks_per_page, where, duration, warm_up)
                    found |= {"engine": engine, "setup": setup.name, "ranks": count,
                              "series_per_rank": setup.series_per_rank,
                              "evaluation": duration_seconds(evaluation)}  # fmt: skip
                    results.append(found)
                    print(
                        f"    rules {_per_interval(found):.3f} s per {evaluation} evaluation interval (each group's "
                        f"median, as often as it runs), {found['missed']:.0f} missed, "
                        f"{found['rss_bytes'] / 2**20:.0f} MiB",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    _report(results)
    for found in results:
        _budget_table(found, get_median)
    if args.baseline:
        _ratios(results, setups[0].name)
    print(machine_line())


if __name__ == "__main__":
    main()
