"""Helpers shared by tests that start real processes (torchrun, servers)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

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

    `target` is e.g. ["tests/jobs/exporter_job.py", "--flag"] or ["-m", "trainer", ...].
    Output goes to `log` (read it on failure) so a chatty job cannot fill a pipe.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra_env or {})}
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


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


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
