"""A clean end pages nobody: every rank's last scrape says `rankscope_run_finished 1` (issue 33).

The shipped Prometheus configuration and rules at the shipped scrape and evaluation intervals, the
smallest example (examples/minimal_ddp.py) and the FSDP2 example (examples/fsdp2_loop.py: sharded
checkpoints, the collective view instead of a comm hook) on 2 ranks under torchrun, stopped over the
control endpoint. The rank-down alert excuses a rank whose last word was run_finished 1; a rank whose
page closed before a scrape saw that is a crash to Prometheus, and RankscopeRankDown goes pending at the
next evaluation. No other alert may fire during the run or after its end either.
"""

from __future__ import annotations

import pytest

from devstack.monitoring import MonitoringStack, seconds, shipped_interval, unix_time
from devstack.ports import Ports
from tests.jobs.common import ControlClient
from tests.support import free_port, free_port_block, tail, wait_for

pytestmark = pytest.mark.integration

RUN_ID = "clean-end"


def _liveness_evaluated_at(stack: MonitoringStack) -> float:
    """Unix time of the latest evaluation of the group holding RankscopeRankDown."""
    for group in stack.api("/api/v1/rules", type="alert")["groups"]:
        if any(rule["name"] == "RankscopeRankDown" for rule in group["rules"]):
            return unix_time(group["lastEvaluation"])
    raise AssertionError("no loaded rule group holds RankscopeRankDown")


def _command(example: str, tmp_path, metrics: int, control: int, linger: float) -> list[str]:
    ports = ["--metrics-port", str(metrics), "--control-port", str(control), "--sleep", "0.01", "--linger", str(linger)]
    if example == "minimal_ddp":
        return ["examples/minimal_ddp.py", *ports, "--steps", "100000", "--checkpoint-dir", str(tmp_path / "ckpt")]
    return ["examples/fsdp2_loop.py", *ports, "--max-steps", "100000", "--out", str(tmp_path / "out")]


@pytest.mark.parametrize("example", ["minimal_ddp", "fsdp2_loop"])
def test_a_clean_end_leaves_every_rank_finished_and_raises_no_alert(tmp_path, example):
    scrape, evaluation = (seconds(value) for value in shipped_interval())
    metrics = free_port_block(2)
    job = ControlClient(tmp_path, free_port(), RUN_ID)
    ports = Ports(prometheus=free_port(), alertmanager=free_port(), metrics=metrics, control=job.control_port)
    stack = MonitoringStack(tmp_path / "stack", ports, nproc=2, alertmanager=False)  # shipped intervals and rules

    def diagnose() -> str:
        seen = {e: stack.query(e) for e in ("up", "rankscope_run_finished", 'ALERTS{alertname="RankscopeRankDown"}')}
        return f"prometheus saw {seen}\n{stack.log_tails()}\n--- job\n{tail(job.log)}"

    with stack:
        # The example's own linger, one and a half scrape intervals: one scrape of every rank falls in it.
        job.start(
            _command(example, tmp_path, metrics, job.control_port, 1.5 * scrape),
            free_port(),
            env={"RANKSCOPE_CONTROL_TOKEN": job.token},
        )
        try:
            job.wait_ready()  # rank 0's control endpoint answers (it starts after the metrics pages)
            training = f'rankscope_run_finished{{run_id="{RUN_ID}"}} == 0'
            wait_for(lambda: len(stack.query(training)) == 2, 180, "both ranks scraped while training", diagnose)
            assert job.wait_settled(job.post_action("stop"), timeout=60)["status"] == "applied"
            assert job.wait_exit(timeout=120) == 0, tail(job.log)
        finally:
            job.close()

        # Both targets scraped down after the end, then the rules evaluated past that scrape (twice, so the
        # evaluation that reads the down samples is among them): RankscopeRankDown would be pending by now.
        def down_since() -> float | None:
            found = stack.query('timestamp(up{job="rankscope"} == 0)')
            return max(float(s["value"][1]) for s in found) if len(found) == 2 else None

        down = wait_for(down_since, 60, "both ranks' targets scraped down after the end", diagnose)
        wait_for(lambda: _liveness_evaluated_at(stack) > down + evaluation, 60, "rules evaluated past it", diagnose)

        span = "10m"
        finished = stack.query(f'last_over_time(rankscope_run_finished{{run_id="{RUN_ID}"}}[{span}])')
        last = {s["metric"]["rank"]: float(s["value"][1]) for s in finished}
        assert last == {"0": 1.0, "1": 1.0}, f"each rank's last scraped run_finished: {last}\n{diagnose()}"
        raised = stack.query(f'count_over_time(ALERTS{{alertname="RankscopeRankDown"}}[{span}])')
        assert raised == [], f"a clean end raised RankscopeRankDown: {raised}\n{diagnose()}"
        fired = stack.query(f'count_over_time(ALERTS{{alertstate="firing"}}[{span}])')
        assert fired == [], f"an alert fired during a clean run: {fired}\n{diagnose()}"
