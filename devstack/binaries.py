"""Local Prometheus and Alertmanager servers, and the ports they and the ranks listen on.

The one place that starts the monitoring servers on this machine: the no-Docker demo
(`devstack.stack`), the tests and the benchmarks all use it (VictoriaMetrics: `devstack.vmstack`).
Each server runs in its own session under `devstack.processes.Children`, is waited for on its
readiness endpoint, and is stopped with its process group, by PID: nothing here touches a server
it did not start.
"""

from __future__ import annotations

import random
import shutil
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from devstack.processes import Child, Children, StackError

__all__ = [
    "INSTALL_HINT",
    "Server",
    "find_binaries",
    "find_binary",
    "free_port",
    "free_port_block",
    "port_is_free",
    "start_alertmanager",
    "start_prometheus",
    "unix_time",
]

INSTALL_HINT = "install them with: sudo apt-get install prometheus prometheus-alertmanager (or run `make bootstrap`)"


def find_binaries(*names: str, hint: str = INSTALL_HINT) -> list[str]:
    """Paths of system binaries; StackError (one line naming every missing one, and how to install it)."""
    found = [shutil.which(name) for name in names]
    missing = [name for name, path in zip(names, found, strict=True) if path is None]
    if missing:
        raise StackError(f"{' and '.join(missing)} not found on PATH; {hint}")
    return found  # type: ignore[return-value]


def find_binary(name: str, hint: str = INSTALL_HINT) -> str:
    """Path of a system binary; StackError (one line, how to install it) when it is missing."""
    return find_binaries(name, hint=hint)[0]


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
        [
            find_binary("prometheus-alertmanager"),
            f"--config.file={config}",
            f"--storage.path={workdir / 'alertmanager-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        log_path=log_path or workdir / "alertmanager.log",
    )
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
        [
            find_binary("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        log_path=log_path or workdir / "prometheus.log",
    )
    url = f"http://127.0.0.1:{port}"
    children.wait_http_ok(child, f"{url}/-/ready", timeout=30)
    return Server(child, url)


# --- ports ------------------------------------------------------------------------------------

#: Ports handed out by this process: never twice, so two calls cannot collide.
_HANDED_OUT: set[int] = set()
_PICKER = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int) -> bool:
    """Whether `port` can be bound on 127.0.0.1 now (as the servers bind: TIME_WAIT leftovers are free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> int:
    """A base port whose `count` consecutive ports are free right now (one per rank).

    Chosen below the kernel's ephemeral range: a port from that range can be taken at any moment by
    an outgoing connection of any process (a scrape, a client), between this check and the bind."""
    low, high = 10000, _ephemeral_low() - count
    for _ in range(500):
        base = _PICKER.randrange(low, high)
        block = set(range(base, base + count))
        if block & _HANDED_OUT or not all(port_is_free(port) for port in block):
            continue
        _HANDED_OUT.update(block)
        return base
    raise StackError(f"no block of {count} free ports found below the ephemeral range")


def free_port() -> int:
    """A TCP port that is free on loopback right now (see free_port_block)."""
    return free_port_block(1)


def unix_time(rfc3339: str) -> float:
    """An RFC 3339 time from Prometheus or Alertmanager (nanoseconds allowed) as unix time."""
    head, _, fraction = rfc3339.rstrip("Z").partition(".")
    fraction = "".join(ch for ch in fraction if ch.isdigit())[:6]
    return datetime.fromisoformat(f"{head}.{fraction or '0'}+00:00").timestamp()
