"""Launching the reference trainer (`torchrun -m trainer`) from tests, and reading what it did.

A :class:`TrainerJob` runs a config (default `trainer/configs/test.yaml`) on 2
ranks with its own metrics ports on loopback, checkpoint directory and JSONL
log (all under the job's directory), control off unless a test turns it on;
`--set` overrides come after, so a test can point a second job at the first
one's checkpoints. Tests read the log (per-step losses, events),
scrape each rank's /metrics over HTTP, and may kill the whole job with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil

from tests.support import fetch, samples, stop_process, tail, torchrun, wait_for


class TrainerJob:
    """One torchrun launch of the trainer; `out` holds its log, checkpoints and output."""

    def __init__(
        self,
        out: Path,
        master_port: int,
        metrics_base_port: int,
        settings: list[str] | tuple[str, ...] = (),
        resume: str = "none",
        max_restarts: int = 0,
        nproc: int = 2,
        checkpoint_dir: Path | None = None,
        config: str = "trainer/configs/test.yaml",
    ) -> None:
        self.out = out
        self.nproc = nproc
        self.metrics_base_port = metrics_base_port
        self.log_file = out / "log.jsonl"
        self.checkpoint_dir = checkpoint_dir or out / "checkpoints"
        self.output = out / "torchrun.log"
        self.targets_file = out / "targets.json"  # Prometheus file_sd, written by rank 0
        overrides = [
            "metrics.host=127.0.0.1",
            f"metrics.base_port={metrics_base_port}",
            f"metrics.file_sd_path={self.targets_file}",
            "metrics.page_cache_seconds=0",  # tests read a page right after an event; the cache has its own tests
            "control.endpoint=false",  # no HTTP endpoint unless a test asks; SIGTERM still checkpoints
            f"checkpoint.dir={self.checkpoint_dir}",
            f"run.log_file={self.log_file}",
            "run.linger_seconds=0",  # no Prometheus scrapes these jobs; a test that scrapes sets its own
            *settings,
        ]
        # --standalone: the c10d rendezvous, as docker compose and `make demo` use. It gives every restart
        # round its own store prefix; the static one (--master_port alone) can hand a restarted rank its
        # peer's address from the attempt before.
        target = ["--standalone", "-m", "trainer", "--config", config, "--resume", resume]
        for override in overrides:
            target += ["--set", override]
        self.proc = torchrun(
            nproc, target, master_port, {"RANKSCOPE_RUN_ID": "trainer-test"}, log=self.output, max_restarts=max_restarts
        )

    # --- what the job wrote ------------------------------------------------------------------

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        """JSONL log records (of one `type` if given); a half-written last line is left out."""
        lines = self.log_file.read_text().splitlines() if self.log_file.exists() else []
        parsed = [json.loads(line) for line in lines if line.endswith("}")]
        return [r for r in parsed if kind is None or r["type"] == kind]

    def losses(self) -> dict[int, float]:
        """step -> training loss (the last record wins if a step was trained twice)."""
        return {r["step"]: r["loss"] for r in self.records("train")}

    def tail(self, lines: int = 60) -> str:
        return tail(self.output, lines)

    # --- talking to the ranks ------------------------------------------------------------------

    def metrics_url(self, rank: int) -> str:
        return f"http://127.0.0.1:{self.metrics_base_port + rank}/metrics"

    def scrape(self, rank: int) -> dict:
        """The rank's /metrics page as samples (see tests.support.samples)."""
        return samples(fetch(self.metrics_url(rank)))

    def page(self, rank: int) -> str:
        return fetch(self.metrics_url(rank))

    def wait_for(self, check: Any, what: str, timeout: float = 240.0) -> Any:
        """Poll `check` until truthy; fail at once if the job exits, with its output either way."""
        exited = object()

        def alive_check() -> Any:
            return exited if self.proc.poll() is not None else check()

        result = wait_for(alive_check, timeout, what, diagnose=self.tail)
        if result is exited:
            raise AssertionError(f"job exited with {self.proc.returncode} while waiting for {what}\n{self.tail()}")
        return result

    def wait_exit(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trainer did not exit within {timeout}s\n{self.tail()}") from None

    def rank_processes(self) -> dict[int, psutil.Process]:
        """The live rank processes (torchrun's children), by global rank (from their RANK variable)."""
        found = {}
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return {}
        for child in children:
            with contextlib.suppress(psutil.Error, KeyError, ValueError):
                found[int(child.environ()["RANK"])] = child
        return found

    def global_step(self, rank: int = 0) -> float:
        """The rank's rankscope_global_step, scraped (0 before the first step)."""
        from tests.support import sample_value

        return sample_value(self.scrape(rank), "rankscope_global_step") or 0

    # --- ending it -------------------------------------------------------------------------------

    def kill_hard(self) -> None:
        """SIGKILL torchrun, its ranks and their data workers at once, like a machine that dies."""
        try:
            parent = psutil.Process(self.proc.pid)
            family = [*parent.children(recursive=True), parent]
        except psutil.NoSuchProcess:
            return
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        psutil.wait_procs(family, timeout=30)

    def close(self) -> int:
        """Teardown: end the job if a test left it running (with its workers); its exit status."""
        if self.proc.poll() is None:
            children = psutil.Process(self.proc.pid).children(recursive=True)
            stop_process(self.proc)
            for child in children:
                if child.is_running():
                    child.kill()
        return self.proc.returncode
