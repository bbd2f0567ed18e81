"""A local Prometheus (and Alertmanager) from the repository's own configs, with chosen intervals.

    stack = MonitoringStack(workdir, ports, nproc=2, token_file=token, interval="1s")
    with stack:                                    # both started and ready
        stack.query("rankscope_steps_total")       # an instant query's result
        stack.prometheus_alerts()                  # /api/v1/alerts
        stack.alertmanager_alerts(run_id="x")      # /api/v2/alerts

Nothing here is new machinery: the configs are derived by the stack
launcher's `devstack.stack.derive_prometheus_config` /
`derive_alertmanager_config` (compose addresses become 127.0.0.1 and the
given ports, one scrape target per rank, the webhook's token file), and the
servers are started by `devstack.binaries.start_prometheus` /
`start_alertmanager` (the one launcher of the demo, the tests and the
benchmarks, built on `devstack.processes.Children`). What a measurement may change on top:
the global scrape and evaluation interval, the rule files and whether an
Alertmanager runs at all. Only loopback addresses are used.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from devstack.binaries import free_port, free_port_block, start_alertmanager, start_prometheus, unix_time
from devstack.processes import Children
from devstack.stack import REPO, Ports, derive_alertmanager_config, derive_prometheus_config

__all__ = [
    "MonitoringStack",
    "free_port",
    "free_port_block",
    "get_json",
    "local_ports",
    "prometheus_config",
    "seconds",
    "shipped_interval",
    "unix_time",
]

PROMETHEUS_YML = REPO / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "alertmanager" / "alertmanager.yml"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def local_ports(nproc: int) -> Ports:
    """Free loopback ports for every component: `nproc` consecutive metrics ports, the rest outside them."""
    metrics = free_port_block(nproc)
    taken = set(range(metrics, metrics + nproc))
    others: list[int] = []
    while len(others) < 3:
        port = free_port()
        if port not in taken:
            taken.add(port)
            others.append(port)
    return Ports(prometheus=others[0], alertmanager=others[1], metrics=metrics, control=others[2])


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


def prometheus_config(
    ports: Ports,
    nproc: int,
    *,
    interval: str | None = None,
    rule_files: list[Path] | None = None,
    alerting: bool = True,
) -> dict[str, Any]:
    """prometheus/prometheus.yml as the stack launcher derives it for `nproc` ranks on `ports`.

    `interval`: the global scrape and evaluation interval (None keeps the shipped ones; a scrape
    timeout longer than it is cut to it). `rule_files`: None keeps the shipped rules. `alerting`:
    False drops the Alertmanager (and its scrape job), for a Prometheus measured on its own.
    """
    config = derive_prometheus_config(
        yaml.safe_load(PROMETHEUS_YML.read_text()), ports=ports, nproc=nproc, config_dir=PROMETHEUS_YML.parent
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


class MonitoringStack:
    """Prometheus (+ Alertmanager) on loopback for `nproc` ranks; `close()` stops what it started."""

    def __init__(
        self,
        workdir: Path,
        ports: Ports,
        nproc: int,
        token_file: Path | None = None,
        *,
        interval: str | None = None,
        rule_files: list[Path] | None = None,
        alertmanager: bool = True,
    ) -> None:
        """`token_file`: the bearer token Alertmanager sends the trainer (needed with `alertmanager`).
        `interval`, `rule_files`: as for :func:`prometheus_config`."""
        if alertmanager and token_file is None:
            raise ValueError("an Alertmanager needs the trainer's token_file")
        self.workdir = workdir
        self.ports = ports
        self.config = prometheus_config(ports, nproc, interval=interval, rule_files=rule_files, alerting=alertmanager)
        self.am_config = (
            derive_alertmanager_config(yaml.safe_load(ALERTMANAGER_YML.read_text()), ports=ports, token_file=token_file)
            if alertmanager and token_file is not None
            else None
        )
        self.children = Children()
        self.prometheus_url = f"http://127.0.0.1:{ports.prometheus}"
        self.alertmanager_url = f"http://127.0.0.1:{ports.alertmanager}"

    def start(self) -> MonitoringStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            if self.am_config is not None:
                am_yml = _write(self.workdir / "alertmanager.yml", self.am_config)
                start_alertmanager(self.children, am_yml, self.workdir, self.ports.alertmanager)
            prom_yml = _write(self.workdir / "prometheus.yml", self.config)
            start_prometheus(self.children, prom_yml, self.workdir, self.ports.prometheus)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self.children.stop_all({})

    def __enter__(self) -> MonitoringStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (a vector, or a matrix for a range selector)."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        answer = get_json(f"{self.prometheus_url}/api/v1/query?{urllib.parse.urlencode(params)}")
        if answer.get("status") != "success":
            raise RuntimeError(f"Prometheus query {expr!r} failed: {answer.get('error', answer)}")
        return answer["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The first value of an instant query, or None when it returns nothing."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def prometheus_alerts(self) -> list[dict[str, Any]]:
        return get_json(f"{self.prometheus_url}/api/v1/alerts")["data"]["alerts"]

    def alertmanager_alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Alerts Alertmanager holds whose labels include `labels`."""
        query = urllib.parse.urlencode([("filter", f'{key}="{value}"') for key, value in labels.items()])
        return get_json(f"{self.alertmanager_url}/api/v2/alerts?{query}")

    def log_tails(self, lines: int = 10) -> str:
        return "\n".join(f"--- {child.name} ---\n{child.log_tail(lines)}" for child in self.children)


def _write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text("# Derived from the repository's config by devstack/localstack.py.\n" + yaml.safe_dump(config))
    return path
