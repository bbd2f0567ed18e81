"""docker-compose.yml, its GPU override and the Dockerfile, checked without a Docker engine.

The compose files are validated against the Compose Specification's JSON
schema (tests/data/compose-spec.json, see tests/data/README.md for its
source); every host path they mount and every file the Dockerfile copies must
exist in the repository; and the services agree with the config files they
mount (scrape targets, the webhook's token file). The VictoriaMetrics variant
runs with the flags of the local stack the end-to-end test drives
(devstack/vmstack.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((REPO / "tests" / "data" / "compose-spec.json").read_text())
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.vm.yml")


def _load(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


def _schema_errors(document: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def _bind_mounts(compose: dict) -> list[tuple[str, str, str]]:
    """(service, host path, container path) of every bind mount (short syntax; named volumes skipped)."""
    mounts = []
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                mounts.append((name, source, target))
    return mounts


def _container_path(compose: dict, service: str, host_path: str) -> str:
    """Where `host_path` (relative to the repo) appears inside `service`'s container."""
    for name, source, target in _bind_mounts(compose):
        base = (REPO / source).resolve()
        if name == service and (REPO / host_path).resolve().is_relative_to(base):
            return str(Path(target) / (REPO / host_path).resolve().relative_to(base))
    raise AssertionError(f"{host_path} is not mounted into {service}")


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_is_valid_against_the_compose_specification(name):
    errors = _schema_errors(_load(name))
    assert not errors, f"{name} violates the compose specification:\n" + "\n".join(errors)


def test_schema_check_rejects_a_broken_compose_file():
    broken = _load("docker-compose.yml")
    broken["services"]["prometheus"]["healthcheck"]["probe"] = "/-/healthy"  # not a healthcheck key
    broken["services"]["grafana"]["ports"] = "3000:3000"  # must be a list
    errors = _schema_errors(broken)
    assert any("probe" in e for e in errors) and any("grafana/ports" in e for e in errors), errors


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_host_path_the_compose_file_uses_exists_in_the_repo(name):
    compose = _load(name)
    paths = [source for _, source, _ in _bind_mounts(compose)]
    for service in compose["services"].values():
        build = service.get("build")
        if isinstance(build, dict) and "context" in build:
            paths += [build["context"], str(Path(build["context"]) / build.get("dockerfile", "Dockerfile"))]
    for secret in compose.get("secrets", {}).values():
        paths += [secret["file"]] if "file" in secret else []
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"{name} mounts paths that are not in the repo: {missing}"


def test_every_file_the_dockerfile_copies_exists():
    dockerfile = (REPO / "Dockerfile").read_text()
    sources = [
        src for line in re.findall(r"^COPY\s+(.+)$", dockerfile, re.M) for src in line.split()[:-1] if "--" not in src
    ]
    assert sources, "the Dockerfile copies nothing"
    missing = [src for src in sources if not (REPO / src).exists()]
    assert not missing, f"the Dockerfile copies files that are not in the repo: {missing}"


def test_the_dockerfile_starts_from_python_slim_with_cpu_torch_by_default():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile


def test_services_have_the_documented_health_checks_and_ports():
    services = _load("docker-compose.yml")["services"]
    assert set(services) == {"trainer", "prometheus", "alertmanager", "grafana"}
    expected = {"prometheus": "/-/healthy", "alertmanager": "/-/ready", "grafana": "/api/health", "trainer": "/healthz"}
    for name, path in expected.items():
        assert any(path in part for part in services[name]["healthcheck"]["test"]), name
    assert {"127.0.0.1:9400:9400", "127.0.0.1:9401:9401", "127.0.0.1:9300:9300"} <= set(services["trainer"]["ports"])
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    assert "127.0.0.1:9093:9093" in services["alertmanager"]["ports"]
    assert "127.0.0.1:3000:3000" in services["grafana"]["ports"]


def test_every_published_port_listens_on_loopback_only():
    # Whoever reaches Alertmanager can act on the run; Grafana admits anonymous viewers.
    for name in COMPOSE_FILES:
        for service, spec in _load(name)["services"].items():
            for port in spec.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), f"{name}: {service} publishes {port} on every interface"


def test_torchrun_waits_for_the_stop_checkpoint_within_the_grace_period():
    trainer = _load("docker-compose.yml")["services"]["trainer"]
    timeout = next(int(a.split("=")[1]) for a in trainer["entrypoint"] if a.startswith("--shutdown-timeout="))
    assert 0 < timeout < int(trainer["stop_grace_period"].rstrip("s"))


def test_trainer_runs_two_ranks_on_cpu_by_default_and_cuda_with_the_gpu_override():
    base = _load("docker-compose.yml")["services"]["trainer"]
    gpu = _load("docker-compose.gpu.yml")["services"]["trainer"]
    argv = base["entrypoint"] + base["command"]
    assert argv[:2] == ["torchrun", "--standalone"] and "--nproc_per_node=2" in argv
    assert argv[argv.index("-m") + 1] == "rankscope_trainer"
    assert "run.device=cpu" in base["command"]
    assert "run.device=cuda" in gpu["command"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]


def test_checkpoints_and_prometheus_data_live_in_named_volumes():
    compose = _load("docker-compose.yml")
    volumes = compose["volumes"]
    assert "checkpoints:/checkpoints" in compose["services"]["trainer"]["volumes"]
    assert "checkpoint.dir=/checkpoints" in compose["services"]["trainer"]["entrypoint"]
    assert "prometheus-data:/prometheus" in compose["services"]["prometheus"]["volumes"]
    assert {"checkpoints", "prometheus-data"} <= set(volumes)


def _secret_targets(service: dict) -> dict[str, str]:
    """Secret name -> path inside the container (compose's default is /run/secrets/<name>)."""
    targets = {}
    for entry in service.get("secrets", []):
        source = entry if isinstance(entry, str) else entry["source"]
        default = f"/run/secrets/{source}"
        targets[source] = default if isinstance(entry, str) else str(Path(default).parent / entry.get("target", source))
    return targets


def test_the_control_token_is_a_secret_shared_by_trainer_and_alertmanager():
    compose = _load("docker-compose.yml")
    trainer, alertmanager = compose["services"]["trainer"], compose["services"]["alertmanager"]
    assert "control_token" in compose["secrets"]
    assert f"control.token_file={_secret_targets(trainer)['control_token']}" in trainer["entrypoint"]
    # Alertmanager resolves credentials_file relative to its config file.
    config = yaml.safe_load((REPO / "alertmanager" / "alertmanager.yml").read_text())
    config_dir = Path(_container_path(compose, "alertmanager", "alertmanager/alertmanager.yml")).parent
    (receiver,) = [r for r in config["receivers"] if r["name"] == "trainer-control"]
    (webhook,) = receiver["webhook_configs"]
    assert webhook["url"] == "http://trainer:9300/v1/alerts"
    credentials = config_dir / webhook["http_config"]["authorization"]["credentials_file"]
    assert _secret_targets(alertmanager)["control_token"] == str(credentials)


def test_prometheus_scrapes_both_ranks_and_loads_the_mounted_rules():
    compose = _load("docker-compose.yml")
    config = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    assert {"trainer:9400", "trainer:9401"} <= targets
    alertmanagers = {
        t for am in config["alerting"]["alertmanagers"] for sc in am["static_configs"] for t in sc["targets"]
    }
    assert alertmanagers == {"alertmanager:9093"}
    rules_in_container = _container_path(compose, "prometheus", "prometheus/rules")
    config_dir = Path(_container_path(compose, "prometheus", "prometheus/prometheus.yml")).parent
    for pattern in config["rule_files"]:
        resolved = config_dir / pattern
        assert str(resolved.parent) == rules_in_container, f"rule_files {pattern} is not in the mounted rules"


def test_grafana_gets_the_provisioning_and_the_dashboards():
    compose = _load("docker-compose.yml")
    assert _container_path(compose, "grafana", "grafana/provisioning") == "/etc/grafana/provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == _container_path(compose, "grafana", "grafana/dashboards/run-overview.json")


def _flags(command: list[str]) -> dict[str, str]:
    """-name=value arguments as {name: value}."""
    return dict(arg.lstrip("-").split("=", 1) for arg in command if arg.startswith("-") and "=" in arg)


def test_the_victoriametrics_variant_runs_the_shipped_files_with_the_tested_flags():
    from devstack.vmstack import VICTORIA_METRICS_FLAGS, VMALERT_FLAGS

    base, vm = _load("docker-compose.yml"), _load("docker-compose.vm.yml")
    merged = {name: {**base["services"].get(name, {}), **spec} for name, spec in vm["services"].items()}
    store, vmagent, vmalert = (_flags(merged[name]["command"]) for name in ("prometheus", "vmagent", "vmalert"))
    # The latency flags of devstack/vmstack.py, which tests/e2e/test_victoriametrics.py runs with.
    assert _flags(list(VICTORIA_METRICS_FLAGS)).items() <= store.items()
    assert _flags(list(VMALERT_FLAGS)).items() <= vmalert.items()
    # The store takes Prometheus's name and port: Grafana's provisioned datasource queries it unchanged.
    datasource = yaml.safe_load((REPO / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090" and store["httpListenAddr"] == ":9090"
    assert (
        store["storageDataPath"] == "/prometheus" and "prometheus-data:/prometheus" in merged["prometheus"]["volumes"]
    )
    # vmagent scrapes with the shipped scrape jobs and writes to the store.
    assert vmagent["promscrape.config"] == _container_path(vm, "vmagent", "prometheus/prometheus.yml")
    assert vmagent["remoteWrite.url"] == "http://prometheus:9090/api/v1/write"
    # vmalert evaluates the shipped rule files as often as Prometheus would, and tells the same Alertmanager.
    prometheus = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())
    rules_dir = _container_path(vm, "vmalert", "prometheus/rules")
    assert vmalert["rule"] == f"{rules_dir}/*.yml"
    # Prometheus loads the same files: its rule_files pattern is the directory's *.yml.
    assert [Path(pattern).name for pattern in prometheus["rule_files"]] == ["*.yml"]
    assert vmalert["evaluationInterval"] == prometheus["global"]["evaluation_interval"]
    (alertmanager,) = prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert vmalert["notifier.url"] == f"http://{alertmanager}"
    assert {vmalert[key] for key in ("datasource.url", "remoteWrite.url", "remoteRead.url")} == {
        "http://prometheus:9090"
    }
    assert {"prometheus", "alertmanager"} <= set(merged["vmalert"]["depends_on"])


def _compose_stub(directory: Path, version: str) -> str:
    """A `docker-compose` that answers `version --short` as the given release does (no Compose here)."""
    stub = directory / "docker-compose"
    stub.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'version --short' ] && echo {version}\n")
    stub.chmod(0o755)
    return str(stub)


@pytest.mark.parametrize(("version", "ok"), [("1.29.2", False), ("2.24.6", True), ("v2.32.1", True)])
def test_make_compose_check_says_in_one_line_when_compose_is_too_old(tmp_path, version, ok):
    import subprocess

    compose = _compose_stub(tmp_path, version)
    done = subprocess.run(
        ["make", "-s", "compose-check", f"COMPOSE={compose}"], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    if ok:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(f"{version}: ok (the compose files need Compose v2)")
    else:
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert lines[0].startswith("rankscope: the compose files need Docker Compose v2"), done.stderr
        assert f"is {version}" in lines[0]
