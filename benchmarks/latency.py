"""Benchmark 3: from an injected fault to the action applied on every rank, through the real stack.

    .venv/bin/python -m benchmarks.latency             # 3 trials with 1 s intervals, 3 with the shipped ones, ~4 min
    .venv/bin/python -m benchmarks.latency --quick     # 2 + 2 trials, ~2.5 min
    .venv/bin/python -m benchmarks.latency --modes 1s --trials 6

The path measured is the shipped one: the reference trainer (2 ranks under
torchrun, trainer/rankscope_trainer/configs/demo.yaml, control endpoint on) -> Prometheus
scraping both ranks with the shipped rules -> `RankscopeNonFiniteSteps` (the
alert with `for: 0s` and `action: reduce_lr`) -> Alertmanager with the shipped
routes (the trainer route has `group_wait: 0s`) -> the webhook on rank 0 ->
the next step boundary, where every rank applies the new learning rate.
Prometheus and Alertmanager run from the repository's configs as the stack
launcher derives them; mode `1s` sets the global scrape and evaluation
interval to 1 s, mode `shipped` keeps prometheus/prometheus.yml's.

One trial: a fresh trainer (its own run_id, so a fresh alert) with its own
fresh Prometheus and Alertmanager (see `Trial` for why) is paused at
its first step boundary until Prometheus has scraped both ranks (so the
counter's 0 is in the TSDB, as in any run that has been going a while),
resumed after a random fraction of a scrape interval (so the fault falls at a
random phase of the scrape cycle), and from step 20 its loss turns NaN for 3
steps (`faults.nonfinite`). The shipped rule fires on more than 2 non-finite
steps in 10 minutes, by `increase()`, which extrapolates: a scrape that saw 2
can already fire it. The breakdown uses each component's own timestamps:

    fault       the end of step 20, the first NaN step (rank 0's log)
    scrape      -> the scrape whose samples the firing evaluation read (the newest, any rank, up to it)
    rule        -> the evaluation that made the alert active and, with for: 0s, firing (Prometheus activeAt)
    alertmgr    -> Alertmanager received it (its updatedAt; Prometheus resends only after 1 min)
    webhook     -> the control endpoint received the webhook (the action's received_at)
    boundary    -> every rank applied it at the next step boundary (settled_at, after the ranks agree)

So `scrape` holds the fault's own development (2 or 3 steps, 0.2-0.5 s
here) plus the wait for the next scrape.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from devstack.jobs import TrainerJob
from devstack.monitoring import REPO, MonitoringStack, seconds, shipped_interval, unix_time
from devstack.ports import free_port, local_ports

from .timing import machine_line

__all__ = ["main"]

ALERT = "RankscopeNonFiniteSteps"
FAULT_STEP = 20
FAULT_STEPS = 3  # the shipped rule fires on more than 2 non-finite steps
NPROC = 2
PHASES = ("scrape", "rule", "alertmgr", "webhook", "boundary")


class Control:
    """Rank 0's control endpoint, as an operator (and this benchmark) uses it."""

    def __init__(self, port: int, token: str) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def status(self) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.base}/v1/status", headers=self.headers)
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def act(self, action: str, reason: str, params: dict[str, Any] | None = None) -> None:
        body = json.dumps({"action": action, "reason": reason, **({"params": params} if params else {})}).encode()
        request = urllib.request.Request(f"{self.base}/v1/actions", data=body, headers=self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass

    def settled(self, action: str, reason: str | None = None) -> dict[str, Any] | None:
        for record in self.status()["recent"]:
            if record["action"] == action and record["status"] == "applied" and reason in (None, record["reason"]):
                return record
        return None


class Trial:
    """One trainer run and its own Prometheus and Alertmanager, from pause to the applied action.

    Each trial gets fresh ports and a fresh stack: Prometheus spreads scrapes and rule evaluations over
    the interval by hashing the target and the group, so the delay from a scrape to the next evaluation
    is fixed for one setup and differs between setups. A stack per trial samples it; it also leaves no
    alert of an earlier trial in Alertmanager.
    """

    def __init__(self, workdir: Path, interval: str | None, name: str) -> None:
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True)
        scrape, _ = shipped_interval() if interval is None else (interval, interval)
        self.interval = seconds(scrape)
        self.run_id = f"bench-latency-{name}-{secrets.token_hex(2)}"
        self.ports = local_ports(NPROC)
        token_file = self.workdir / "control-token"
        token_file.write_text(secrets.token_urlsafe(32) + "\n")
        self.control = Control(self.ports.control, token_file.read_text().strip())
        self.job = TrainerJob(
            self.workdir,
            free_port(),
            self.ports.metrics,
            [
                f"run.run_id={self.run_id}",
                "run.log_every=1",  # every step's end time in the log: the fault's time
                "run.val_every=0",
                "run.max_steps=100000",
                "checkpoint.every_steps=0",
                "checkpoint.save_final=false",
                "control.endpoint=true",
                f"control.port={self.ports.control}",
                f"control.token_file={token_file}",
                f"faults.nonfinite.at_step={FAULT_STEP}",
                f"faults.nonfinite.steps={FAULT_STEPS}",
                "faults.nonfinite.rank=0",
            ],
            config=str(REPO / "trainer" / "rankscope_trainer" / "configs" / "demo.yaml"),
            nproc=NPROC,
        )
        # Started while the trainer starts up (it needs neither).
        self.stack = MonitoringStack(self.workdir / "stack", self.ports, NPROC, token_file, interval=interval)

    def run(self) -> dict[str, float]:
        try:
            self.stack.start()
            return self._run()
        finally:
            self.job.close()
            self.stack.close()

    def _run(self) -> dict[str, float]:
        job, control = self.job, self.control
        job.wait_for(self._try(lambda: control.act("pause", "benchmark: wait for the first scrape") or True),
                     "the control endpoint to take a pause", timeout=120)  # fmt: skip
        paused = job.wait_for(lambda: self._try(lambda: control.settled("pause"))(), "the pause applied", 60)
        if paused["step"] >= FAULT_STEP:
            raise RuntimeError(f"the pause came at step {paused['step']}, after the fault step {FAULT_STEP}")
        count = f'count(rankscope_nonfinite_steps_total{{run_id="{self.run_id}"}} == 0)'
        job.wait_for(lambda: self.stack.value(count) == NPROC, "Prometheus to scrape both ranks", 10 * self.interval)
        # A random phase of the scrape cycle, as a real fault has (a deliberate delay, not synchronisation).
        time.sleep(random.uniform(0, self.interval))
        control.act("resume", "benchmark: inject the fault")
        reason = f"alert:{ALERT}"
        applied = job.wait_for(lambda: control.settled("reduce_lr", reason), "the alert's reduce_lr applied",
                               timeout=30 + 8 * self.interval)  # fmt: skip
        return self._breakdown(applied)

    @staticmethod
    def _try(function):
        def attempt():
            try:
                return function()
            except OSError:  # not up yet
                return None

        return attempt

    def _breakdown(self, applied: dict[str, Any]) -> dict[str, float]:
        records = {r["step"]: r for r in self.job.records("train")}
        fault = float(records[FAULT_STEP]["time"])  # the end of the first NaN step
        (alert,) = [
            a for a in self.stack.prometheus_alerts()
            if a["labels"].get("alertname") == ALERT and a["labels"].get("run_id") == self.run_id
        ]  # fmt: skip
        active = unix_time(alert["activeAt"])
        # The evaluation that fired read the newest samples at or before its time: the scrape that
        # delivered the evidence is the last one of the run (any rank) with a count, up to then.
        series = self.stack.query(f'rankscope_nonfinite_steps_total{{run_id="{self.run_id}"}}[15m]')
        seen = max(float(ts) for s in series for ts, value in s["values"] if float(value) > 0 and float(ts) <= active)
        (received,) = self.stack.alertmanager_alerts(alertname=ALERT, run_id=self.run_id)
        times = {
            "fault": fault,
            "scrape": seen,
            "rule": active,
            "alertmgr": unix_time(received["updatedAt"]),
            "webhook": float(applied["received_at"]),
            "boundary": float(applied["settled_at"]),
        }
        marks = ["fault", *PHASES]
        result = {phase: times[phase] - times[before] for before, phase in zip(marks, marks[1:], strict=False)}
        result["total"] = times["boundary"] - times["fault"]
        result["step"] = float(applied["step"])
        return result


def run_mode(mode: str, trials: int, workdir: Path) -> list[dict[str, float]]:
    interval = "1s" if mode == "1s" else None
    scrape, evaluation = shipped_interval() if interval is None else (interval, interval)
    print(f"\nmode {mode}: scrape every {scrape}, evaluate every {evaluation}, Alertmanager as shipped", flush=True)
    results = []
    for index in range(trials):
        result = Trial(workdir, interval, f"{mode}-{index + 1}").run()
        results.append(result)
        print("  trial {}: total {:.2f} s = {} (applied at step {:.0f})".format(
            index + 1, result["total"], " + ".join(f"{p} {result[p]:.3f}" for p in PHASES), result["step"],
        ), flush=True)  # fmt: skip
    return results


def summary(mode: str, results: list[dict[str, float]]) -> str:
    columns = ["total", *PHASES]
    lines = [f"{mode:<8} {'':<7}" + "".join(f"{c:>10}" for c in columns)]
    for label, reduce in (("median", statistics.median), ("max", max)):
        lines.append(f"{'':<8} {label:<7}" + "".join(f"{reduce(r[c] for r in results):>9.3f}s" for c in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["1s", "shipped"], choices=["1s", "shipped"])
    parser.add_argument("--trials", type=int, default=3, help="trials per mode")
    parser.add_argument("--quick", action="store_true", help="2 trials per mode")
    parser.add_argument("--keep", type=Path, default=None, help="keep configs and logs in this directory")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be >= 1, got {args.trials}")
    trials = 2 if args.quick else args.trials
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="rankscope-latency-") as tmp:
        workdir = args.keep.resolve() if args.keep else Path(tmp)
        results = {mode: run_mode(mode, trials, workdir / mode) for mode in args.modes}
    print(f"\nfault -> action applied on all ranks, seconds ({trials} trials per mode)")
    for mode, found in results.items():
        print(summary(mode, found))
    print(machine_line())


if __name__ == "__main__":
    main()
