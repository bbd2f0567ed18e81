"""Start-up of the reference trainer: from torchrun's launch to the first trained step, side by side with a
baseline revision.

    python -m benchmarks.startup [--baseline REV] [--trials 5] [--json FILE]

Every start of a job is training time lost: the first, and each restart after a hang, a killed rank or a
preemption (the fault campaign's loop-on arm spent 67 s of its 255 s of badput in five starts). Each trial
starts the campaign's job (2 ranks, gloo, the campaign's data) from scratch, stops it with SIGTERM (a
checkpoint, then the end) once it trains, and launches it again with ``--resume auto``, as a scheduler
does after a preemption; both times it reads the seconds from the launch to the first step's log record.
The tree this runs from and `--baseline` (a revision, run from a snapshot of its trainer and exporter) take
turns, in a fresh random order each trial, so a burst of noise hits both alike; the result is the median of
each and of the per-trial ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.campaign.arm import COMMON_SETTINGS
from benchmarks.timing import machine_line, paired_ratios, ratio_line
from devstack.jobs import REPO, TrainerJob, torchrun
from devstack.ports import free_port

#: The variant this benchmark runs from.
TREE = "this tree"
#: What a start is measured to: the first trained step (its record in the run log).
FIRST_STEP = "train"
#: Seconds a start may take before the benchmark gives up on it.
START_TIMEOUT = 300.0
SETTINGS = (
    *(s for s in COMMON_SETTINGS if not s.startswith(("control.", "run.linger_seconds"))),
    "run.max_steps=1000000",
    "run.linger_seconds=0",
    "checkpoint.every_steps=100",
)


class _Job(TrainerJob):
    """The trainer of one source tree (`source`: a directory holding its trainer/ and exporter/)."""

    def __init__(self, source: Path, *args: Any, **kwargs: Any) -> None:
        self.source = source  # before TrainerJob launches it
        super().__init__(*args, **kwargs)

    def launch(self, master_port: int, max_restarts: int) -> subprocess.Popen:
        path = f"{self.source / 'trainer'}:{self.source / 'exporter'}:{REPO}"
        return torchrun(self.nproc, ["--standalone", *self.trainer_args], master_port,
                        {"RANKSCOPE_RUN_ID": "startup-benchmark", "PYTHONPATH": path}, log=self.output,
                        max_restarts=max_restarts)  # fmt: skip


def _first_step_after(job: TrainerJob, launched: float) -> float:
    """Seconds from `launched` to the job's first trained step (its log's first step record)."""
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        if (code := job.proc.poll()) is not None:
            raise RuntimeError(f"the job exited with {code} before its first step\n{job.tail()}")
        if found := job.records(FIRST_STEP):
            return float(found[0]["time"]) - launched
        time.sleep(0.05)
    raise RuntimeError(f"no step within {START_TIMEOUT:.0f} s\n{job.tail()}")


def _start(source: Path, out: Path, checkpoints: Path, resume: str) -> tuple[TrainerJob, float]:
    out.mkdir(parents=True)
    launched = time.time()
    job = _Job(source, out, free_port(), free_port(), list(SETTINGS), resume=resume, checkpoint_dir=checkpoints)
    return job, _first_step_after(job, launched)


def _stop(job: TrainerJob) -> None:
    job.proc.send_signal(signal.SIGTERM)  # a preemption: every rank checkpoints, then the job ends
    job.wait_exit(timeout=120)  # torchrun's own status says it was signalled; the ranks' record says how they ended
    if not job.records("finished"):
        raise RuntimeError(f"the job did not checkpoint and finish on SIGTERM\n{job.tail()}")


def trial(source: Path, workdir: Path) -> dict[str, float]:
    """One first launch and one relaunch of `source`'s trainer: their seconds to the first step."""
    checkpoints = workdir / "checkpoints"
    first, first_seconds = _start(source, workdir / "first", checkpoints, "none")
    _stop(first)
    again, again_seconds = _start(source, workdir / "again", checkpoints, "auto")
    _stop(again)
    if not again.records("resume"):
        raise RuntimeError(f"the relaunch did not resume from the checkpoint\n{again.tail()}")
    return {"first": first_seconds, "relaunch": again_seconds}


def snapshot(revision: str, into: Path) -> Path:
    """The trainer and exporter of `revision`, extracted under `into`."""
    archive = subprocess.run(["git", "archive", revision, "trainer", "exporter"], cwd=REPO, capture_output=True,
                             check=True).stdout  # fmt: skip
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, capture_output=True, check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="", metavar="REV", help="a revision to compare with, side by side")
    parser.add_argument("--trials", type=int, default=5, help="trials of each variant (default 5)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be at least 1, got {args.trials}")
    with tempfile.TemporaryDirectory(prefix="rankscope-startup-") as tmp:
        variants = {TREE: REPO}
        if args.baseline:
            try:
                variants[args.baseline] = snapshot(args.baseline, Path(tmp) / "baseline")
            except subprocess.CalledProcessError as exc:
                parser.error(f"--baseline {args.baseline}: {(exc.stderr or b'').decode().strip() or 'not a revision'}")
        print(machine_line())
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for number in range(args.trials):
            for name in random.sample(list(variants), len(variants)):
                seconds = trial(variants[name], Path(tmp) / f"trial-{number}-{'tree' if name == TREE else 'base'}")
                results[name].append(seconds)
                first, again = seconds["first"], seconds["relaunch"]
                print(f"trial {number + 1} {name}: first {first:.2f} s, relaunch {again:.2f} s", flush=True)
    summary = _summary(results, args.baseline)
    print(summary["text"])
    if args.json:
        args.json.write_text(json.dumps({"results": results, "medians": summary["medians"],
                                         "ratios": summary["ratios"]}, indent=1) + "\n")  # fmt: skip
    return 0


def _summary(results: dict[str, list[dict[str, float]]], baseline: str) -> dict[str, Any]:
    medians = {name: {kind: statistics.median(r[kind] for r in runs) for kind in ("first", "relaunch")}
               for name, runs in results.items()}  # fmt: skip
    lines = [f"{'start-up (launch to first step)':36} {'first':>8} {'relaunch':>9}"]
    lines += [f"{name:36} {m['first']:7.2f}s {m['relaunch']:8.2f}s" for name, m in medians.items()]
    ratios: dict[str, list[float]] = {}
    if baseline:
        for kind in ("first", "relaunch"):
            ratios[kind] = paired_ratios([r[kind] for r in results[TREE]], [r[kind] for r in results[baseline]])
            lines.append(f"ratio {TREE} / {baseline}, {kind}: {ratio_line(ratios[kind])}")
    return {"medians": medians, "ratios": ratios, "text": "\n".join(lines)}


if __name__ == "__main__":
    sys.exit(main())
