"""devstack.stack: the no-Docker stack launcher (`make demo`).

The derived configs are checked with the real promtool and amtool; the
launcher itself is started for real (Prometheus, Alertmanager, torchrun with
two ranks), polled until Prometheus scrapes both ranks, then stopped with
SIGINT, after which none of its processes may be left.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from devstack.jobs import wait_for
from devstack.monitoring import INSTALL_HINT, derive_alertmanager_config, derive_prometheus_config
from devstack.ports import Ports

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_YML = REPO / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "alertmanager" / "alertmanager.yml"


def _launch(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the launcher to an early exit (its checks fail before anything starts)."""
    config = tmp_path / "config.yaml"
    config.write_text("run: {max_steps: 1}\n")
    # A 1-step run reaches no scenario's fault: "none" unless the test names one.
    launcher_args = ["--run-dir", str(tmp_path / "stack"), "--config", str(config), "--scenario", "none"]
    return subprocess.run(
        [sys.executable, "-m", "devstack.stack", *launcher_args, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_derived_prometheus_config_scrapes_each_local_rank_and_passes_promtool(tmp_path):
    ports = Ports(prometheus=19090, alertmanager=19093, metrics=19400, control=19300)
    derived = derive_prometheus_config(
        yaml.safe_load(PROMETHEUS_YML.read_text()), ports=ports, nproc=3, config_dir=PROMETHEUS_YML.parent
    )
    text = yaml.safe_dump(derived)
    assert "trainer:" not in text and "alertmanager:9093" not in text
    targets = {t for job in derived["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"127.0.0.1:19400", "127.0.0.1:19401", "127.0.0.1:19402", "127.0.0.1:19090"} <= targets
    assert derived["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:19093"]
    # Absolute patterns, each matching the committed rule files (prometheus.yml may name a glob).
    assert all(Path(rule).is_absolute() and glob.glob(rule) for rule in derived["rule_files"])
    # Everything but addresses is the repository's file as it is.
    original = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert derived["global"] == original["global"]
    assert [j["job_name"] for j in derived["scrape_configs"]] == [j["job_name"] for j in original["scrape_configs"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    result = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_derived_alertmanager_config_calls_the_local_trainer_with_the_token_and_passes_amtool(tmp_path):
    token = tmp_path / "control-token"
    token.write_text("secret\n")
    original = yaml.safe_load(ALERTMANAGER_YML.read_text())
    derived = derive_alertmanager_config(original, ports=Ports(control=19300, pager=19095), token_file=token)
    hooks = {r["name"]: r.get("webhook_configs", []) for r in derived["receivers"]}
    assert hooks["trainer-control"][0]["url"] == "http://127.0.0.1:19300/v1/alerts"
    assert hooks["trainer-control"][0]["http_config"]["authorization"]["credentials_file"] == str(token)
    assert hooks["pager"][0]["url"].startswith("http://127.0.0.1:19095/")
    assert derived["route"] == original["route"]
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(derived))
    result = subprocess.run(["amtool", "check-config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_without_a_pager_port_the_pager_address_is_left_alone():
    derived = derive_alertmanager_config(
        yaml.safe_load(ALERTMANAGER_YML.read_text()), ports=Ports(), token_file=Path("/t")
    )
    (pager,) = [r for r in derived["receivers"] if r["name"] == "pager"]
    assert "pager:" in pager["webhook_configs"][0]["url"]


def test_missing_binaries_get_one_line_saying_how_to_install_them(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    result = _launch([], tmp_path, env={**os.environ, "PATH": str(empty_bin)})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "prometheus and prometheus-alertmanager not found" in result.stderr
    assert INSTALL_HINT in result.stderr and "apt-get install prometheus prometheus-alertmanager" in INSTALL_HINT


def test_a_port_in_use_is_named_with_the_flag_that_changes_it(tmp_path, free_port):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _launch(["--prometheus-port", str(port), "--alertmanager-port", str(free_port())], tmp_path)
    assert result.returncode == 1
    assert f"port {port} (prometheus) already in use; choose another with --prometheus-port" in result.stderr


def test_a_taken_default_port_is_replaced_by_a_free_one_and_said(capsys):
    import argparse
    import contextlib

    from devstack.stack import choose_ports

    with socket.socket() as busy:
        with contextlib.suppress(OSError):  # already taken by another server: just as good
            busy.bind(("127.0.0.1", Ports.prometheus))  # as a Prometheus of your own would
            busy.listen()
        args = argparse.Namespace(prometheus_port=None, alertmanager_port=None, metrics_port=None,
                                  control_port=None, pager_port=None, nproc=2)  # fmt: skip
        ports = choose_ports(args)
        assert ports.prometheus != Ports.prometheus
        assert f"port {Ports.prometheus} (prometheus) is taken; using {ports.prometheus}" in capsys.readouterr().out
        assert len({ports.prometheus, ports.alertmanager, ports.control, ports.metrics, ports.metrics + 1}) == 5


def test_bad_options_are_rejected_with_the_option_named(tmp_path):
    result = _launch(["--nproc", "0"], tmp_path)
    assert result.returncode == 2 and "--nproc must be >= 1, got 0" in result.stderr
    result = _launch(["--config", str(tmp_path / "missing.yaml")], tmp_path)
    assert result.returncode == 2 and "missing.yaml is not a file" in result.stderr


def test_a_run_that_ends_before_the_scenarios_fault_is_refused_naming_both_steps(tmp_path):
    result = _launch(["--scenario", "divergence", "--steps", "420"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--steps 420 ends before the divergence scenario's fault at step 1500" in result.stderr
    result = _launch(["--scenario", "nonfinite"], tmp_path)  # the config's 1 step
    assert result.returncode == 2, result.stderr
    assert "the config's run.max_steps 1 ends before the nonfinite scenario's fault at step 300" in result.stderr


def _rank_targets(prometheus_port: int) -> list[dict]:
    url = f"http://127.0.0.1:{prometheus_port}/api/v1/targets"
    with urllib.request.urlopen(url, timeout=5) as response:
        targets = json.load(response)["data"]["activeTargets"]
    return [t for t in targets if t["labels"]["job"] == "rankscope"]


@pytest.mark.integration
def test_the_stack_scrapes_both_ranks_and_sigint_stops_every_process_it_started(tmp_path, free_port, free_port_block):
    ports = {
        "--prometheus-port": free_port(),
        "--alertmanager-port": free_port(),
        "--control-port": free_port(),
        "--metrics-port": free_port_block(2),
    }
    argv = [sys.executable, "-m", "devstack.stack", "--run-dir", str(tmp_path / "stack"), "--nproc", "2"]
    argv += ["--steps", "100000", *(str(x) for kv in ports.items() for x in kv)]
    log_path = tmp_path / "launcher.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started: list[psutil.Process] = []
    try:

        def ranks_up() -> list | str | None:
            if launcher.poll() is not None:
                return "exited"  # fail now, not at the deadline
            targets = _rank_targets(ports["--prometheus-port"])  # OSError until Prometheus listens: retried
            return targets if len(targets) == 2 and all(t["health"] == "up" for t in targets) else None

        up = wait_for(ranks_up, 300, "both ranks up in Prometheus", lambda: log_path.read_text()[-4000:])
        assert up != "exited", f"launcher exited early:\n{log_path.read_text()[-4000:]}"

        started = psutil.Process(launcher.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert (
            "prometheus-alertmanager" in names and "--storage.tsdb.path" in names and "torch.distributed.run" in names
        )
        assert sum("-m rankscope_trainer" in " ".join(p.cmdline()) for p in started) >= 3  # torchrun + 2 ranks
        token = tmp_path / "stack" / "control-token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600

        # Ctrl-C once it trains: before its first step a rank has nothing to checkpoint (the ranks serve metrics,
        # and are up, while they still build their model and data).
        run_log = tmp_path / "stack" / "log.jsonl"
        wait_for(lambda: run_log.exists() and '"type": "train"' in run_log.read_text(), 300, "a trained step",
                 lambda: log_path.read_text()[-4000:])  # fmt: skip
        os.kill(launcher.pid, signal.SIGINT)
        assert launcher.wait(timeout=120) == 0, log_path.read_text()[-4000:]
        _, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, f"still running after SIGINT: {[p.cmdline() for p in alive]}"
        # Ctrl-C went through the control endpoint: the trainer checkpointed before it stopped.
        records = [json.loads(line) for line in (tmp_path / "stack" / "log.jsonl").read_text().splitlines()]
        reasons = [r.get("reason", "") for r in records if r.get("type") == "checkpoint"]
        assert any(reason.startswith("stop:") for reason in reasons), records[-3:]
        # On the way out, while Prometheus still ran, the launcher wrote the run report it announced.
        launcher_output = log_path.read_text()
        assert "run report" in launcher_output and "rankscope-report" in launcher_output
        report = tmp_path / "stack" / "report.html"
        assert report.exists() and report.with_suffix(".png").exists(), launcher_output[-4000:]
        assert f"wrote {report}" in launcher_output
        url = (tmp_path / "stack" / "prometheus-url").read_text().strip()  # what `make report` asks
        assert url == f"http://127.0.0.1:{ports['--prometheus-port']}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for proc in started:
            if proc.is_running():
                proc.kill()


def test_a_job_log_s_tail_keeps_the_first_fatal_error_that_scrolled_past_it(tmp_path):
    from devstack.jobs import tail

    log = tmp_path / "job.log"
    lines = ["starting", "Fatal Python error: Aborted", "Thread 0x1 (most recent call first):", *map(str, range(100))]
    log.write_text("\n".join(lines))
    shown = tail(log, lines=10).splitlines()
    assert shown[:2] == ["Fatal Python error: Aborted", "Thread 0x1 (most recent call first):"]
    assert shown[-10:] == [str(n) for n in range(90, 100)]
    log.write_text("\n".join(map(str, range(100))))
    assert tail(log, lines=10).splitlines() == [str(n) for n in range(90, 100)]


def test_each_launch_gets_a_run_id_of_its_own_unless_one_is_set():
    """Issue 34: the narration and the report follow this launch's run_id; one launch must never take an
    earlier demo's (Prometheus keeps its data in .stack/)."""
    from devstack.stack import _parse_args

    first = _parse_args(["--scenario", "none"])
    assert first.run_id == f"demo-none-{int(first.started_at)}"
    assert _parse_args(["--scenario", "none", "--set", "run.run_id=mine"]).run_id == "mine"
