"""The local monitoring stack: Prometheus (or VictoriaMetrics) and Alertmanager from the repository's configs.

    stack = MonitoringStack(workdir, ports, nproc=2, token_file=token, interval="1s")
    with stack:                                    # both started and ready
        stack.query("rankscope_steps_total")       # an instant query's result
        stack.prometheus_alerts()                  # /api/v1/alerts
        stack.alertmanager_alerts(run_id="x")      # /api/v2/alerts

The one implementation behind the no-Docker demo (`devstack.stack`), the benchmarks and the e2e
harness. It runs the system's ``prometheus`` and ``prometheus-alertmanager`` binaries with
prometheus/prometheus.yml and alertmanager/alertmanager.yml changed only where this machine needs it:
the compose service names (``trainer:9400``, ``alertmanager:9093``, ...) become 127.0.0.1 and the
given ports, the scrape job lists one target per rank, and the webhook's token file is the caller's.
What a caller may change on top: the scrape and evaluation interval, the rule files, how soon
Alertmanager notifies, whether an Alertmanager runs, and VictoriaMetrics in Prometheus's place
(`devstack.vmstack`). Each server runs in its own session under `devstack.processes.Children`, is
waited for on its readiness endpoint and stopped with its process group, by PID: nothing here
touches a server it did not start. Queries go through the report's client (`rankscope.report.prom`).
"""

from __future__ import annotations

import copy
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import requests
import yaml
from rankscope.report.prom import Prometheus

from devstack.ports import Ports
from devstack.processes import Child, Children, StackError, find_binary
from devstack.vmstack import VictoriaPorts, VictoriaStack

__all__ = [
    "INSTALL_HINT",
    "MonitoringStack",
    "Server",
    "alertmanager_config",
    "derive_alertmanager_config",
    "derive_prometheus_config",
    "generate_rules",
    "prometheus_config",
    "seconds",
    "shipped_interval",
    "start_alertmanager",
    "start_prometheus",
    "unix_time",
]

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_YML = REPO / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "alertmanager" / "alertmanager.yml"
INSTALL_HINT = "install them with: sudo apt-get install prometheus prometheus-alertmanager (or run `make bootstrap`)"
_ADDRESS = re.compile(r"\b(trainer|alertmanager|prometheus|localhost|pager):(\d+)\b")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


# --- the binaries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A started server: its process and base URL."""

    child: Child
    url: str


def start_alertmanager(
    children: Children, config: Path, workdir: Path, port: int, log_path: Path | None = None
) -> Server:
    """`prometheus-alertmanager` with `config` on 127.0.0.1:`port`, ready; data in `workdir`.

    No HA gossip port: a single local instance. Its log goes to `log_path` (default workdir/alertmanager.log)."""
    child = children.start(
        "alertmanager",
        [find_binary("prometheus-alertmanager", INSTALL_HINT), f"--config.file={config}",
         f"--storage.path={workdir / 'alertmanager-data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address="],
        log_path=log_path or workdir / "alertmanager.log",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    children.wait_http_ok(child, f"{url}/-/ready", timeout=30)
    return Server(child, url)


def start_prometheus(
    children: Children, config: Path, workdir: Path, port: int, log_path: Path | None = None
) -> Server:
    """`prometheus` with `config` on 127.0.0.1:`port`, ready; data in `workdir`.

    SIGHUP (`server.child.popen.send_signal`) makes it reload its config and rule files."""
    child = children.start(
        "prometheus",
        [find_binary("prometheus", INSTALL_HINT), f"--config.file={config}",
         f"--storage.tsdb.path={workdir / 'prometheus-data'}", f"--web.listen-address=127.0.0.1:{port}"],
        log_path=log_path or workdir / "prometheus.log",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    children.wait_http_ok(child, f"{url}/-/ready", timeout=30)
    return Server(child, url)


# --- the configs ------------------------------------------------------------------------------


def _readdress(node: Any, ports: Ports) -> Any:
    """Replace compose addresses in every string of a parsed YAML tree (URLs included)."""
    if isinstance(node, dict):
        return {key: _readdress(value, ports) for key, value in node.items()}
    if isinstance(node, list):
        return [_readdress(value, ports) for value in node]
    if isinstance(node, str):
        return _ADDRESS.sub(lambda m: ports.local(m.group(1), int(m.group(2))) or m.group(0), node)
    return node


def derive_prometheus_config(config: dict, *, ports: Ports, nproc: int, config_dir: Path) -> dict:
    """prometheus/prometheus.yml for this machine: local addresses, one target per rank, absolute rule paths."""
    derived = _readdress(copy.deepcopy(config), ports)
    derived["rule_files"] = [str((config_dir / pattern).resolve()) for pattern in config.get("rule_files", [])]
    ranks = [f"127.0.0.1:{ports.metrics + rank}" for rank in range(nproc)]
    found = False
    for job in config.get("scrape_configs", []):
        for index, static in enumerate(job.get("static_configs", [])):
            if any(target.startswith("trainer:") for target in static.get("targets", [])):
                (derived_job,) = [j for j in derived["scrape_configs"] if j["job_name"] == job["job_name"]]
                derived_job["static_configs"][index]["targets"] = ranks
                found = True
    if not found:
        raise StackError(
            "prometheus/prometheus.yml has no static scrape target on host `trainer` to point at the ranks"
        )
    return derived


def derive_alertmanager_config(config: dict, *, ports: Ports, token_file: Path) -> dict:
    """alertmanager/alertmanager.yml for this machine: local addresses, this launcher's token file."""
    derived = _readdress(copy.deepcopy(config), ports)

    def use_token(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "credentials_file":
                    node[key] = str(token_file)
                else:
                    use_token(value)
        elif isinstance(node, list):
            for value in node:
                use_token(value)

    use_token(derived)
    return derived


def generate_rules(out: Path, settings: Sequence[str] = ()) -> Path:
    """Run the rule pack's command (`rankscope-mixin`) with `settings` (NAME=VALUE) into `out`; returns the
    directory its prometheus.yml's `rule_files` patterns resolve from (`out`/prometheus, holding rules/*.yml)."""
    argv = [sys.executable, "-m", "rankscope.mixin.cli", "--out", str(out)]
    for setting in settings:
        argv += ["--set", setting]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise StackError(f"rankscope-mixin {' '.join(settings)} failed: {result.stderr.strip()}")
    return out / "prometheus"


def seconds(duration: str) -> float:
    """A simple Prometheus duration (500ms, 5s, 1m) in seconds."""
    match = _DURATION.match(duration)
    if not match:
        raise ValueError(f"unsupported duration {duration!r} (use e.g. 500ms, 5s, 1m)")
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def shipped_interval() -> tuple[str, str]:
    """(scrape_interval, evaluation_interval) of prometheus/prometheus.yml."""
    glob = yaml.safe_load(PROMETHEUS_YML.read_text())["global"]
    return glob["scrape_interval"], glob["evaluation_interval"]


def unix_time(rfc3339: str) -> float:
    """An RFC 3339 time from Prometheus or Alertmanager (nanoseconds allowed) as unix time."""
    head, _, fraction = rfc3339.rstrip("Z").partition(".")
    fraction = "".join(ch for ch in fraction if ch.isdigit())[:6]
    return datetime.fromisoformat(f"{head}.{fraction or '0'}+00:00").timestamp()


def prometheus_config(
    ports: Ports,
    nproc: int,
    *,
    interval: str | None = None,
    rule_files: list[Path] | None = None,
    config_dir: Path | None = None,
    alerting: bool = True,
) -> dict[str, Any]:
    """prometheus/prometheus.yml as derived for `nproc` ranks on `ports`, with what a caller changes.

    `interval`: the global scrape and evaluation interval (None keeps the shipped ones; a scrape timeout
    longer than it is cut to it). `rule_files`: None keeps the shipped rule_files patterns, resolved
    from `config_dir` (default prometheus/, where the committed rules are). `alerting`: False drops the
    Alertmanager (and its scrape job), for a Prometheus measured on its own.
    """
    config = derive_prometheus_config(
        yaml.safe_load(PROMETHEUS_YML.read_text()),
        ports=ports,
        nproc=nproc,
        config_dir=config_dir or PROMETHEUS_YML.parent,
    )
    glob = config.setdefault("global", {})
    if interval is not None:
        glob["scrape_interval"] = glob["evaluation_interval"] = interval
        if seconds(glob.get("scrape_timeout", "10s")) > seconds(interval):
            glob["scrape_timeout"] = interval
    if rule_files is not None:
        config["rule_files"] = [str(path.resolve()) for path in rule_files]
    if not alerting:
        config.pop("alerting", None)
        config["scrape_configs"] = [job for job in config["scrape_configs"] if job["job_name"] != "alertmanager"]
    return config


def alertmanager_config(ports: Ports, token_file: Path, *, notify_within: str | None = None) -> dict[str, Any]:
    """alertmanager/alertmanager.yml as derived for `ports` and `token_file`.

    `notify_within`: every route's `group_wait` (a 0 s one stays 0 s) and `group_interval`, for a test
    that cannot wait the shipped 30 s; routes, receivers, matchers and inhibitions stay as shipped.
    """
    config = derive_alertmanager_config(
        yaml.safe_load(ALERTMANAGER_YML.read_text()), ports=ports, token_file=token_file
    )
    if notify_within is not None:
        root = config["route"]
        for route in (root, *root.get("routes", [])):
            if route.get("group_wait") not in ("0s", "0m"):
                route["group_wait"] = notify_within
            route["group_interval"] = notify_within
    return config


def _write(path: Path, config: dict[str, Any], source: Path) -> Path:
    header = f"# Derived from {source.relative_to(REPO)} by devstack/monitoring.py; edit that file instead.\n"
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    return path


# --- the stack --------------------------------------------------------------------------------


class MonitoringStack:
    """Prometheus (or VictoriaMetrics) and Alertmanager on loopback for `nproc` ranks.

    `close()` stops what it started (with `children` given, the caller's `stop_all` does).
    """

    def __init__(
        self,
        workdir: Path,
        ports: Ports,
        nproc: int,
        token_file: Path | None = None,
        *,
        interval: str | None = None,
        rule_files: list[Path] | None = None,
        config_dir: Path | None = None,
        alertmanager: bool = True,
        notify_within: str | None = None,
        victoria: VictoriaPorts | None = None,
        children: Children | None = None,
        log_dir: Path | None = None,
    ) -> None:
        """`token_file`: the bearer token Alertmanager sends the trainer (needed with `alertmanager`).
        `interval`, `rule_files`, `config_dir`: as for :func:`prometheus_config`; `notify_within`: as for
        :func:`alertmanager_config`. `victoria`: run VictoriaMetrics, vmagent and vmalert on these ports in
        Prometheus's place (same scrape jobs, rules and Alertmanager). `children`: start the servers as
        the caller's children; `log_dir`: where their logs go (default `workdir`)."""
        if alertmanager and token_file is None:
            raise ValueError("an Alertmanager needs the trainer's token_file")
        self.workdir, self.ports, self.victoria = workdir, ports, victoria
        self.log_dir = log_dir or workdir
        self.config = prometheus_config(
            ports, nproc, interval=interval, rule_files=rule_files, config_dir=config_dir, alerting=alertmanager
        )
        self.am_config = (
            alertmanager_config(ports, token_file, notify_within=notify_within)
            if alertmanager and token_file is not None
            else None
        )
        self._own_children = children is None
        self.children = Children() if children is None else children
        #: The servers started, for a supervisor to watch (the ruler first).
        self.servers: list[Child] = []
        self.alertmanager_url = f"http://127.0.0.1:{ports.alertmanager}"
        if victoria is None:
            self.prometheus_url = self.rules_url = self.scraper_url = f"http://127.0.0.1:{ports.prometheus}"
        else:
            self.prometheus_url = f"http://127.0.0.1:{victoria.storage}"
            self.rules_url = f"http://127.0.0.1:{victoria.vmalert}"
            self.scraper_url = f"http://127.0.0.1:{victoria.vmagent}"
        #: The query API (Prometheus's, or VictoriaMetrics').
        self.prometheus = Prometheus(self.prometheus_url, timeout=10)
        self._apis = {url: Prometheus(url, timeout=10) for url in (self.rules_url, self.scraper_url)}

    def start(self) -> MonitoringStack:
        """Alertmanager first (the ruler sends to it), then the store and ruler; returns once all are ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            alertmanager = None
            if self.am_config is not None:
                am_yml = _write(self.workdir / "alertmanager.yml", self.am_config, ALERTMANAGER_YML)
                alertmanager = start_alertmanager(
                    self.children, am_yml, self.workdir, self.ports.alertmanager, self.log_dir / "alertmanager.log"
                ).child
            if self.victoria is None:
                prom_yml = _write(self.workdir / "prometheus.yml", self.config, PROMETHEUS_YML)
                log = self.log_dir / "prometheus.log"
                self.servers.append(
                    start_prometheus(self.children, prom_yml, self.workdir, self.ports.prometheus, log).child
                )
            else:
                rule_files = [Path(path) for path in self.config["rule_files"]]
                vm = VictoriaStack(self.children, self.workdir, self.config, rule_files, self.victoria,
                                   alertmanager_url=self.alertmanager_url).start()  # fmt: skip
                assert vm.vmalert is not None
                self.servers.append(vm.vmalert)
            if alertmanager is not None:
                self.servers.append(alertmanager)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._own_children:
            self.children.stop_all({})

    def __enter__(self) -> MonitoringStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ruler(self) -> Child:
        """The process evaluating the rules (Prometheus, or vmalert): SIGHUP makes it reload them."""
        return self.servers[0]

    def reload_rules(self) -> None:
        self.ruler.popen.send_signal(signal.SIGHUP)

    def api(self, path: str, **params: Any) -> Any:
        """A Prometheus HTTP API call's `data`: queries go to the store, rules and alerts to the ruler,
        targets to the scraper (all three Prometheus itself, or VictoriaMetrics, vmalert and vmagent)."""
        by_path = {
            "/api/v1/alerts": self.rules_url,
            "/api/v1/rules": self.rules_url,
            "/api/v1/targets": self.scraper_url,
        }
        url = by_path.get(path)
        return (self.prometheus if url is None else self._apis[url]).api(path, params)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (a vector, or a matrix for a range selector)."""
        return self.api("/api/v1/query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def value(self, expr: str) -> float | None:
        """The first value of an instant query, or None when it returns nothing."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def prometheus_alerts(self) -> list[dict[str, Any]]:
        return self.api("/api/v1/alerts")["alerts"]

    def alertmanager_alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Alerts Alertmanager holds whose labels include `labels`."""
        params = [("filter", f'{key}="{value}"') for key, value in labels.items()]
        answer = requests.get(f"{self.alertmanager_url}/api/v2/alerts", params=params, timeout=10)
        answer.raise_for_status()
        return answer.json()

    def log_tails(self, lines: int = 10) -> str:
        return "\n".join(f"--- {child.name} ---\n{child.log_tail(lines)}" for child in self.servers)
