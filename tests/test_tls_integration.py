"""The real Prometheus and Alertmanager talking to both endpoints over mutual TLS, with certificates
made by the test (devstack/certs.py): Prometheus scrapes two ranks with a client certificate, and
Alertmanager's webhook (client certificate and bearer token) delivers a firing alert that the control
endpoint accepts, and, on a real 2-rank torchrun job served over mTLS, that alert's action is applied on
both ranks while a client without a certificate changes nothing. Run under the heavy lock (they start real
servers)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope.control.app import AppDeps, create_app
from rankscope.control.client import ClientTls, session_for
from rankscope.control.endpoint import serve_control
from rankscope.control.state import ActionQueue, RunSnapshot
from rankscope.serving.webconfig import load_web_config

from devstack.certs import Certs, make_certs, write_web_config
from tests.jobs.common import ControlClient
from tests.support import free_port, promtool_problems, running_alertmanager, sample_value, samples, wait_for

pytestmark = pytest.mark.integration

TOKEN = "integration-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"), clients=("prometheus", "alertmanager", "operator"))


def tls_config(certs: Certs, client: str) -> dict:
    return {"ca_file": str(certs.ca), "cert_file": str(certs.client_cert(client)),
            "key_file": str(certs.client_key(client))}  # fmt: skip


def test_prometheus_scrapes_both_ranks_over_mtls_and_the_page_passes_promtool(certs, tmp_path, monkeypatch):
    from devstack.monitoring import start_prometheus
    from devstack.processes import Children

    monkeypatch.setenv("RANKSCOPE_METRICS_WEB_CONFIG_FILE", str(write_web_config(certs, tmp_path / "web.yml")))
    monitors = [Monitor(MonitorConfig(host="127.0.0.1", base_port=0, probes=("host",)),
                        RankIdentity("tls", rank, rank, 2, "n0"), device="cpu") for rank in (0, 1)]  # fmt: skip
    children = Children()
    try:
        targets = [f"127.0.0.1:{monitor.start().port}" for monitor in monitors]
        for monitor in monitors:
            with monitor.step():
                pass
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "rankscope", "scheme": "https",
                                "tls_config": tls_config(certs, "prometheus"),
                                "static_configs": [{"targets": targets}]}],
        }  # fmt: skip
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))
        prometheus = start_prometheus(children, tmp_path / "prometheus.yml", tmp_path, free_port())

        def both_up() -> bool:
            answer = requests.get(f"{prometheus.url}/api/v1/query", params={"query": "up"}, timeout=5).json()
            values = {r["metric"]["instance"]: r["value"][1] for r in answer["data"]["result"]}
            return sorted(values) == sorted(targets) and set(values.values()) == {"1"}

        wait_for(both_up, 60, "Prometheus scraping both ranks over mTLS")
        steps = requests.get(f"{prometheus.url}/api/v1/query", params={"query": "rankscope_steps_total"}, timeout=5)
        assert {r["metric"]["rank"] for r in steps.json()["data"]["result"]} == {"0", "1"}
        session = session_for(ClientTls(**{k.split("_")[0]: v for k, v in tls_config(certs, "operator").items()}))
        page = session.get(monitors[0]._server.url, timeout=10).text
        assert promtool_problems(page) == ""
    finally:
        children.stop_all({})
        for monitor in monitors:
            monitor.close()


def test_alertmanager_delivers_a_firing_alert_over_mtls_with_its_token(certs, tmp_path):
    queue = ActionQueue()
    web = load_web_config(write_web_config(certs, tmp_path / "web.yml"))
    server = serve_control(create_app(AppDeps(queue, RunSnapshot(), TOKEN, run_id="tls")), "127.0.0.1", 0, web=web)
    receiver = {
        "name": "trainer",
        "webhook_configs": [{
            "url": f"{server.url}/v1/alerts",
            "send_resolved": False,
            "http_config": {"authorization": {"credentials": TOKEN},
                            "tls_config": tls_config(certs, "alertmanager")},
        }],
    }  # fmt: skip
    config = {"route": {"receiver": "trainer", "group_wait": "0s", "group_interval": "1s", "repeat_interval": "1h"},
              "receivers": [receiver]}  # fmt: skip
    (tmp_path / "alertmanager.yml").write_text(json.dumps(config))
    try:
        with running_alertmanager(tmp_path / "alertmanager.yml", tmp_path, free_port()) as url:
            alert = {"labels": {"alertname": "RankscopeLossSpike", "action": "checkpoint", "run_id": "tls"},
                     "annotations": {"summary": "over mTLS"},
                     "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            requests.post(f"{url}/api/v2/alerts", json=[alert], timeout=10).raise_for_status()
            pending = wait_for(lambda: queue.snapshot()["pending"], 60, "the alert delivered over mTLS")
            assert [p["action"] for p in pending] == ["checkpoint"] and pending[0]["source"] == "alert"
    finally:
        server.close()
    assert Path(tmp_path / "alertmanager.log").exists()


def test_an_alert_over_mtls_reduces_the_learning_rate_on_both_ranks_and_a_certless_client_changes_nothing(
    certs, tmp_path
):
    web = write_web_config(certs, tmp_path / "web.yml")
    job = ControlClient(tmp_path, free_port(), "tls-job")
    operator = ClientTls(
        ca=str(certs.ca), cert=str(certs.client_cert("operator")), key=str(certs.client_key("operator"))
    )
    job.url, job.http = f"https://127.0.0.1:{job.control_port}", session_for(operator)
    # Both endpoints of every rank behind the same mTLS web config: control via its setting, metrics via the env.
    job.start_job("tests/jobs/control_job.py", free_port(), {"web_config_file": str(web)}, 3.0,
                  env={"RANKSCOPE_METRICS_WEB_CONFIG_FILE": str(web)})  # fmt: skip
    try:
        job.wait_ready()
        metrics = session_for(operator)

        def learning_rates() -> list[float | None]:
            pages = [metrics.get(f"https://127.0.0.1:{job.ready(r)['metrics_port']}/metrics", timeout=5).text
                     for r in (0, 1)]  # fmt: skip
            return [sample_value(samples(p), "rankscope_learning_rate", param_group="0") for p in pages]

        assert learning_rates() == pytest.approx([0.1, 0.1])

        # No client certificate (the right CA and the right token): refused at the handshake, nothing queued.
        certless = session_for(ClientTls(ca=str(certs.ca)), token=job.token)
        with pytest.raises(requests.exceptions.ConnectionError):
            certless.post(f"{job.url}/v1/actions", json={"action": "stop", "reason": "no cert"}, timeout=5)
        # Plain HTTP to the TLS port: refused or a 400, never acted on.
        try:
            plain = requests.post(f"http://127.0.0.1:{job.control_port}/v1/actions", headers=job.headers,
                                  json={"action": "stop", "reason": "plain"}, timeout=5)  # fmt: skip
            assert plain.status_code == 400, plain.text
        except requests.exceptions.ConnectionError:
            pass
        assert job.status()["recent"] == [] and job.status()["pending"] == []

        receiver = {"name": "trainer", "webhook_configs": [{
            "url": f"{job.url}/v1/alerts", "send_resolved": False,
            "http_config": {"authorization": {"credentials_file": str(job.token_file)},
                            "tls_config": tls_config(certs, "alertmanager")},
        }]}  # fmt: skip
        config = {"route": {"receiver": "trainer", "group_wait": "0s", "group_interval": "1s",
                            "repeat_interval": "1h"}, "receivers": [receiver]}  # fmt: skip
        (tmp_path / "alertmanager.yml").write_text(json.dumps(config))
        with running_alertmanager(tmp_path / "alertmanager.yml", tmp_path, free_port()) as url:
            alert = {"labels": {"alertname": "RankscopeLossPlateau", "action": "reduce_lr", "run_id": "tls-job"},
                     "annotations": {"summary": "over mTLS"},
                     "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            requests.post(f"{url}/api/v2/alerts", json=[alert], timeout=10).raise_for_status()

            def settled() -> list[dict]:
                return [r for r in job.status()["recent"] if r["action"] == "reduce_lr"]

            done = job.wait_for(settled, "the alert's reduce_lr to settle on the job", timeout=60)
        assert [(r["status"], r["source"], r["reason"]) for r in done] == [
            ("applied", "alert", "alert:RankscopeLossPlateau")
        ]
        step = done[0]["step"]
        for rank in (0, 1):
            assert job.step_record(rank, step)["lr"] == pytest.approx([0.05])
            assert [r["step"] for r in job.steps(rank) if "reduce_lr" in r.get("applied", [])] == [step]
        # What each rank reports (scraped over mTLS) follows at its next step.
        job.wait_for(lambda: learning_rates() == pytest.approx([0.05, 0.05]), "both ranks to report lr 0.05")

        job.post_action("stop", reason="test over")
        assert job.wait_exit() == 0
        # The refused stops never reached the job: both ranks stopped for the operator's, after the reduction.
        for rank in (0, 1):
            assert job.steps(rank)[-1]["stop_reason"] == "operator:test over"
    finally:
        job.close()
