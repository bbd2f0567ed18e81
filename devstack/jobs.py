"""Launching the reference trainer (and any script) under torchrun, and reading what it did.

Used by the tests, the benchmarks and anything else that drives a real job from outside:
`torchrun()` starts `torchrun --nproc_per_node=N` with the repository importable and its output in a
log file; :class:`TrainerJob` runs `-m rankscope_trainer` with its own ports, checkpoint directory and JSONL
log, and reads the log, scrapes the ranks and ends the job. `samples()` / `sample_value()` read a
/metrics page; `wait_for()` polls with a deadline (never a fixed sleep).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["REPO", "TrainerJob", "fetch", "sample_value", "samples", "stop_process", "tail", "torchrun", "wait_for"]

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def torchrun(
    nproc: int,
    target: Sequence[str],
    master_port: int,
    extra_env: dict | None = None,
    log: Path | None = None,
    max_restarts: int = 0,
) -> subprocess.Popen:
    """Start `torchrun --nproc_per_node=nproc` on this machine with the repo importable.

    `target` is e.g. ["examples/minimal_ddp.py", "--flag"] or ["-m", "rankscope_trainer", ...].
    Output goes to `log` (read it on failure) so a chatty job cannot fill a pipe.
    """
    # PYTHONFAULTHANDLER: a rank that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python
    # stack to the log first, so a crash in a CI run can be read from its output.
    # The caller's PYTHONPATH is kept after the repo: a run from a snapshot of the tree puts the snapshot's
    # packages there, ahead of the editable install's.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    env.update(extra_env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={master_port}",
        f"--max-restarts={max_restarts}",
        *target,
    ]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(check: Callable[[], T], timeout: float, what: str, diagnose: Callable[[], str] = lambda: "") -> T:
    """Poll `check` until it returns something truthy, or fail naming `what` plus diagnostics."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # the thing may not be up yet
            last_error = exc
        time.sleep(0.1)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error!r})\n{diagnose()}"
    )


def fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def samples(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page as {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def sample_value(page_samples: dict, name: str, **labels: str) -> float | None:
    """The one sample called `name` whose labels include `labels`."""
    found = [v for (n, ls), v in page_samples.items() if n == name and set(labels.items()) <= set(ls)]
    if len(found) > 1:
        raise AssertionError(f"{name} {labels} matches {len(found)} samples")
    return found[0] if found else None


#: Where a log says why a process died; the first of them is shown even when the tail has moved past it.
_FATAL = ("Fatal Python error", "terminate called", "Traceback (most recent call last)")


def tail(path: Path, lines: int = 60) -> str:
    """The log's last `lines` lines, preceded by the first fatal error's lines if the tail has moved past it."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    start = max(len(text) - lines, 0)
    first = next((i for i, line in enumerate(text) if any(mark in line for mark in _FATAL)), None)
    if first is None or first >= start:
        return "\n".join(text[start:])
    return "\n".join([*text[first : min(first + lines, start)], "[...]", *text[start:]])


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> int:
    """Terminate a process (and let torchrun stop its workers); kill if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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
        config: str = "trainer/rankscope_trainer/configs/test.yaml",
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
        #: The trainer's own arguments (after torchrun's).
        self.trainer_args = ["-m", "rankscope_trainer", "--config", config, "--resume", resume]
        for override in overrides:
            self.trainer_args += ["--set", override]
        self.proc = self.launch(master_port, max_restarts)

    def launch(self, master_port: int, max_restarts: int) -> subprocess.Popen:
        """Start the job (torchrun, one node); the process `proc` follows. A subclass may launch it otherwise."""
        # --standalone: the c10d rendezvous, as docker compose and `make demo` use. It gives every restart
        # round its own store prefix; the static one (--master_port alone) can hand a restarted rank its
        # peer's address from the attempt before.
        target = ["--standalone", *self.trainer_args]
        return torchrun(
            self.nproc, target, master_port, {"RANKSCOPE_RUN_ID": "trainer-test"}, log=self.output,
            max_restarts=max_restarts,
        )  # fmt: skip

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
