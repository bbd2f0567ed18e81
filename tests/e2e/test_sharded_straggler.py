"""A straggler under FSDP2 is named by the shipped straggler alert, from real Prometheus.

examples/fsdp2_loop.py on 3 ranks under torchrun (gloo, `fully_shard` per block and root; no DDP, so no comm
hook: communication time comes from the collective view), scraped by Prometheus evaluating the shipped rule
pack (the e2e suite's short `for`s and windows, tests/e2e/harness.py). One rank sleeps in its compute
(`--slow-rank`): every other rank waits for it in the collectives, so only the collective view's
communication time keeps their compute short. The alert must name that rank; a healthy run of the same
length must raise none.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest

from devstack.monitoring import MonitoringStack
from devstack.ports import Ports
from tests.e2e.harness import INTERVAL_SECONDS, RULE_SETTINGS, generate_rules
from tests.support import free_port_block, stop_process, tail, torchrun, wait_for

pytestmark = pytest.mark.e2e

NPROC = 3
ALERT = "RankscopeRankImbalance"


class ShardedRun:
    """Prometheus + Alertmanager for 3 ranks, and the FSDP2 example on them."""

    def __init__(self, workdir: Path, name: str) -> None:
        base = free_port_block(NPROC + 5)
        self.ports = Ports(prometheus=base, alertmanager=base + 1, control=base + 2, metrics=base + 4)
        self.master_port = base + 3
        self.workdir, self.run_id = workdir, f"e2e-{name}"
        token = workdir / "token"
        token.write_text(secrets.token_urlsafe(24) + "\n")
        self.token = token.read_text().strip()
        config_dir = generate_rules(workdir / "generated", RULE_SETTINGS)
        self.monitoring = MonitoringStack(
            workdir, self.ports, NPROC, token, interval=f"{INTERVAL_SECONDS}s", config_dir=config_dir,
            notify_within="500ms",
        )  # fmt: skip
        self.monitoring.start()
        self.proc = None
        self.log = workdir / "job.log"

    def start(self, *arguments: str) -> None:
        out = self.workdir / "out"
        ports = ["--metrics-port", str(self.ports.metrics), "--control-port", str(self.ports.control)]
        loop = ["--out", str(out), "--max-steps", "100000", "--sleep", "0.05", *ports]
        target = ["examples/fsdp2_loop.py", *loop, *arguments]  # the run's own flags (--slow-rank ...) last
        env = {"RANKSCOPE_RUN_ID": self.run_id, "RANKSCOPE_CONTROL_TOKEN": self.token}
        self.proc = torchrun(NPROC, target, self.master_port, env, log=self.log)

    def firing(self) -> list[dict]:
        alerts = self.monitoring.api("/api/v1/alerts")["alerts"]
        return [a for a in alerts if a["state"] == "firing" and a["labels"]["alertname"] == ALERT]

    def ever_fired(self, since: float) -> list[dict]:
        window = f"{max(1, round(time.time() - since))}s"
        result = self.monitoring.api(
            "/api/v1/query", query=f'ALERTS{{alertname="{ALERT}",alertstate="firing"}}[{window}]'
        )
        return [series["metric"] for series in result["result"]]

    def all_past(self, step: float) -> bool:
        """Whether Prometheus has scraped every rank at `step` or later."""
        found = self.monitoring.query(f'count(rankscope_global_step{{run_id="{self.run_id}"}} >= {step})')
        return bool(found) and float(found[0]["value"][1]) == NPROC

    def step(self) -> float:
        found = self.monitoring.query(f'min(rankscope_global_step{{run_id="{self.run_id}"}})')
        return float(found[0]["value"][1]) if found else 0.0

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.monitoring.close()


@pytest.fixture
def sharded_run(tmp_path):
    started: list[ShardedRun] = []

    def start(name: str) -> ShardedRun:
        workdir = tmp_path / name
        workdir.mkdir()
        started.append(ShardedRun(workdir, name))
        return started[-1]

    yield start
    for run in started:
        run.close()


def test_a_slow_rank_under_fsdp2_is_named_by_the_straggler_alert_and_a_healthy_run_raises_none(sharded_run):
    slow = sharded_run("fsdp2-straggler")
    began = time.time()
    slow.start("--slow-rank", "2", "--slow-seconds", "0.3")
    wait_for(slow.firing, 300, f"{ALERT} to fire", lambda: tail(slow.log))
    assert {a["labels"]["rank"] for a in slow.firing()} == {"2"}
    lasted, steps = time.time() - began, slow.step()
    slow.close()

    healthy = sharded_run("fsdp2-healthy")
    began = time.time()
    healthy.start()
    # As long as the slow run took to be paged, in wall time (as many rule evaluations) and in steps.
    wait_for(
        lambda: healthy.all_past(steps) and time.time() - began >= lasted,
        300,
        "a run as long",
        lambda: tail(healthy.log),
    )
    assert healthy.ever_fired(began) == []
