"""What the tests' torchrun jobs (control_job.py, lightning_job.py) share: their options, the file that says
a rank is ready, and the client the tests drive them with."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import requests

from tests.support import stop_process, tail, torchrun, wait_for

T = TypeVar("T")
_DIED = object()  # what ControlClient.wait_for's check returns once the job has exited


# --- the job's side (runs under torchrun) ---------------------------------------------------


def job_parser() -> argparse.ArgumentParser:
    """The options every job takes (ControlClient.start_job passes them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--control", default="{}", help="JSON mapping of ControlConfig settings")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--pg-timeout", type=float, required=True, help="the training group's timeout after start-up")
    return parser


def write_ready(out: Path, rank: int, control_url: str | None, metrics_port: int) -> None:
    """DIR/rank<r>.ready.json: the rank trains; its pid, rank 0's control URL and its metrics port."""
    ready = {"pid": os.getpid(), "control_url": control_url, "metrics_port": metrics_port}
    (out / f"rank{rank}.ready.json").write_text(json.dumps(ready))


# --- the tests' side -----------------------------------------------------------------------------


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
        self.http: Any = requests  # what status/post_action send with: a TLS test sets a session_for session
        self.proc: subprocess.Popen | None = None

    def start(
        self, target: list[str], master_port: int, env: dict[str, str] | None = None, max_restarts: int = 0
    ) -> None:
        """torchrun 2 ranks of `target` (a script and its arguments) with the run id and `env`."""
        env = {"RANKSCOPE_RUN_ID": self.run_id, **(env or {})}
        self.proc = torchrun(2, target, master_port, env, log=self.log, max_restarts=max_restarts)

    def start_job(
        self,
        script: str,
        master_port: int,
        control: dict[str, Any] | None,
        pg_timeout: float,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
        max_restarts: int = 0,
    ) -> None:
        """Start one of tests/jobs (`script`) with its control endpoint on this client's port and token, and the
        script's own `extra` options."""
        settings = {"port": self.control_port, "token_file": str(self.token_file), "pause_heartbeat_seconds": 0.5}
        settings.update(control or {})
        target = [script, "--out", str(self.out), "--control", json.dumps(settings), "--pg-timeout", str(pg_timeout)]
        target += extra or []
        self.start(target, master_port, env, max_restarts)

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
        response = self.http.get(self.url + "/v1/status", headers=self.headers, timeout=5)
        assert response.status_code == 200, f"status: {response.status_code} {response.text}"
        return response.json()

    def post_action(self, action: str, reason: str = "test", **params: float) -> str:
        body: dict[str, Any] = {"action": action, "reason": reason}
        if params:
            body["params"] = params
        response = self.http.post(self.url + "/v1/actions", json=body, headers=self.headers, timeout=5)
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
