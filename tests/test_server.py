"""Serving /metrics: real sockets, real HTTP."""

import socket
import urllib.request

import pytest

from exporter import MetricsPortInUse, Monitor, MonitorConfig, RankIdentity


def identity(local_rank=0):
    return RankIdentity(run_id="s", rank=local_rank, local_rank=local_rank, world_size=2, node="n0")


def test_each_rank_serves_on_base_port_plus_local_rank(free_port_block):
    base = free_port_block(2)
    monitors = [Monitor(MonitorConfig(host="127.0.0.1", base_port=base), identity(r), device="cpu") for r in (0, 1)]
    try:
        for r, monitor in enumerate(monitors):
            server = monitor.start()
            assert server.port == base + r
            page = urllib.request.urlopen(server.url, timeout=5).read().decode()
            assert f'rank="{r}"' in page
    finally:
        for monitor in monitors:
            monitor.close()


def test_a_taken_port_is_a_clear_error_naming_port_and_rank(free_port):
    port = free_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=port), identity(), device="cpu")
        with pytest.raises(MetricsPortInUse, match=rf"rank 0 \(local_rank 0\): metrics port {port} on 127.0.0.1"):
            monitor.start()


def test_port_fallback_moves_to_the_next_free_port(free_port_block):
    base = free_port_block(3)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base))
        blocker.listen()
        monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=base, port_fallback=2), identity(), device="cpu")
        try:
            assert monitor.start().port == base + 1
        finally:
            monitor.close()
