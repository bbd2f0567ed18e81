"""Benchmark: what the monitor costs an FSDP2 loop, and what reading the collectives costs per scrape.

    .venv/bin/python -m benchmarks.sharded                       # 2 gloo ranks, 8 groups x 10 steps per block
    .venv/bin/python -m benchmarks.sharded --groups 1 --block 2  # the smoke test's setting

Two processes (gloo, CPU, one torch thread each) train one FSDP2 model (`fully_shard` per layer and on the
root) in one long run, in blocks of `--block` steps: each group has a block plain (the loop as written without
rankscope, the view's hooks taken off the process groups), a second plain block (the A/A control: what the
machine's noise alone makes of two identical conditions) and a block monitored (`monitor.data`,
`monitor.step`, the view's hooks on, the metrics page rendered after every block like a scrape), in a fresh
random order per group, the same on both ranks (benchmarks/timing.py: interleaved blocks; group 0 warms up).
Reported on rank 0: the median of the per-group wall-time ratios monitored/plain (goal <= 1.01x, issue 22)
beside the A/A ratio plain_again/plain (a monitored ratio inside the A/A spread is no measurable cost),
the cost of the collective view's read per scrape (CollectiveView.read: on gloo, from its hooks' counts) beside
what a dump of torch's Flight Recorder costs (the read of a job with NCCL groups: the dump, its parse),
and the training thread's progress tracking per step against the plain step time (goal <= 0.5 %, issue 26).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.multiprocessing as mp

from .timing import interleaved_blocks, machine_line, ratio_line

#: "plain_again" is the A/A control: the plain loop against itself, the spread the machine alone produces.
CONDITIONS = ("plain", "plain_again", "monitored")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="groups of blocks (one block per condition each)")
    parser.add_argument("--block", type=int, default=10, help="training steps per block")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers, each its own FSDP unit")
    parser.add_argument("--width", type=int, default=256, help="layer width")
    parser.add_argument("--batch", type=int, default=32, help="samples per step per rank")
    args = parser.parse_args(argv)
    if min(args.groups, args.block, args.layers, args.width, args.batch) < 1:
        parser.error("every setting must be >= 1")
    from devstack.ports import free_port

    mp.spawn(_rank, args=(free_port(), args), nprocs=2, join=True)


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2", RANKSCOPE_RUN_ID="bench-sharded", RANKSCOPE_LOG_LEVEL="error",
    )  # fmt: skip
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from rankscope import Monitor, MonitorConfig
    from rankscope.serving.exposition import PageRenderer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    monitor = Monitor(MonitorConfig(goodput=False, probes=()))  # before the group: the view is on
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    monitor.watch_mesh(mesh)
    view = monitor.collectives
    assert view is not None, "the collective view is off"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(args.batch, args.width)
    state = {"monitored": False}

    def train() -> None:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def steps() -> Any:
        while True:
            if state["monitored"]:
                for _ in monitor.data((batch,)):
                    with monitor.step():
                        train()
            else:
                train()
            yield

    renderer = PageRenderer(monitor.registry)  # what the monitor's server renders, without its cache
    reads: list[float] = []
    dumps: list[float] = []
    renders: list[float] = []

    def switch(condition: str) -> None:
        state["monitored"] = condition == "monitored"
        if state["monitored"]:
            view.attach_groups()
        else:
            view.close()
        dist.barrier()  # both ranks switch together (outside the timing)

    def after_block(condition: str) -> None:
        if condition == "monitored":  # a scrape: the whole page, then the view's read alone, then a recorder dump
            started = time.perf_counter()
            renderer.render()
            renders.append(time.perf_counter() - started)
            view.read()
            reads.append(view.read_seconds)
            started = time.perf_counter()
            _fr_entries()
            dumps.append(time.perf_counter() - started)

    times = interleaved_blocks(steps(), CONDITIONS, switch, args.groups, args.block, after_block)
    tracking = _tracking_seconds_per_step(monitor)
    entries = len(_fr_entries())
    scrape_dumps = view.recorder_dumps  # before close(), which clears the view's counts
    monitor.close()
    dist.destroy_process_group()
    if rank != 0:
        return
    plain_step = statistics.median(times.wall["plain"]) / args.block
    print(machine_line())
    print(f"FSDP2, 2 gloo ranks, {args.layers} x Linear({args.width}), batch {args.batch}; "
          f"{args.groups} groups x {args.block} steps per block, interleaved")  # fmt: skip
    print(f"plain step (median): {plain_step * 1e3:.2f} ms")
    print(f"monitored/plain wall: {ratio_line(times.ratios('monitored', 'plain'))}  (goal <= 1.01)")
    print(f"A/A control plain_again/plain wall: {ratio_line(times.ratios('plain_again', 'plain'))}")
    print(f"monitored/plain process CPU: {times.total_ratio('monitored', 'plain', cpu=True):.3f}")
    print(f"collective view read per scrape (gloo: the hooks' counts; {scrape_dumps} recorder dumps, one per "
          f"hooking): median {statistics.median(reads) * 1e3:.3f} ms, max {max(reads) * 1e3:.3f} ms")  # fmt: skip
    print(f"Flight Recorder dump + parse ({entries} records; a read with NCCL groups): median "
          f"{statistics.median(dumps) * 1e3:.3f} ms, max {max(dumps) * 1e3:.3f} ms")  # fmt: skip
    print(f"whole page render per scrape (PageRenderer, no probes): median {statistics.median(renders) * 1e3:.3f} ms")
    print(f"progress tracking per step: {tracking * 1e6:.2f} us = {tracking / plain_step * 100:.4f} % of a plain "
          "step (goal <= 0.5 %)")  # fmt: skip


def _tracking_seconds_per_step(monitor: Any) -> float:
    """The training thread's part of progress tracking in one step: a fetch, a step's begin and end."""
    from rankscope.progress import PHASE_INDEX

    progress, data_wait, boundary = monitor.progress, PHASE_INDEX["data_wait"], PHASE_INDEX["step_boundary"]
    rounds = 20000
    started = time.perf_counter()
    for _ in range(rounds):
        progress.set(data_wait)
        progress.begin_step()
        progress.set(boundary)
    return (time.perf_counter() - started) / rounds


def _fr_entries() -> list[Any]:
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    return pickle.loads(_dump_fr_trace(includeStackTraces=False)).get("entries") or []


if __name__ == "__main__":
    main()
