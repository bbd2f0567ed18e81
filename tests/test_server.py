"""Serving /metrics: real sockets, real HTTP."""

import gzip
import http.client
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from rankscope import MetricsPortInUse, Monitor, MonitorConfig, RankIdentity
from rankscope.serving.metrics_endpoint import serve_metrics

from tests.support import binary, fetch


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


class CountingCollector:
    """Counts how often the page is rendered (as the scrape-time probes would run)."""

    def __init__(self) -> None:
        self.calls = 0

    def collect(self):
        self.calls += 1
        yield GaugeMetricFamily("rankscope_test_renders", "renders so far", value=self.calls)

    def describe(self):
        return []


@pytest.mark.parametrize(("seconds", "renders"), [(60.0, 1), (0.0, 5)])
def test_the_page_is_rendered_once_per_cache_period(seconds, renders):
    registry, counting = CollectorRegistry(), CountingCollector()
    registry.register(counting)
    server = serve_metrics(registry, "127.0.0.1", 0, page_cache_seconds=seconds)
    try:
        pages = [fetch(server.url) for _ in range(5)]
    finally:
        server.close()
    assert counting.calls == renders
    assert len(set(pages)) == renders


def _get(url, headers=None, method="GET"):
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request(method, parts.path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_paths_methods_and_gzip(free_port):
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=free_port(), probes=()), identity(), device="cpu")
    try:
        url = monitor.start().url
        status, headers, plain = _get(url)
        assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        status, headers, packed = _get(url, {"Accept-Encoding": "deflate, gzip"})
        assert status == 200 and headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(packed) == plain
        assert "Content-Encoding" not in _get(url, {"Accept-Encoding": "gzip;q=0"})[1]
        status, headers, body = _get(url, method="HEAD")
        assert (status, body, headers["Content-Length"]) == (200, b"", str(len(plain)))
        assert _get(url.replace("/metrics", "/"))[2] == plain
        status, _, body = _get(url.replace("/metrics", "/-/healthy"))
        assert (status, body) == (200, b"OK\n")
        assert _get(url.replace("/metrics", "/favicon.ico"))[0] == 404
        status, headers, _ = _get(url, method="POST")
        assert (status, headers["Allow"]) == (405, "GET, HEAD")
    finally:
        monitor.close()


def test_a_live_page_passes_promtool_check_metrics():
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0, module_stats_every_n_steps=1), identity(),
                      device="cpu")  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor.watch(model, optimizer)
    try:
        url = monitor.start().url
        for batch in monitor.data([torch.randn(8, 4) for _ in range(5)]):
            with monitor.step(samples=8) as step:
                loss = model(batch).pow(2).mean()
                loss.backward()
                step.record(loss=loss, grad_norm=monitor.clip_grad_norm_(model.parameters(), 1.0))
                optimizer.step()
                optimizer.zero_grad()
        monitor.record_loss(0.5)
        monitor.finish()
        page = fetch(url)
    finally:
        monitor.close()
    assert "rankscope_step_duration_seconds_bucket" in page and "rankscope_run_info{" in page
    assert "_created" not in page
    result = subprocess.run([binary("promtool"), "check", "metrics"], input=page, capture_output=True, text=True)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


class BigCollector:
    """A page of about 8 MB: more than a socket takes in one non-blocking send."""

    def collect(self):
        family = GaugeMetricFamily("rankscope_test_wide", "long label values", labels=["blob"])
        for index in range(1000):
            family.add_metric([f"{index:04d}" + "x" * 8000], index)
        yield family

    def describe(self):
        return []


def test_a_page_larger_than_the_socket_buffer_arrives_whole():
    registry = CollectorRegistry()
    registry.register(BigCollector())
    server = serve_metrics(registry, "127.0.0.1", 0, page_cache_seconds=60)
    try:
        rendered = fetch(server.url)  # rendered by a worker
        again = fetch(server.url)  # from the cache: begun by the I/O thread, finished by a worker
    finally:
        server.close()
    assert len(rendered) > 8_000_000 and again == rendered


def test_a_scrape_right_after_finish_shows_the_run_finished_despite_the_cache():
    # Issue 23: a page cached for its period could read run_finished 0 after finish() (a finished rank looked crashed).
    config = MonitorConfig(host="127.0.0.1", base_port=0, probes=(), page_cache_seconds=3600)
    monitor = Monitor(config, identity(), device="cpu")
    server = monitor.start()

    def finished() -> str:
        page = urllib.request.urlopen(server.url, timeout=5).read().decode()
        return next(line for line in page.splitlines() if line.startswith("rankscope_run_finished"))

    try:
        assert finished().endswith(" 0.0")
        monitor.finish()
        assert finished().endswith(" 1.0")
    finally:
        monitor.close()
