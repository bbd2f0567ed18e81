"""An FSDP2 training loop with rankscope: sharded checkpoints and every control action on every rank.

    RANKSCOPE_CONTROL_TOKEN=s3cret torchrun --nproc_per_node=2 examples/fsdp2_loop.py --max-steps 100000
    ... --resume   # go on from the newest complete checkpoint in --out

What a sharded model changes, and how this loop handles it (docs/sharded.md has the support matrix):

- `fully_shard` on every block and on the root: parameters, gradients and the norm `clip_grad_norm_`
  returns are DTensors. `monitor.clip_grad_norm_` is torch's own clip, bit for bit, and records the
  norm without any collective (the returned norm is replicated); the per-module norms and update
  ratios are of whole parameters (summed over the mesh on their due steps only).
- No DDP comm hook: `monitor.attach_comm_hook` is not called; communication time comes from the
  monitor's collective view (every all-gather and reduce-scatter FSDP2 issues).
- Checkpoints are sharded: `torch.distributed.checkpoint` (DCP) saves and loads on every rank, each
  writing its own shards; rank 0 writes `meta.json` (step, data position, micro-batch, control state)
  last, so a directory with it is complete. `rollback` loads such a checkpoint on every rank,
  `reduce_micro_batch` checkpoints then halves the micro-batch and doubles accumulation (the global
  batch stays), `reduce_lr` is applied by the channel to the optimizer (this loop never overwrites the
  rate), pause/resume are held at the step boundary, `stop` checkpoints and leaves.

`--slow-rank R --slow-seconds S`: rank R sleeps S seconds in every step's compute (a straggler, for
the end-to-end test of the straggler alert). Each rank appends one JSON line per step to
`<out>/rank<r>.jsonl`: {"step", "lr", "micro", "accum", "pos", "loss"}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rankscope import Monitor, MonitorConfig
from rankscope.control import (
    ActionUnavailable,
    ControlChannel,
    ControlConfig,
    MicroBatchChange,
    RollbackDone,
    RollbackRequest,
    record_checkpoint,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH, WIDTH = 8, 32  # samples per step per rank, hidden size


def build_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3)]
    model = nn.Sequential(nn.Linear(16, WIDTH), *blocks, nn.Linear(WIDTH, 1))
    for block in model:
        if any(True for _ in block.parameters()):
            fully_shard(block)
    fully_shard(model)
    return model


def batch(rank: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step at a data position: the same on every run, so a rollback replays it exactly."""
    generator = torch.Generator().manual_seed(1000 * position + rank)
    inputs = torch.randn(GLOBAL_BATCH, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


class Loop:
    """The loop's state and the control handler (every rank, the same calls at the same step)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, monitor: Monitor, out: Path) -> None:
        self.model, self.optimizer, self.monitor, self.out = model, optimizer, monitor, out
        self.channel: ControlChannel | None = None
        self.step = 0  # optimizer steps done
        self.position = 0  # data position of the next step (a rollback skips some)
        self.micro, self.accum = GLOBAL_BATCH, 1
        self.stop = False

    # --- sharded checkpoints (every rank) -------------------------------------------------------

    def checkpoint(self, reason: str) -> Path:
        started = time.perf_counter()
        path = self.out / f"ckpt_{self.step:08d}"
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        with self.monitor.phase("checkpoint"):
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
            dist.barrier()  # every rank's shards are written before the directory is marked complete
            if dist.get_rank() == 0:
                meta = {"step": self.step, "position": self.position, "micro": self.micro, "accum": self.accum,
                        "reason": reason, "control": self.channel.state_dict() if self.channel else {}}  # fmt: skip
                (path / "meta.tmp").write_text(json.dumps(meta))
                os.replace(path / "meta.tmp", path / "meta.json")
            dist.barrier()
        record_checkpoint(self.monitor, reason, time.perf_counter() - started)
        return path

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, in the order they were written (the last is the newest).
        Not by step: after a rollback, a checkpoint of a higher step can be from the timeline it left."""
        found = [p for p in self.out.glob("ckpt_*") if (p / "meta.json").is_file()]
        found.sort(key=lambda p: ((p / "meta.json").stat().st_mtime_ns, int(p.name.split("_")[1])))
        return [(int(p.name.split("_")[1]), p) for p in found]

    def load(self, path: Path) -> dict:
        """Load a sharded checkpoint on every rank (each reads the shards it needs)."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        meta = json.loads((path / "meta.json").read_text())
        self.step, self.position = meta["step"], meta["position"]
        self.micro, self.accum = meta["micro"], meta["accum"]
        self.monitor.set_step(self.step)
        self.monitor.set("micro_batch_size", self.micro)
        return meta

    # --- the control handler ----------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        self.stop = True

    def rollback(self, request: RollbackRequest) -> RollbackDone:
        earlier = [(step, path) for step, path in self.complete_checkpoints() if step < request.before_step]
        if not earlier:
            raise ActionUnavailable(f"no complete checkpoint before step {request.before_step}")
        step, path = earlier[-1]
        self.load(path)
        skipped = request.window(step)
        self.position += skipped  # the data trained into the incident is not seen again
        for group in self.optimizer.param_groups:
            group["lr"] *= request.lr_factor
        return RollbackDone(step, str(path), skipped, f"data positions {self.position - skipped}..{self.position - 1}")

    def reduce_micro_batch(self, reason: str) -> MicroBatchChange:
        if self.micro < 2 or self.micro % 2:
            raise ActionUnavailable(f"a micro-batch of {self.micro} cannot be halved")
        self.checkpoint(f"reduce_micro_batch:{reason}")
        previous = (self.micro, self.accum)
        self.micro, self.accum = self.micro // 2, self.accum * 2
        self.monitor.set("micro_batch_size", self.micro)
        return MicroBatchChange(self.micro, self.accum, *previous)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("out-fsdp2"))
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--metrics-port", type=int, default=9400)
    parser.add_argument("--control-port", type=int, default=9300)
    parser.add_argument("--resume", action="store_true", help="go on from the newest complete checkpoint")
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (every rank)")
    parser.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-seconds in compute")
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--linger", type=float, default=7.5, help="seconds every rank serves after the end (>1 scrape)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)

    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=args.metrics_port, module_stats_every_n_steps=5))
    monitor.start()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor.watch(model, optimizer)
    loop = Loop(model, optimizer, monitor, args.out)
    channel = ControlChannel(ControlConfig(port=args.control_port), monitor, optimizer=optimizer)
    loop.channel = channel
    if args.resume and loop.complete_checkpoints():
        meta = loop.load(loop.complete_checkpoints()[-1][1])
        channel.load_state_dict(meta["control"])
    monitor.set("micro_batch_size", loop.micro)

    log = open(args.out / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - closed at the end
    while loop.step < args.max_steps:
        inputs, targets = batch(rank, loop.position)
        with monitor.step(samples=GLOBAL_BATCH) as step:
            total = torch.zeros(())
            for micro in range(loop.accum):
                model.set_requires_gradient_sync(micro == loop.accum - 1)  # reduce-scatter once per step
                part = slice(micro * loop.micro, (micro + 1) * loop.micro)
                loss = nn.functional.mse_loss(model(inputs[part]), targets[part]) / loop.accum
                loss.backward()
                total += loss.detach()
            if rank == args.slow_rank:
                time.sleep(args.slow_seconds)  # a straggler: its compute is slow, the others wait for it
            norm = monitor.clip_grad_norm_(model.parameters(), 1.0)
            if step.record(loss=total, grad_norm=norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.step, loop.position = step.index, loop.position + 1
        lr = optimizer.param_groups[0]["lr"]
        line = {"step": loop.step, "lr": lr, "micro": loop.micro, "accum": loop.accum, "pos": loop.position - 1}
        log.write(json.dumps({**line, "loss": total.item()}) + "\n")
        channel.at_step_boundary(loop.step, loop)
        time.sleep(args.sleep)
        if loop.stop:
            break
    loop.checkpoint("stop" if loop.stop else "final")
    log.close()
    monitor.finish()
    channel.finish(linger_seconds=args.linger)  # every rank's page shows the finish to a scrape: no RankDown
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
