"""rankscope-report against a real Prometheus: one-line errors, and a report of a live run.

Prometheus (the system's binary) scrapes, every second, two real monitors of this process
(exporter.Monitor serving /metrics): `fresh`, started and never stepped (a run with no data
yet), and `live`, stepped by a small loop in a thread for as long as the module runs. The
command runs as a subprocess, as a user types it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml
from rankscope import Monitor, MonitorConfig, RankIdentity

from devstack.processes import Children
from tests.support import REPO, fetch, free_port, start_prometheus, wait_for

pytestmark = pytest.mark.integration


def report(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankscope.report", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _one_line_error(result: subprocess.CompletedProcess, exit_code: int = 1) -> str:
    assert result.returncode == exit_code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rankscope-report: "), result.stderr
    return lines[0]


def _monitor(run_id: str) -> Monitor:
    identity = RankIdentity(run_id=run_id, rank=0, local_rank=0, world_size=1, node="test")
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0, probes=("host",)), identity, device="cpu")
    monitor.start()
    return monitor


class _Loop(threading.Thread):
    """A stand-in training loop: steps with a falling loss until told to stop."""

    def __init__(self, monitor: Monitor) -> None:
        super().__init__(daemon=True)
        self.monitor, self.done = monitor, threading.Event()

    def run(self) -> None:
        step = 0
        while not self.done.is_set():
            step += 1
            with self.monitor.step(samples=8, tokens=64) as context:
                context.record(loss=torch.tensor(2.0 / (1 + 0.05 * step)), grad_norm=torch.tensor(1.0))
            self.done.wait(0.05)  # the loop's own pace, not a synchronisation


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fresh, live = _monitor("fresh"), _monitor("live")
    loop = _Loop(live)
    loop.start()
    workdir = tmp_path_factory.mktemp("report-prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "rankscope", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{m.port}" for m in (fresh, live)]}]}],
    }  # fmt: skip
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    children = Children()
    try:
        url = start_prometheus(children, workdir / "prometheus.yml", workdir, free_port()).url

        def scraped(run_id: str, minimum: int) -> bool:
            expr = urllib.parse.quote(f'count_over_time(rankscope_global_step{{run_id="{run_id}"}}[1m])')
            result = json.loads(fetch(f"{url}/api/v1/query?query={expr}"))["data"]["result"]
            return bool(result) and int(result[0]["value"][1]) >= minimum

        wait_for(lambda: scraped("fresh", 2) and scraped("live", 8), 60, "Prometheus to scrape both monitors")
        yield url
    finally:
        loop.done.set()
        loop.join(timeout=10)
        children.stop_all({})
        for monitor in (fresh, live):
            monitor.close()


def test_an_unreachable_prometheus_is_one_line(tmp_path) -> None:
    port = free_port()  # nothing listens there
    line = _one_line_error(report("--prometheus", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "r.html")))
    assert line == f"rankscope-report: cannot reach Prometheus at http://127.0.0.1:{port}: connection refused"
    assert not (tmp_path / "r.html").exists()


def test_a_server_that_is_not_prometheus_is_named(tmp_path) -> None:
    monitor = _monitor("not-prometheus")  # an HTTP server, but not the API
    try:
        line = _one_line_error(
            report("--prometheus", f"http://127.0.0.1:{monitor.port}", "--out", str(tmp_path / "r.html"))
        )
    finally:
        monitor.close()
    assert "does not look like a Prometheus HTTP API" in line


def test_bad_usage_exits_2_with_one_line(tmp_path) -> None:
    assert "--out must name an .html file" in _one_line_error(report("--out", str(tmp_path / "r.txt")), 2)
    assert "--timeout" in _one_line_error(report("--timeout", "-1"), 2)


def test_a_prometheus_without_runs_says_so(tmp_path) -> None:
    workdir = tmp_path / "empty"
    workdir.mkdir()
    (workdir / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}}))
    children = Children()
    try:
        url = start_prometheus(children, workdir / "prometheus.yml", workdir, free_port()).url
        line = _one_line_error(report("--prometheus", url, "--out", str(tmp_path / "r.html")))
    finally:
        children.stop_all({})
    assert line == (f"rankscope-report: Prometheus at {url} holds no rankscope run from the last 30 days "
                    "(no rankscope_global_step series): is it scraping the trainer's ranks?")  # fmt: skip


def test_an_unknown_run_id_is_named_with_the_runs_there_are(prometheus: str, tmp_path) -> None:
    line = _one_line_error(report("--prometheus", prometheus, "--run-id", "nope", "--out", str(tmp_path / "r.html")))
    assert line.startswith(f"rankscope-report: no run with run_id 'nope' in Prometheus at {prometheus} (runs there: ")
    assert "fresh" in line and "live" in line


def test_a_run_that_has_not_stepped_yet_has_no_data_yet(prometheus: str, tmp_path) -> None:
    line = _one_line_error(report("--prometheus", prometheus, "--run-id", "fresh", "--out", str(tmp_path / "r.html")))
    assert line == (
        "rankscope-report: run 'fresh' has no data yet: its ranks are scraped but none has completed a training step "
        "(run the report again once it has trained for a while)"
    )


def test_a_bad_run_log_is_named_before_prometheus_is_asked(prometheus: str, tmp_path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"type": "start", "time": 1}\nnot json\n{"type": "finished", "time": 2}\n')
    line = _one_line_error(report("--prometheus", prometheus, "--run-id", "live", "--log", str(log),
                                  "--out", str(tmp_path / "r.html")))  # fmt: skip
    assert line == f"rankscope-report: {log}:2: not a JSON object (is this a rankscope run log?)"


class _Sections(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "section":
            self.sections.append(found.get("id") or "")
        if tag == "img" and (found.get("src") or "").startswith("data:image/png;base64,"):
            self.images += 1


def test_a_live_run_gets_its_report_and_summary(prometheus: str, tmp_path: Path) -> None:
    out = tmp_path / "live" / "report.html"
    result = report("--prometheus", prometheus, "--run-id", "live", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout and "run live" in result.stdout
    parsed = _Sections()
    parsed.feed(out.read_text())
    assert parsed.sections == ["facts", "overview", "training", "ranks", "resources", "incidents", "goodput",
                               "analyses", "attention"]  # fmt: skip
    assert parsed.images >= 9
    page = out.read_text()
    assert "live: still training" in page and "No attention maps" in page
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_a_campaign_adds_its_table_to_the_runs_report(prometheus: str, tmp_path: Path) -> None:
    from tests.test_report_campaign import _campaign

    campaign = tmp_path / "campaign.json"
    campaign.write_text(json.dumps(_campaign()[1]))
    out = tmp_path / "report.html"
    result = report("--prometheus", prometheus, "--run-id", "live", "--campaign", str(campaign), "--out", str(out))
    assert result.returncode == 0, result.stderr
    parsed = _Sections()
    parsed.feed(out.read_text())
    assert parsed.sections[-1] == "campaign", parsed.sections
    page = out.read_text()
    assert f"From {campaign}." in page and "loop on: per fault" in page and "hang_data @ 21" in page
