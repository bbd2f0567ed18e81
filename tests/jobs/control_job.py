"""A tiny DDP training job driven through the control channel, and its launcher for tests.

Run by torchrun (`torchrun --nproc_per_node=2 tests/jobs/control_job.py --out DIR ...`),
each rank trains a linear model with gloo, uses exporter's Monitor and
ControlChannel exactly as a user's loop would, and writes what it saw to
DIR/rank<r>.jsonl, one line per step: the step, the learning rates, the actions
the channel applied at that step's boundary and how long the boundary held the
rank. Its handler writes DIR/ckpt-rank<r>-step<s>.json. Nothing here imports
the trainer package.

Tests use :class:`ControlJob` to start it, talk to rank 0's endpoint and read
the ranks' logs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import requests

from tests.support import stop_process, tail, torchrun, wait_for

T = TypeVar("T")
_DIED = object()  # what ControlJob.wait_for's check returns once the job has exited


# --- the job (runs under torchrun) ------------------------------------------------------


class _Handler:
    """The loop's side of the control channel: checkpoint files and a stop flag."""

    def __init__(self, out: Path, rank: int, monitor: Any, optimizer: Any) -> None:
        self.out, self.rank, self.monitor, self.optimizer = out, rank, monitor, optimizer
        self.step = 0
        self.stop_reason: str | None = None

    def checkpoint(self, reason: str) -> Path:
        from rankscope.control import record_checkpoint

        started = time.perf_counter()
        path = self.out / f"ckpt-rank{self.rank}-step{self.step}.json"
        record = {"step": self.step, "reason": reason, "lr": [g["lr"] for g in self.optimizer.param_groups]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # atomic, like a real checkpoint
        record_checkpoint(self.monitor, reason, time.perf_counter() - started)
        return path

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason


def _main(argv: list[str]) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from prometheus_client import generate_latest
    from rankscope import Monitor, MonitorConfig, config_from_mapping
    from rankscope.control import ControlChannel, ControlConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--control", default="{}", help="JSON mapping of ControlConfig settings")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--pg-timeout", type=float, default=3.0, help="main group timeout after start-up")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    # Start-up on a busy machine can be slow: a long timeout to rendezvous, the short one after.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Warmup over 5 steps, then constant: a scheduler that would undo a plain lr change.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0, probes=("host",)))
    monitor.start()
    monitor.watch(model.module, optimizer)
    control = config_from_mapping(ControlConfig, json.loads(args.control), "control")
    channel = ControlChannel(control, monitor, optimizer=optimizer, scheduler=scheduler)
    dist.set_timeout(timedelta(seconds=args.pg_timeout))  # the main group's timeout, low on purpose
    handler = _Handler(args.out, rank, monitor, optimizer)
    (args.out / f"rank{rank}.ready.json").write_text(
        json.dumps({"pid": os.getpid(), "control_url": channel.url, "metrics_port": monitor.port})
    )
    generator = torch.Generator().manual_seed(rank)
    with open(args.out / f"rank{rank}.jsonl", "a", buffering=1) as log:
        for step in range(1, args.max_steps + 1):
            with monitor.step(samples=4) as ctx:
                x = torch.randn(4, 8, generator=generator)
                loss = model(x).pow(2).mean()
                loss.backward()
                time.sleep(args.step_seconds)  # stands in for real compute; keeps two shared cores usable
                ctx.record(loss=loss)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
            handler.step = step
            started = time.monotonic()
            applied = channel.at_step_boundary(step, handler)
            held = time.monotonic() - started
            lrs = [group["lr"] for group in optimizer.param_groups]
            log.write(json.dumps({"step": step, "lr": lrs, "applied": applied, "held": held}) + "\n")
            if handler.stop_reason is not None:
                handler.checkpoint(f"stop:{handler.stop_reason}")
                break
        log.write(json.dumps({"exit": True, "step": step, "stop_reason": handler.stop_reason}) + "\n")
    channel.close()  # the loop has left: a requested stop is applied here
    (args.out / f"rank{rank}.metrics.txt").write_bytes(generate_latest(monitor.registry))
    monitor.close()
    dist.destroy_process_group()
    return 0


# --- the launcher (runs in the test process) -----------------------------------------------


class ControlClient:
    """A job started under torchrun with rank 0's control endpoint, as the tests talk to it.

    Subclasses start the job (`start`); this class polls it, posts actions and reads the files it writes.
    """

    def __init__(self, out: Path, control_port: int, run_id: str) -> None:
        self.out = out
        self.run_id = run_id
        self.token = "test-token-" + os.urandom(8).hex()
        self.token_file = out / "token"
        self.token_file.write_text(self.token + "\n")
        self.control_port = control_port
        self.url = f"http://127.0.0.1:{control_port}"
        self.headers = {"Authorization": f"Bearer {self.token}"}
        self.log = out / "torchrun.log"
        self.proc: subprocess.Popen | None = None

    def start(self, target: list[str], master_port: int, env: dict[str, str] | None = None) -> None:
        """torchrun 2 ranks of `target` (a script and its arguments) with the run id and `env`."""
        self.proc = torchrun(2, target, master_port, {"RANKSCOPE_RUN_ID": self.run_id, **(env or {})}, log=self.log)

    def wait_for(self, check: Callable[[], T], what: str, timeout: float = 60.0) -> T:
        """Poll `check` until truthy; fail at once if the job dies, with its log either way."""

        def done() -> Any:
            return _DIED if self.proc.poll() is not None else check()

        result = wait_for(done, timeout, what, diagnose=lambda: tail(self.log))
        if result is _DIED:
            raise AssertionError(f"job exited with {self.proc.returncode} while waiting for {what}\n{tail(self.log)}")
        return result

    def wait_ready(self) -> None:
        self.wait_for(lambda: self.status().get("step", 0) >= 10, "rank 0 to serve and pass step 10", timeout=180)

    def wait_settled(self, action_id: str, timeout: float = 30.0) -> dict[str, Any]:
        def settled() -> dict[str, Any] | None:
            return next((r for r in self.status().get("recent", []) if r["id"] == action_id), None)

        return self.wait_for(settled, f"action {action_id} to settle", timeout)

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not exit within {timeout}s\n{tail(self.log)}") from None

    def status(self) -> dict[str, Any]:
        response = requests.get(self.url + "/v1/status", headers=self.headers, timeout=5)
        assert response.status_code == 200, f"status: {response.status_code} {response.text}"
        return response.json()

    def post_action(self, action: str, reason: str = "test", **params: float) -> str:
        body: dict[str, Any] = {"action": action, "reason": reason}
        if params:
            body["params"] = params
        response = requests.post(self.url + "/v1/actions", json=body, headers=self.headers, timeout=5)
        assert response.status_code == 202, f"{action}: {response.status_code} {response.text}"
        return response.json()["id"]

    def steps(self, rank: int) -> list[dict[str, Any]]:
        """Rank's per-step log lines (a half-written last line is left out)."""
        path = self.out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def step_record(self, rank: int, step: int) -> dict[str, Any]:
        found = [r for r in self.steps(rank) if r.get("step") == step and "exit" not in r]
        assert found, f"rank {rank} logged no step {step}\n{tail(self.log)}"
        return found[0]

    def ready(self, rank: int) -> dict[str, Any]:
        return json.loads((self.out / f"rank{rank}.ready.json").read_text())

    def close(self) -> int:
        """Teardown: end the job if a test left it running; its exit status."""
        return stop_process(self.proc)


class ControlJob(ControlClient):
    """A running 2-rank control_job under torchrun, and how to talk to rank 0's endpoint."""

    def __init__(
        self,
        out: Path,
        control_port: int,
        master_port: int,
        control: dict[str, Any] | None = None,
        pg_timeout: float = 3.0,
    ) -> None:
        super().__init__(out, control_port, "control-test")
        settings = {"port": control_port, "token_file": str(self.token_file), "pause_heartbeat_seconds": 0.5}
        settings.update(control or {})
        target = ["tests/jobs/control_job.py", "--out", str(out), "--control", json.dumps(settings)]
        self.start([*target, "--pg-timeout", str(pg_timeout)], master_port)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
