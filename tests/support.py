"""Helpers shared by tests that start real processes (torchrun, servers).

Launching jobs and servers is not test code: it lives in `devstack.jobs` (torchrun, the trainer job,
reading pages), `devstack.monitoring` (Prometheus, Alertmanager) and `devstack.ports`, which the demo
and the benchmarks use too; this module re-exports them for the tests and adds what only tests need.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from devstack.jobs import REPO, fetch, sample_value, samples, stop_process, tail, torchrun, wait_for
from devstack.monitoring import INSTALL_HINT, Server, start_alertmanager, start_prometheus, unix_time
from devstack.ports import free_port, free_port_block
from devstack.processes import Children, StackError, find_binary
from devstack.webhook import Delivery, WebhookSink

J = TypeVar("J")

__all__ = [
    "REPO",
    "Delivery",
    "Server",
    "WebhookSink",
    "binary",
    "closing_starter",
    "contract_families",
    "contract_violations",
    "fetch",
    "free_port",
    "free_port_block",
    "promtool_problems",
    "running_alertmanager",
    "sample_value",
    "samples",
    "start_alertmanager",
    "start_prometheus",
    "stop_process",
    "tail",
    "torchrun",
    "unix_time",
    "wait_for",
]


def closing_starter(make: Callable[..., J]) -> Iterator[Callable[..., J]]:
    """The body of a fixture that hands out a starter: yields `make`, remembering everything it started,
    and closes each at teardown (`yield from closing_starter(make)`)."""
    started: list[J] = []

    def start(*args: Any, **kwargs: Any) -> J:
        started.append(make(*args, **kwargs))
        return started[-1]

    yield start
    for thing in started:
        thing.close()  # type: ignore[attr-defined]


def promtool_problems(page: str) -> str:
    """What `promtool check metrics` says about a /metrics page ("" when it is clean)."""
    result = subprocess.run([binary("promtool"), "check", "metrics"], input=page, capture_output=True, text=True)
    said = result.stdout + result.stderr
    return "" if result.returncode == 0 and not said.strip() else said


def _contract_series() -> dict[str, object]:
    """Sample name -> spec of the contract or of the reference trainer's own metrics (it declares them
    beside the contract), including the `_created` series prometheus_client adds to counters and histograms."""
    from rankscope import METRICS, MetricKind
    from rankscope_trainer.metrics import TRAINER_METRICS

    specs = [*METRICS.values(), *TRAINER_METRICS]
    names = {name: spec for spec in specs for name in spec.series_names}
    for spec in specs:
        if spec.kind in (MetricKind.COUNTER, MetricKind.HISTOGRAM):
            names[spec.client_name + "_created"] = spec
    return names


def contract_violations(page: str) -> list[str]:
    """Every rankscope series of a /metrics page whose name or labels differ from rankscope.contract."""
    by_series = _contract_series()
    problems = []
    for name, labels in samples(page):
        if not name.startswith("rankscope_"):
            continue
        spec = by_series.get(name)
        if spec is None:
            problems.append(f"{name} is not in the contract")
            continue
        # An info metric's labels are its info keys; a histogram bucket adds `le`.
        expected = set(spec.all_labels + (("le",) if name.endswith("_bucket") else ()))
        if {key for key, _ in labels} != expected:
            problems.append(f"{name} has labels {sorted(k for k, _ in labels)}, contract says {sorted(expected)}")
    return problems


def contract_families(page: str) -> set[str]:
    """The contract metrics (full names) that have at least one series on a /metrics page."""
    by_series = _contract_series()
    return {by_series[name].name for name, _ in samples(page) if name in by_series}


# --- real Prometheus / Alertmanager servers and a webhook sink ------------------------------------
# The local stack's own launchers (devstack.monitoring): each server in its own session, waited for on
# /-/ready, stopped with its process group.


def binary(name: str) -> str:
    """Path of a system binary; fails the test (never skips) when it is missing."""
    import pytest

    try:
        return find_binary(name, INSTALL_HINT)
    except StackError as exc:
        pytest.fail(f"{exc} (scripts/bootstrap.sh installs every server the tests need)")


@contextlib.contextmanager
def running_alertmanager(config: Path, workdir: Path, port: int) -> Iterator[str]:
    """A real Alertmanager for the duration of a `with` block; yields its URL."""
    children = Children()
    try:
        yield start_alertmanager(children, config, workdir, port).url
    finally:
        children.stop_all({})


def hold_paused(
    both: Callable[[str], tuple[float | None, float | None]], step: float, seconds: float, diagnose: Callable[[], str]
) -> None:
    """Watch a 2-rank job for `seconds`: both ranks must stay paused at `step` the whole time.

    `both(name)` reads a metric's value on rank 0 and rank 1. A state that must hold over a span of time is
    observed over that span (the pause outliving the process group's timeout is what is tested)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert both("rankscope_paused") == (1, 1), diagnose()
        assert both("rankscope_global_step") == (step, step), diagnose()
        time.sleep(0.5)


def trainer_monitor() -> Any:
    """A rank-0 Monitor with the reference trainer's own metrics, its own registry, no server and no probes."""
    from prometheus_client import CollectorRegistry
    from rankscope import Monitor, MonitorConfig, RankIdentity
    from rankscope_trainer.metrics import TRAINER_METRICS

    identity = RankIdentity("test", 0, 0, 1, "host")
    config = MonitorConfig(base_port=0, probes=())
    return Monitor(config, identity, device="cpu", registry=CollectorRegistry(), extra_metrics=TRAINER_METRICS)


def records_after_last(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The run-log records written after the last one of type `kind` (e.g. the training after a rollback)."""
    last = max(i for i, record in enumerate(records) if record["type"] == kind)
    return records[last + 1 :]


def replay_rollback(
    trainer_job: Callable[..., Any],
    job: Any,
    workdir: Path,
    end: int,
    settings: list[str],
    from_step: int | None = None,
) -> None:
    """Resume a copy of `job`'s checkpoint directory from the checkpoint its last rollback loaded (or from the one
    at `from_step`, before it), train to step `end` with `settings`, and require the very losses `job` trained:
    the skip record (skips-<lineage>.json) makes the resumed run skip the same window from the same state."""
    import shutil

    from rankscope_trainer.checkpoint import checkpoint_files

    records = job.records()
    rollback = [r for r in records if r["type"] == "rollback"][-1]
    restored = rollback["step"]
    before = {r["step"]: r["loss"] for r in records[: records.index(rollback)] if r["type"] == "train"}
    after = {r["step"]: r["loss"] for r in records_after_last(records, "skip") if r["type"] == "train"}
    assert max(after) >= end, f"the job trained only to step {max(after)} after its rollback, not {end}"
    start = restored if from_step is None else from_step
    copy = workdir / f"replay-from-{start}"
    shutil.copytree(job.checkpoint_dir, copy)
    (resume_from,) = [f.path for f in checkpoint_files(copy) if f.step == start]
    replay = trainer_job(f"replay-{start}", [*settings, f"run.max_steps={end}"], resume=str(resume_from),
                         checkpoint_dir=copy)  # fmt: skip
    assert replay.wait_exit(timeout=600) == 0, replay.tail()
    assert [r["batches"] for r in replay.records("skip")] == [job.records("skip")[-1]["batches"]]
    expected = {step: before[step] for step in range(start + 1, restored + 1)}
    expected.update({step: after[step] for step in range(restored + 1, end + 1)})
    assert replay.losses() == expected
