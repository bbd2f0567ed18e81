"""Helpers shared by tests that start real processes (torchrun, servers)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from trainer.processes import Child, Children

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def torchrun(
    nproc: int,
    target: Sequence[str],
    master_port: int,
    extra_env: dict | None = None,
    log: Path | None = None,
    max_restarts: int = 0,
) -> subprocess.Popen:
    """Start `torchrun --nproc_per_node=nproc` on this machine with the repo importable.

    `target` is e.g. ["tests/jobs/exporter_job.py", "--flag"] or ["-m", "trainer", ...].
    Output goes to `log` (read it on failure) so a chatty job cannot fill a pipe.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={master_port}",
        f"--max-restarts={max_restarts}",
        *target,
    ]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(check: Callable[[], T], timeout: float, what: str, diagnose: Callable[[], str] = lambda: "") -> T:
    """Poll `check` until it returns something truthy, or fail naming `what` plus diagnostics."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # the thing may not be up yet
            last_error = exc
        time.sleep(0.1)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error!r})\n{diagnose()}"
    )


def fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def samples(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page as {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def sample_value(page_samples: dict, name: str, **labels: str) -> float | None:
    """The one sample called `name` whose labels include `labels`."""
    found = [v for (n, ls), v in page_samples.items() if n == name and set(labels.items()) <= set(ls)]
    if len(found) > 1:
        raise AssertionError(f"{name} {labels} matches {len(found)} samples")
    return found[0] if found else None


def promtool_problems(page: str) -> str:
    """What `promtool check metrics` says about a /metrics page ("" when it is clean)."""
    result = subprocess.run([binary("promtool"), "check", "metrics"], input=page, capture_output=True, text=True)
    said = result.stdout + result.stderr
    return "" if result.returncode == 0 and not said.strip() else said


def _contract_series() -> dict[str, object]:
    """Sample name -> contract spec, including the `_created` series prometheus_client adds to counters
    and histograms."""
    from exporter import METRICS, MetricKind

    names = {name: spec for spec in METRICS.values() for name in spec.series_names}
    for spec in METRICS.values():
        if spec.kind in (MetricKind.COUNTER, MetricKind.HISTOGRAM):
            names[spec.client_name + "_created"] = spec
    return names


def contract_violations(page: str) -> list[str]:
    """Every rankscope series of a /metrics page whose name or labels differ from exporter.contract."""
    by_series = _contract_series()
    problems = []
    for name, labels in samples(page):
        if not name.startswith("rankscope_"):
            continue
        spec = by_series.get(name)
        if spec is None:
            problems.append(f"{name} is not in the contract")
            continue
        # An info metric's labels are its info keys; a histogram bucket adds `le`.
        expected = set(spec.all_labels + (("le",) if name.endswith("_bucket") else ()))
        if {key for key, _ in labels} != expected:
            problems.append(f"{name} has labels {sorted(k for k, _ in labels)}, contract says {sorted(expected)}")
    return problems


def contract_families(page: str) -> set[str]:
    """The contract metrics (full names) that have at least one series on a /metrics page."""
    by_series = _contract_series()
    return {by_series[name].name for name, _ in samples(page) if name in by_series}


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> int:
    """Terminate a process (and let torchrun stop its workers); kill if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# --- real Prometheus / Alertmanager servers and a webhook sink ------------------------------------
# One launcher for every test that needs the servers, built on the stack launcher's own process
# handling (trainer.processes): each server in its own session, waited for on /-/ready, stopped with
# its process group.


def binary(name: str) -> str:
    """Path of a system binary; fails the test (never skips) when it is missing."""
    import pytest

    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not on PATH: run scripts/bootstrap.sh (Debian packages prometheus, prometheus-alertmanager)"
        )
    return path


@dataclass(frozen=True)
class Server:
    """A started server: its process (a trainer.processes.Child) and base URL."""

    child: Child
    url: str


def start_alertmanager(children: Children, config: Path, workdir: Path, port: int) -> Server:
    """Start `prometheus-alertmanager` with `config` on 127.0.0.1:`port`; returns once it is ready.

    Its data and log (`alertmanager.log`) go to `workdir`. No HA gossip port: a single local instance.
    """
    child = children.start(
        "alertmanager",
        [
            binary("prometheus-alertmanager"),
            f"--config.file={config}",
            f"--storage.path={workdir / 'alertmanager-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        log_path=workdir / "alertmanager.log",
    )
    url = f"http://127.0.0.1:{port}"
    children.wait_http_ok(child, f"{url}/-/ready", timeout=30)
    return Server(child, url)


def start_prometheus(children: Children, config: Path, workdir: Path, port: int) -> Server:
    """Start `prometheus` with `config` on 127.0.0.1:`port`; returns once it is ready (data, log in `workdir`).

    SIGHUP (`server.child.popen.send_signal`) makes it reload its config and rule files.
    """
    child = children.start(
        "prometheus",
        [
            binary("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        log_path=workdir / "prometheus.log",
    )
    url = f"http://127.0.0.1:{port}"
    children.wait_http_ok(child, f"{url}/-/ready", timeout=30)
    return Server(child, url)


@contextlib.contextmanager
def running_alertmanager(config: Path, workdir: Path, port: int) -> Iterator[str]:
    """A real Alertmanager for the duration of a `with` block; yields its URL."""
    children = Children()
    try:
        yield start_alertmanager(children, config, workdir, port).url
    finally:
        children.stop_all({})


@dataclass
class Delivery:
    """One webhook request received by a WebhookSink."""

    path: str
    authorization: str
    body: dict


class WebhookSink:
    """A tiny HTTP server standing in for a pager (or the trainer): it records every POST.

    Its condition is shared by the HTTP threads and the test, which waits on it.
    """

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self._changed = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with sink._changed:
                    sink.deliveries.append(Delivery(self.path, self.headers.get("Authorization", ""), body))
                    sink._changed.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self) -> list[Delivery]:
        with self._changed:
            return list(self.deliveries)

    def wait_for(
        self, predicate: Callable[[Delivery], bool], timeout: float, diagnose: Callable[[], str] = lambda: ""
    ) -> Delivery:
        """The first delivery matching `predicate`, waiting up to `timeout` seconds for it."""
        import pytest

        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((d for d in self.deliveries if predicate(d)), None)
                if found or time.monotonic() >= deadline:
                    break
                self._changed.wait(deadline - time.monotonic())
        if found is None:
            got = [(d.path, d.body) for d in self.received()]
            pytest.fail(f"no matching delivery within {timeout}s; got {got}\n{diagnose()}")
        return found

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


#: Ports handed out by this process: never twice, so two calls in one test cannot collide.
_HANDED_OUT: set[int] = set()
_PICKER = random.Random()


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> int:
    """A base port whose `count` consecutive ports are free right now (one per rank).

    Chosen below the kernel's ephemeral range: a port from that range can be taken at any moment by
    an outgoing connection of any process (a scrape, a client), between this check and the bind."""
    low = 10000
    high = _ephemeral_range()[0] - count
    for _ in range(500):
        base = _PICKER.randrange(low, high)
        block = set(range(base, base + count))
        if block & _HANDED_OUT or not all(_can_bind(port) for port in block):
            continue
        _HANDED_OUT.update(block)
        return base
    raise RuntimeError(f"no block of {count} free ports found below the ephemeral range")


def free_port() -> int:
    """A TCP port that is free on loopback right now (see free_port_block)."""
    return free_port_block(1)


def unix_time(rfc3339: str) -> float:
    """An RFC 3339 time from Prometheus or Alertmanager (nanoseconds allowed) as unix time."""
    head, _, fraction = rfc3339.rstrip("Z").partition(".")
    fraction = "".join(ch for ch in fraction if ch.isdigit())[:6]
    return datetime.fromisoformat(f"{head}.{fraction or '0'}+00:00").timestamp()
