"""The shipped TLS examples are valid for the real tools: prometheus/examples/tls.yml for promtool (its
Kubernetes job aside: Debian's Prometheus is built without Kubernetes discovery) and
alertmanager/examples/tls.yml for amtool, with certificates made by the test."""

from __future__ import annotations

import subprocess

import yaml

from devstack.certs import make_certs
from tests.support import REPO, binary


def test_the_prometheus_tls_example_is_a_valid_scrape_config(tmp_path):
    certs = make_certs(tmp_path / "tls", clients=("prometheus",))
    jobs = yaml.safe_load((REPO / "prometheus" / "examples" / "tls.yml").read_text())
    assert all(job["scheme"] == "https" and "cert_file" in job["tls_config"] for job in jobs)
    checked = [job for job in jobs if "kubernetes_sd_configs" not in job]
    text = yaml.safe_dump({"scrape_configs": checked}).replace("/etc/prometheus/tls/", f"{certs.folder}/")
    (tmp_path / "prometheus.yml").write_text(text)
    result = subprocess.run([binary("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alertmanager_tls_example_is_a_valid_receiver(tmp_path):
    certs = make_certs(tmp_path / "tls", clients=("alertmanager",))
    config = yaml.safe_load((REPO / "alertmanager" / "examples" / "tls.yml").read_text())
    config["route"] = {"receiver": "trainer"}
    (tmp_path / "token").write_text("t0ken")
    text = yaml.safe_dump(config).replace("/etc/alertmanager/tls/", f"{certs.folder}/")
    text = text.replace("/etc/alertmanager/secrets/control_token", str(tmp_path / "token"))
    (tmp_path / "alertmanager.yml").write_text(text)
    result = subprocess.run([binary("amtool"), "check-config", str(tmp_path / "alertmanager.yml")],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
