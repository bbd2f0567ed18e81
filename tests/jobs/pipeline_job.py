"""Bit-identity and the collective view under pipeline parallelism (run by torchrun in tests/test_pipeline.py).

A small MLP (Linear blocks with dropout) is split into 2 stages, one per rank, each a
`torch.distributed.pipelining.PipelineStage` over the process group of a DeviceMesh named `pp`, and trained
with `ScheduleGPipe` (4 micro-batches) twice from the same seed: plainly (torch's clip on the stage's own
parameters, no monitor) and monitored (every optional probe on, `monitor.watch(stage_module, optimizer)`,
`monitor.watch_mesh(mesh)`, `Monitor.clip_grad_norm_` on the stage's parameters, the loss recorded on the
last stage only). Both clips give the *stage's* gradient norm, not the whole model's: a stage holds only its
own parameters, and neither torch's clip nor the monitor's reduces over the pipeline.

Each rank writes `<out>/rank<r>.json`: the differences between the two runs (empty when bit-identical), its
losses (last stage only) and norms, the monitor's error count, what its registry holds as loss, and the
collective view's series (`rankscope_collectives_total` by dim, `rankscope_collective_seconds_total` by
kind and dim) with the number of send/recv operations the stage issued.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from tests.fidelity_loops import Trace, differences, monitor_for

MICROBATCHES = 4
MAX_NORM = 0.05  # far below the gradients' norm: every step clips, so a last-bit change carries on


def _stage_module(rank: int) -> nn.Module:
    """This rank's half of the model; the whole model is built on every rank from the same seed, so the
    two halves are those of one model."""

    def block(width_in: int, width_out: int) -> nn.Module:
        return nn.Sequential(nn.Linear(width_in, width_out), nn.GELU(), nn.Dropout(0.1))  # dropout: uses the RNG

    model = nn.Sequential(block(8, 32), block(32, 32), block(32, 32), block(32, 16), nn.Linear(16, 1))
    return model[:2] if rank == 0 else model[2:]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean() * 40


def train(monitored: bool, mesh: DeviceMesh, steps: int, seed: int = 0) -> tuple[Trace, dict[str, Any]]:
    """One run of `steps` pipeline steps; the monitored run also returns what its registry holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    module = _stage_module(rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
    inputs, targets = torch.randn(steps, 16, 8), torch.randn(steps, 16, 1)
    torch.manual_seed(seed + 1 + rank)  # dropout's randomness, per stage
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=mesh.get_group("pp"))
    last = rank == world - 1
    # Every stage gets the loss function: a schedule without one runs forward only (no backward).
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
    monitor = monitor_for(rank, world) if monitored else None
    if monitor is not None:
        monitor.watch(module, optimizer)
        monitor.watch_mesh(mesh)
    trace, seen = Trace(), {}
    try:
        for step in range(steps):
            with monitor.step(samples=16) if monitor is not None else contextlib.nullcontext() as context:
                losses: list[torch.Tensor] = []
                if rank == 0:
                    schedule.step(inputs[step])
                else:
                    schedule.step(target=targets[step], losses=losses)
                loss = torch.stack(losses).mean() if last else None  # scale_grads: the micro-batches' mean
                if monitor is not None:
                    norm = monitor.clip_grad_norm_(module.parameters(), MAX_NORM)  # this stage's norm
                    # Every stage records (the non-finite guard agrees over all ranks); only the last has a loss.
                    apply = context.record(loss=loss, grad_norm=norm) if last else context.record(grad_norm=norm)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
                    apply = True
                if apply:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if loss is not None:
                trace.losses.append(float(loss.detach()))
            trace.norms.append(float(norm))
    finally:
        if monitor is not None:
            monitor.flush()
            seen = _registry(monitor)
            stats = monitor._modules  # did the clip and the module norms share their norms (the exact path)?
            seen["shared_clip"] = bool(stats is not None and stats._sharing_exact and stats._sharing_checked)
            monitor.close()
    trace.params = [p.detach().clone() for p in module.parameters()]
    return trace, seen


def _registry(monitor: Any) -> dict[str, Any]:
    labels = monitor.identity.labels()
    families = list(monitor.registry.collect())

    def values(family_name: str, sample_name: str, key: str) -> dict[str, float]:
        return {
            "/".join(sample.labels[k] for k in key.split("/")): sample.value
            for family in families
            if family.name == family_name
            for sample in family.samples
            if sample.name == sample_name
        }

    return {
        "monitor_errors": sum(values("rankscope_monitor_errors", "rankscope_monitor_errors_total", "probe").values()),
        "loss": values("rankscope_loss", "rankscope_loss", "split"),  # every loss series, any split
        "grad_norm": monitor.registry.get_sample_value("rankscope_grad_norm", labels),
        "collectives_total": values("rankscope_collectives", "rankscope_collectives_total", "dim"),
        "collective_seconds_total": values(
            "rankscope_collective_seconds", "rankscope_collective_seconds_total", "kind/dim"
        ),
        "comm_seconds_sum": monitor.registry.get_sample_value("rankscope_comm_duration_seconds_sum", labels),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    plain, _ = train(False, mesh, args.steps)
    monitored, seen = train(True, mesh, args.steps)
    result = {
        "differences": differences(plain, monitored),
        "losses": monitored.losses,
        "plain_losses": plain.losses,
        "norms": monitored.norms,
        **seen,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
