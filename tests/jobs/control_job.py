"""A tiny DDP training job driven through the control channel, and its launcher for tests.

Run by torchrun (`torchrun --nproc_per_node=2 tests/jobs/control_job.py --out DIR ...`),
each rank trains a linear model with gloo, uses exporter's Monitor and
ControlChannel exactly as a user's loop would, and writes what it saw to
DIR/rank<r>.jsonl, one line per step: the step, the learning rates, the actions
the channel applied at that step's boundary and how long the boundary held the
rank. Its handler writes DIR/ckpt-rank<r>-step<s>.json. `--hang-rank R --hang-at S`
blocks rank R for ever inside step S's compute (after writing DIR/rank<R>.hung), as a
hung rank does. Nothing here imports the trainer package.

Tests use :class:`ControlJob` to start it, talk to rank 0's endpoint and read
the ranks' logs (what it shares with tests/jobs/lightning_job.py is in tests/jobs/common.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.jobs.common import ControlClient, job_parser, write_ready

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

    parser = job_parser()
    parser.add_argument("--hang-rank", type=int, default=-1, help="the rank that hangs at --hang-at")
    parser.add_argument("--hang-at", type=int, default=0, help="step inside whose compute that rank blocks for ever")
    parser.add_argument("--goodput-dir", default="", help="rank 0's goodput ledger, written only when asked to flush")
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
    ledger = {"goodput_dir": args.goodput_dir, "goodput_flush_seconds": 3600.0} if args.goodput_dir else {}
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0, probes=("host",), **ledger))
    monitor.start()
    monitor.watch(model.module, optimizer)
    control = config_from_mapping(ControlConfig, json.loads(args.control), "control")
    channel = ControlChannel(control, monitor, optimizer=optimizer, scheduler=scheduler)
    dist.set_timeout(timedelta(seconds=args.pg_timeout))  # the main group's timeout, low on purpose
    handler = _Handler(args.out, rank, monitor, optimizer)
    write_ready(args.out, rank, channel.url, monitor.port)
    generator = torch.Generator().manual_seed(rank)
    with open(args.out / f"rank{rank}.jsonl", "a", buffering=1) as log:
        for step in range(1, args.max_steps + 1):
            with monitor.step(samples=4) as ctx:
                x = torch.randn(4, 8, generator=generator)
                loss = model(x).pow(2).mean()
                loss.backward()
                time.sleep(args.step_seconds)  # stands in for real compute; keeps two shared cores usable
                if rank == args.hang_rank and step == args.hang_at:
                    _hang(args.out, rank)
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


def _hang(out: Path, rank: int) -> None:
    """Block for ever, inside the step (a signal's handler still runs here; the wait goes on after it)."""
    import threading

    (out / f"rank{rank}.hung").touch()
    threading.Event().wait()


# --- the launcher (runs in the test process) -----------------------------------------------


class ControlJob(ControlClient):
    """A running 2-rank control_job under torchrun, and how to talk to rank 0's endpoint."""

    def __init__(
        self,
        out: Path,
        control_port: int,
        master_port: int,
        control: dict[str, Any] | None = None,
        pg_timeout: float = 3.0,
        extra: list[str] | None = None,
    ) -> None:
        super().__init__(out, control_port, "control-test")
        self.start_job("tests/jobs/control_job.py", master_port, control, pg_timeout, extra=extra)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
