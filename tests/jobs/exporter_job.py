"""A minimal DDP job instrumented with the exporter's public API (run by torchrun in tests).

Rank `--slow-rank` sleeps inside its compute each step, so the test can check
that the straggler shows in per-rank compute time and the fast rank's comm time.
After `--steps` steps each rank writes `<out>/rank<r>.ready` and keeps serving
/metrics until `<out>/stop` appears (or a deadline passes).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rankscope import Monitor, MonitorConfig, write_file_sd
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-seconds", type=float, default=0.03)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=args.base_port, model_name="tiny-mlp"))
    monitor.start()
    write_file_sd(monitor, args.out / "targets.json", advertise_host="127.0.0.1")

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor.attach_comm_hook(model)
    monitor.watch(model, optimizer)
    batches = [torch.randn(32, 16) for _ in range(args.steps)]
    for batch in monitor.data(batches):
        with monitor.step(samples=32, tokens=32 * 16) as step:
            loss = model(batch).pow(2).mean()
            loss.backward()
            if rank == args.slow_rank:
                time.sleep(args.slow_seconds)  # extra "compute" before the update, after the all-reduce
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step.record(loss=loss, grad_norm=norm):
                optimizer.step()
            optimizer.zero_grad()
    monitor.flush()
    (args.out / f"rank{rank}.ready").write_text(str(monitor.port))
    deadline = time.monotonic() + 120
    while not (args.out / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
