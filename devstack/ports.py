"""Where the local stack's servers and ranks listen on 127.0.0.1, and how free ports are found."""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path

from devstack.processes import StackError

__all__ = ["COMPOSE_METRICS_PORT", "Ports", "free_port", "free_port_block", "local_ports", "port_is_free"]

#: The compose stack's metrics port of rank 0, as written in prometheus/prometheus.yml.
COMPOSE_METRICS_PORT = 9400


@dataclass(frozen=True)
class Ports:
    """Where each component listens on 127.0.0.1 (rank r serves metrics on ``metrics + r``)."""

    prometheus: int = 9090
    alertmanager: int = 9093
    metrics: int = 9400
    control: int = 9300
    #: A local pager webhook standing in for compose's ``pager:9095``; None leaves that address alone.
    pager: int | None = None

    def local(self, host: str, port: int) -> str | None:
        """The 127.0.0.1 address standing in for compose's `host:port`, or None if it is not ours."""
        if host == "trainer" and port == 9300:
            return f"127.0.0.1:{self.control}"
        if host == "trainer" and port >= COMPOSE_METRICS_PORT:
            return f"127.0.0.1:{self.metrics + port - COMPOSE_METRICS_PORT}"
        if host == "alertmanager" and port == 9093:
            return f"127.0.0.1:{self.alertmanager}"
        if host in ("prometheus", "localhost") and port == 9090:
            return f"127.0.0.1:{self.prometheus}"
        if host == "pager" and self.pager is not None:
            return f"127.0.0.1:{self.pager}"
        return None


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


def local_ports(nproc: int, pager: int | None = None) -> Ports:
    """Free loopback ports for every component: `nproc` consecutive metrics ports, the rest outside them."""
    metrics = free_port_block(nproc)
    return Ports(prometheus=free_port(), alertmanager=free_port(), metrics=metrics, control=free_port(), pager=pager)
