"""The monitoring stack on VictoriaMetrics: vmagent scrapes, VictoriaMetrics stores, vmalert evaluates.

    stack = VictoriaStack(children, workdir, prometheus_config, rule_files, ports, alertmanager_url=am)
    stack.start()            # victoria-metrics, then vmagent and vmalert; returns once all three are healthy
    stack.query_url          # Prometheus query API (VictoriaMetrics): /api/v1/query, /api/v1/query_range
    stack.rules_url          # Prometheus rules/alerts API (vmalert): /api/v1/rules, /api/v1/alerts

The same files as the Prometheus stack, unchanged: vmagent reads the scrape jobs of a
prometheus.yml as the stack launcher derives it (`devstack.stack.derive_prometheus_config`),
vmalert loads the generated rule files (prometheus/rules/*.yml) and notifies the same
Alertmanager, whose routes call the trainer. The binaries are the Debian package
`victoria-metrics` (1.79). docker-compose.vm.yml runs the same three with the same flags
(tests/test_docker_compose.py checks that they agree with the constants here); there vmagent reads
prometheus.yml itself, with -promscrape.config.strictParse=false for its rule and alerting sections.

Sharding the scrape: N vmagents share the targets with -promscrape.cluster.membersCount=N and
-promscrape.cluster.memberNum=0..N-1 (each scrapes about 1/N of them, all writing to the same
storage, so every rule still sees every rank of a run); add -promscrape.cluster.replicationFactor=2
for scrapers in pairs and -dedup.minScrapeInterval=<scrape interval> on victoria-metrics to drop
the duplicates.

Why the flags (each adds latency to the alert -> action loop if left at its default):

- ``-search.latencyOffset=1s`` (victoria-metrics): by default an instant query "at now" is
  answered as of 30 s ago, so that dashboards do not draw a last point still being written.
  vmalert 1.79 cannot ask for fresh data per query, so every rule would see the world 30 s
  late, and a recording rule that reads another's output another 30 s later still. 1 s is
  what VictoriaMetrics buffers new samples in memory anyway (0 means "disabled" only from
  VictoriaMetrics 1.88 on).
- ``-remoteWrite.flushInterval=1s`` (vmalert, default 5 s): a recording rule's output is
  visible to the rules that read it only once vmalert has written it to VictoriaMetrics.
- ``-datasource.queryTimeAlignment=false`` (vmalert): evaluate at the evaluation's own time,
  not rounded down to a multiple of the interval (up to one interval of stale view).

What remains is inherent to a remote ruler: vmalert evaluates a rule by querying
VictoriaMetrics, so a rule that reads a recorded series sees it one evaluation later (plus
vmalert's 1 s flush and VictoriaMetrics' up to 1 s before new samples are searchable), where
Prometheus evaluates a group top to bottom in one pass. The generated rules therefore keep
chains short: no alert is more than two recording levels above the scraped data
(rankscope.mixin.promql, `recording_depth`). And a series VictoriaMetrics 1.79 has never
seen becomes searchable only after about 9 s (it registers new series in its index in the
background; measured here, with -search.latencyOffset=1s): in a run's first seconds each level
of recorded series appears that much later. A warm run (every recorded series exists) is not
delayed by it; tests/e2e/test_victoriametrics.py waits for that before it injects its fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devstack.processes import Child, Children, StackError, find_binary

__all__ = [
    "VICTORIA_METRICS_FLAGS",
    "VMALERT_FLAGS",
    "VictoriaPorts",
    "VictoriaStack",
    "scrape_config",
]

INSTALL_HINT = "install it with: sudo apt-get install victoria-metrics (or run `make bootstrap`)"

#: Flags of the storage, apart from addresses and paths (see the module docstring for why).
VICTORIA_METRICS_FLAGS: tuple[str, ...] = ("-search.latencyOffset=1s",)
#: Flags of the ruler, apart from addresses, rule files and the evaluation interval.
VMALERT_FLAGS: tuple[str, ...] = ("-remoteWrite.flushInterval=1s", "-datasource.queryTimeAlignment=false")


@dataclass(frozen=True)
class VictoriaPorts:
    """Where each component listens on 127.0.0.1."""

    storage: int = 8428
    vmagent: int = 8429
    vmalert: int = 8880


def scrape_config(prometheus_config: dict[str, Any]) -> dict[str, Any]:
    """vmagent's -promscrape.config: the scrape settings and jobs of a prometheus.yml, nothing else.

    vmagent rejects the sections it does not implement (rules, alerting) with strict parsing on,
    and its scrape jobs keep Prometheus's meaning (honor_labels, relabelling, service discovery).
    """
    glob = {key: value for key, value in prometheus_config.get("global", {}).items() if key.startswith("scrape_")}
    if not prometheus_config.get("scrape_configs"):
        raise StackError("the Prometheus configuration has no scrape_configs for vmagent to scrape")
    return {"global": glob, "scrape_configs": prometheus_config["scrape_configs"]}


class VictoriaStack:
    """victoria-metrics + vmagent + vmalert on loopback, as children of `children` (stopped with them)."""

    def __init__(
        self,
        children: Children,
        workdir: Path,
        prometheus_config: dict[str, Any],
        rule_files: list[Path],
        ports: VictoriaPorts,
        *,
        alertmanager_url: str,
        evaluation_interval: str | None = None,
    ) -> None:
        """`prometheus_config`: a derived prometheus.yml (its scrape jobs and, unless
        `evaluation_interval` is given, its global evaluation_interval are used).
        `alertmanager_url`: where vmalert sends alerts (vmalert refuses alerting rules without one)."""
        self.children = children
        self.workdir = workdir
        self.ports = ports
        self.rule_files = list(rule_files)
        self.alertmanager_url = alertmanager_url
        self.scrape = scrape_config(prometheus_config)
        self.evaluation_interval = evaluation_interval or prometheus_config.get("global", {}).get(
            "evaluation_interval", "1m"
        )
        self.query_url = f"http://127.0.0.1:{ports.storage}"
        self.vmagent_url = f"http://127.0.0.1:{ports.vmagent}"
        self.rules_url = f"http://127.0.0.1:{ports.vmalert}"
        self.vmalert: Child | None = None

    def start(self) -> VictoriaStack:
        """Storage first (the others write to it), then the scraper and the ruler; each waited for on /health."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        storage = self.children.start(
            "victoria-metrics",
            [find_binary("victoria-metrics", INSTALL_HINT),
             f"-storageDataPath={self.workdir / 'victoria-metrics-data'}",
             f"-httpListenAddr=127.0.0.1:{self.ports.storage}", "-loggerLevel=WARN", *VICTORIA_METRICS_FLAGS],
            log_path=self.workdir / "victoria-metrics.log",
        )  # fmt: skip
        self.children.wait_http_ok(storage, f"{self.query_url}/health", timeout=30)
        scrape_file = self.workdir / "vmagent-scrape.yml"
        scrape_file.write_text(
            "# Derived from prometheus/prometheus.yml by devstack/vmstack.py.\n" + yaml.safe_dump(self.scrape)
        )
        vmagent = self.children.start(
            "vmagent",
            [find_binary("vmagent", INSTALL_HINT), f"-promscrape.config={scrape_file}",
             f"-remoteWrite.url={self.query_url}/api/v1/write",
             f"-remoteWrite.tmpDataPath={self.workdir / 'vmagent-data'}",
             # Strict: the derived file holds only what vmagent implements (its remote-write flush is 1 s already).
             f"-httpListenAddr=127.0.0.1:{self.ports.vmagent}", "-loggerLevel=WARN",
             "-promscrape.config.strictParse=true"],
            log_path=self.workdir / "vmagent.log",
        )  # fmt: skip
        self.children.wait_http_ok(vmagent, f"{self.vmagent_url}/health", timeout=30)
        self.vmalert = self.children.start(
            "vmalert",
            [find_binary("vmalert", INSTALL_HINT), *(f"-rule={path}" for path in self.rule_files),
             f"-datasource.url={self.query_url}", f"-remoteWrite.url={self.query_url}",
             f"-remoteRead.url={self.query_url}", f"-notifier.url={self.alertmanager_url}",
             f"-evaluationInterval={self.evaluation_interval}",
             f"-httpListenAddr=127.0.0.1:{self.ports.vmalert}", "-loggerLevel=WARN", *VMALERT_FLAGS],
            log_path=self.workdir / "vmalert.log",
        )  # fmt: skip
        self.children.wait_http_ok(self.vmalert, f"{self.rules_url}/health", timeout=30)
        return self
