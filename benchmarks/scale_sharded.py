"""Benchmark: the sharded layout (`rankscope-mixin --layout sharded`) at 16,384 simulated ranks, one server at a time.

    .venv/bin/python -m benchmarks.scale_sharded                          # 16,384 ranks, 2 shards, 60 s each
    .venv/bin/python -m benchmarks.scale_sharded --ranks 4096 --shards 4 --only shard

This machine cannot hold the shards and the global server at once at this size, so each is measured on its
own, as benchmarks.scale measures one server (the same captured page, simulator and 5 s intervals):

- ``shard``: one shard Prometheus with the generated shard rules, scraping its share (ranks / shards simulated
  ranks of one run). Head series, memory, CPU, its rule groups' evaluation time, and what the global server's
  federation scrape costs it: one ``GET /federate`` with the generated match list (time, size, series).
- ``global``: the global Prometheus with the generated global rules over every rank, federating the generated
  match list from a feeder that stands for the shards: one Prometheus scraping every simulated rank (kept to
  the series the shard rules and the federation read: a ``metric_relabel_configs`` filter) and evaluating the
  shard rules. Once the global server has federated for WARM_UP_SECONDS (its rules' windows filled), the
  feeder and the simulator are stopped (SIGSTOP) for the measurement, so that the global server's rule time is
  its own, not the shards' work on the same two cores; what it federated stays readable for its lookback delta
  (federated samples carry their timestamps: nothing is marked stale). Series per rank (federated series /
  ranks), head series, memory, CPU, and the global rule groups' evaluation time (summed medians: the goal is
  under 1 s per evaluation).

The simulated page is one real rank's page (benchmarks.scale.capture_page); rank 0's job-wide series are
served once (benchmarks.fakeranks). `up` is per page of simulated ranks, not per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from rankscope.hang_threshold import duration_seconds
from rankscope.mixin import cli
from rankscope.mixin.config import Tunables
from rankscope.mixin.layout import Selector, federation_job, selectors, split
from rankscope.mixin.promql import COMPUTE_BUSY

from devstack.monitoring import MonitoringStack, shipped_interval
from devstack.ports import local_ports
from devstack.processes import Children

from .fakeranks import pages_needed
from .scale import (
    Setup,
    _cpu_seconds,
    _hold,
    _instant,
    _rule_times,
    _start_fakeranks,
    _value,
    _wait_value,
    capture_page,
    group_intervals,
    rule_seconds,
)
from .timing import machine_line

__all__ = ["keep_only", "main", "measure_global", "measure_shard", "page_for"]

RULE_BUDGET_S = 1.0
SERIES_PER_RANK_GOAL = 25
_STORED = "count(last_over_time(rankscope_run_info[5m]))"
_MATCHER = re.compile(r'^([a-zA-Z_][a-zA-Z0-9_]*)="(.*)"$')


def generated_layout(out: Path, shards: int) -> Path:
    """`rankscope-mixin --layout sharded` into `out`; the prometheus/sharded directory."""
    if cli.main(["--layout", "sharded", "--shards", str(shards), "--out", str(out)]) != 0:
        raise SystemExit("scale_sharded: rankscope-mixin --layout sharded failed")
    return out / "prometheus" / "sharded"


def keep_only(kept: list[Selector]) -> dict[str, Any]:
    """A `metric_relabel_configs` rule keeping exactly the series `kept` selects (equality matchers only)."""
    labels = sorted({_MATCHER.match(m).group(1) for s in kept for m in s.matchers if _MATCHER.match(m)})  # type: ignore[union-attr]
    alternatives = []
    for selector in kept:
        wanted = {}
        for matcher in selector.matchers:
            found = _MATCHER.match(matcher)
            if not found:
                raise ValueError(f'{selector}: only label="value" matchers can be kept by relabeling')
            wanted[found.group(1)] = found.group(2)
        parts = [re.escape(selector.name), *(re.escape(wanted[label]) if label in wanted else ".*" for label in labels)]
        alternatives.append(";".join(parts))
    return {"source_labels": ["__name__", *labels], "separator": ";", "regex": "|".join(alternatives),
            "action": "keep"}  # fmt: skip


def page_for(page: bytes, kept: list[Selector]) -> bytes:
    """The lines of a /metrics page whose metric `kept` names (matchers aside: relabeling applies them), with
    their families' HELP and TYPE lines: what a simulator serving only the federated series needs."""
    names = {s.name for s in kept}
    families = names | {n.removesuffix(end) for n in names for end in ("_bucket", "_sum", "_count", "_total")}
    lines = []
    for line in page.decode().splitlines():
        if line.startswith("# "):
            keep = len(line.split()) > 2 and line.split()[2] in families
        else:
            keep = line.split("{", 1)[0].split(" ", 1)[0] in names
        if keep:
            lines.append(line)
    return ("\n".join(lines) + "\n").encode()


def _count(url: str, chosen: list[Selector]) -> float:
    return sum(_value(url, f"count({s})") or 0.0 for s in chosen)


def _group_figures(url: str, window: str, files: str) -> dict[str, dict[str, float]]:
    """Per rule group of the rule files under `files` (a path fragment): median and max evaluation time."""

    def per_group(expr: str) -> dict[str, float]:
        found = _instant(url, expr)
        return {r["metric"]["rule_group"]: float(r["value"][1]) for r in found if files in r["metric"]["rule_group"]}

    return {
        "median": per_group(f"quantile_over_time(0.5, prometheus_rule_group_last_duration_seconds[{window}])"),
        "max": per_group(f"max_over_time(prometheus_rule_group_last_duration_seconds[{window}])"),
    }


def _server(setup: Setup, ranks: int, per_page: int, workdir: Path, rule_files: list[Path],
            keep: dict[str, Any] | None) -> tuple[Children, MonitoringStack, Any, str]:  # fmt: skip
    """The simulator serving `ranks` and a Prometheus (shipped scrape config, `rule_files`, an optional keep
    filter) scraping them, every rank stored; (children, stack, simulator, url)."""
    children = Children()
    pages = pages_needed(ranks, per_page)
    ports = local_ports(pages)
    workdir.mkdir(parents=True, exist_ok=True)
    stack = MonitoringStack(workdir / "stack", ports, pages, alertmanager=False, rule_files=rule_files)
    if keep is not None:
        (job,) = [j for j in stack.config["scrape_configs"] if j.get("honor_labels")]
        job["metric_relabel_configs"] = [keep]
    try:
        fake = _start_fakeranks(children, setup, ranks, per_page, ports.metrics, workdir)
        stack.start()
        _wait_value(stack.prometheus_url, _STORED, ranks, 600, "every simulated rank stored", fake)
    except BaseException:
        stack.close()
        children.stop_all({})
        raise
    return children, stack, fake, stack.prometheus_url


def _hold_and_read(fake: Any, url: str, duration: float) -> tuple[dict[str, float], str, float]:
    started = time.monotonic()
    rule_times = _hold(fake, duration, url)
    elapsed = time.monotonic() - started
    return rule_times, f"{int(elapsed)}s", elapsed


def measure_shard(setup: Setup, ranks: int, shards: int, per_page: int, workdir: Path, duration: float) -> dict:
    """One shard at its share (ranks / shards simulated ranks) with the generated shard rules."""
    layout_dir = generated_layout(workdir / "generated", shards)
    layout = split(Tunables())
    share = -(-ranks // shards)
    rule_files = sorted((layout_dir / "shard" / "rules").glob("*.yml"))
    children, stack, fake, url = _server(setup, share, per_page, workdir / "shard", rule_files, None)
    try:
        rule_times, window, _ = _hold_and_read(fake, url, duration)
        groups = _group_figures(url, window, "/shard/rules/")
        query = urllib.parse.urlencode([("match[]", str(s)) for s in layout.federated])
        took = []
        for _ in range(3):  # what the global server's federation scrape costs this shard
            started = time.perf_counter()
            with urllib.request.urlopen(f"{url}/federate?{query}", timeout=120) as answer:
                body = answer.read()
            took.append(time.perf_counter() - started)
        federated_series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        return {
            "server": "shard", "ranks": share,
            "head_series": _value(url, "prometheus_tsdb_head_series"),
            "rss_bytes": _value(url, 'process_resident_memory_bytes{job="prometheus"}'),
            "cpu_cores": _value(url, f'rate(process_cpu_seconds_total{{job="prometheus"}}[{window}])'),
            "rule_median": groups["median"], "rule_max": groups["max"], "group_interval": group_intervals(url),
            "missed": _value(url, "sum(prometheus_rule_group_iterations_missed_total)") or 0.0,
            "federate_seconds": statistics.median(took), "federate_bytes": len(body),
            "federated_series": federated_series, "rule_times": rule_times,
        }  # fmt: skip
    finally:
        stack.close()
        children.stop_all({})


def measure_global(setup: Setup, ranks: int, shards: int, per_page: int, workdir: Path, duration: float) -> dict:
    """The global server over every rank, federating from a feeder that stands for the shards (see the module's doc)."""
    layout_dir = generated_layout(workdir / "generated", shards)
    layout = split(Tunables())
    federated = list(layout.federated)
    shard_inputs = sorted(
        {
            s
            for group in layout.shard_groups.values()
            for rule in group["rules"]
            for s in selectors(rule["expr"])
            if not s.recorded and s.name != "up"  # `up` is the scrape's own: no relabeling drops it
        }  # fmt: skip
    )
    raw = [s for s in federated if not s.recorded and s.name != "up"]
    keep = keep_only(sorted(set(raw) | set(shard_inputs)))
    # The simulator serves only those metrics (every one of their series; the relabeling keeps the matched):
    # parsing the whole page of every rank is the shards' load, not the global server's.
    workdir.mkdir(parents=True, exist_ok=True)
    served = workdir / "page-federated.txt"
    served.write_bytes(page_for(setup.page.read_bytes(), sorted(set(raw) | set(shard_inputs))))
    setup = Setup(setup.name, served, setup.age, setup.rules)
    feeder_rules = sorted((layout_dir / "shard" / "rules").glob("*.yml"))
    children, feeder, fake, feeder_url = _server(setup, ranks, per_page, workdir / "feeder", feeder_rules, keep)
    ports = local_ports(1)
    server = MonitoringStack(workdir / "global", ports, 1, alertmanager=False,
                             rule_files=sorted((layout_dir / "global" / "rules").glob("*.yml")))  # fmt: skip
    own = [job for job in server.config["scrape_configs"] if not job.get("honor_labels")]  # Prometheus's own metrics
    server.config["scrape_configs"] = [*own, federation_job(layout, [feeder_url.removeprefix("http://")], "5s")]
    try:
        server.start()
        url = server.prometheus_url
        # Every rank's compute time federated, then the windows the global rules read over filled.
        _wait_value(url, f"count({COMPUTE_BUSY})", ranks, 600, "every rank's compute time federated", fake)
        time.sleep(WARM_UP_SECONDS)
        frozen = _freeze([fake.pid, *(child.pid for child in feeder.servers)])
        try:
            started = time.monotonic()
            cpu_before = _cpu_seconds(server.servers[0].pid)
            rule_times = _rule_times_over(url, duration)
            elapsed = time.monotonic() - started
            cpu = (_cpu_seconds(server.servers[0].pid) - cpu_before) / elapsed
            window = f"{int(elapsed)}s"
            groups = _group_figures(url, window, "/global/rules/")
            return {
                "server": "global", "ranks": ranks,
                "federated_per_rank": _count(url, federated) / ranks,
                "head_series": _value(url, "prometheus_tsdb_head_series"),
                "rss_bytes": psutil.Process(server.servers[0].pid).memory_info().rss,
                "cpu_cores": cpu,
                "rule_median": groups["median"], "rule_max": groups["max"], "group_interval": group_intervals(url),
                "missed": _value(url, "sum(prometheus_rule_group_iterations_missed_total)") or 0.0,
                "rule_times": rule_times,
            }  # fmt: skip
        finally:
            _thaw(frozen)
    finally:
        server.close()
        feeder.close()
        children.stop_all({})


#: Seconds the global server federates before the measurement: its rules' 2-minute windows fill.
WARM_UP_SECONDS = 150.0


def _freeze(pids: list[int]) -> list[psutil.Process]:
    """SIGSTOP these processes and their children: the global server then has the machine to itself. The series
    it federated stay readable for its lookback delta (5 minutes): federated samples carry their timestamps, so
    the failed federation scrapes mark nothing stale."""
    frozen = []
    for pid in pids:
        process = psutil.Process(pid)
        for member in [process, *process.children(recursive=True)]:
            member.suspend()
            frozen.append(member)
    return frozen


def _thaw(frozen: list[psutil.Process]) -> None:
    for process in frozen:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.resume()


def _rule_times_over(url: str, seconds: float) -> dict[str, float]:
    """Each rule's mean evaluation time over `seconds`, from the rules API read every 5 s."""
    deadline = time.monotonic() + seconds
    seen: dict[str, list[float]] = {}
    while time.monotonic() < deadline:
        for rule, took in _rule_times(url).items():
            seen.setdefault(rule, []).append(took)
        time.sleep(5.0)
    return {rule: sum(times) / len(times) for rule, times in seen.items()}


def report(results: list[dict[str, Any]], shards: int, top: int = 5) -> None:
    """The sharded layout's figures, each beside its goal."""
    evaluation = duration_seconds(shipped_interval()[1])  # the rule time per it; slower groups as often as they run
    for r in results:
        total = rule_seconds(r["rule_median"], r["group_interval"], evaluation)
        groups = ", ".join(f"{g.rsplit(';', 1)[-1].removeprefix('rankscope.')} {v * 1e3:.0f}"
                           for g, v in sorted(r["rule_median"].items(), key=lambda item: -item[1]))  # fmt: skip
        costliest = ", ".join(f"`{n}` {t:.3f} s" for n, t in sorted(r["rule_times"].items(), key=lambda i: -i[1])[:top])
        rss = r["rss_bytes"] or 0.0
        print(f"\n| {r['server']} server, {r['ranks']} ranks ({shards} shards) | measured | goal |")
        print("|---|---|---|")
        goal = f"{RULE_BUDGET_S:g} s" if r["server"] == "global" else ""
        print(f"| rule time per {evaluation:g} s evaluation interval (each group's median, as often as it runs) "
              f"| {total:.3f} s (per evaluation: {groups} ms) | {goal} |")  # fmt: skip
        print(f"| costliest rules (mean evaluation time) | {costliest} | |")
        print(f"| missed evaluations | {r['missed']:.0f} | 0 |")
        print(f"| head series | {r['head_series']:.0f} | |")
        if r["server"] == "global":
            print(f"| federated series per rank | {r['federated_per_rank']:.1f} | {SERIES_PER_RANK_GOAL} |")
        print(f"| memory (resident) | {rss / 2**20:.0f} MiB ({rss / r['ranks'] / 2**20:.3f} MiB per rank) | |")
        print(f"| CPU | {r['cpu_cores'] or 0:.2f} cores | |")
        if r["server"] == "shard":
            print(f"| one federation scrape of this shard (GET /federate) | {r['federate_seconds']:.2f} s, "
                  f"{r['federate_bytes'] / 2**20:.1f} MiB, {r['federated_series']} series | |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_sharded", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16384, help="simulated ranks of the whole run")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--ranks-per-page", type=int, default=256)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured per server")
    parser.add_argument("--only", choices=("shard", "global"), help="measure one server only")
    parser.add_argument("--page", type=Path, help="a captured rank page (default: capture one now)")
    parser.add_argument("--age", type=float, default=600.0, help="seconds of training --page's counters hold")
    args = parser.parse_args(argv)
    if args.ranks < args.shards or args.shards < 1:
        parser.error(f"--ranks ({args.ranks}) must be at least --shards ({args.shards}), and --shards at least 1")
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="rankscope-scale-sharded-") as tmp:
        workdir = Path(tmp)
        if args.page is None:
            captured = capture_page()
            page, age = captured[0], captured[1]
            args.page = workdir / "page.txt"
            args.page.write_bytes(page)
        else:
            age = args.age
        setup = Setup("sharded", args.page, age, [])
        results = []
        for server, measure in (("shard", measure_shard), ("global", measure_global)):
            if args.only in (None, server):
                print(f"measuring the {server} server ...", flush=True)
                results.append(measure(setup, args.ranks, args.shards, args.ranks_per_page, workdir / server,
                                       args.duration))  # fmt: skip
        report(results, args.shards)
    return 0


if __name__ == "__main__":
    sys.exit(main())
