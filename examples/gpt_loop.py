"""A GPT-style training loop as people write it elsewhere, with rankscope added: the patterns that need care.

    RANKSCOPE_CONTROL_TOKEN=s3cret torchrun --nproc_per_node=2 examples/gpt_loop.py --max-iters 100000

What this loop does that the README's minimal one does not, and how rankscope fits each:

- a `transformers` GPT-2 (built from a small config, nothing downloaded) whose output layer shares
  its weight with the input embedding: `Monitor.clip_grad_norm_` and the module statistics count the
  shared weight once, as `model.parameters()` does (the clip is torch's, bit for bit);
- gradient accumulation with DDP's `no_sync` on every micro-batch but the last;
- a `torch.amp.GradScaler` (fp16 autocast on CUDA): `monitor.watch(..., scaler=scaler)` counts the
  overflow steps that dynamic loss scaling expects apart from non-finite losses;
- a hand-written warmup + cosine learning rate set into every param group at the top of each
  iteration: multiplying it by `channel.lr_scale` is what makes a `reduce_lr` take effect (with
  `--ignore-lr-scale` the loop overwrites it, and the action is honestly reported "overridden");
- the next batch fetched inside the step (prefetch): reported with `monitor.record_data_wait`, it
  counts as data wait without being added to the step time twice;
- `--resume CKPT`: the model, optimizer, scaler and control state come back, and `monitor.set_step`
  continues `rankscope_global_step` from the checkpoint's iteration (the step passed to
  `at_step_boundary`, which `step.index` then equals);
- the end of the run: `channel.finish(linger_seconds=...)` makes a `stop` visible as applied (see
  docs/loop-contract.md, the contract this loop follows).

Each rank appends `{"iter", "lr", "lr_scale"}` per iteration to `<out>/rank<r>.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rankscope import Monitor, MonitorConfig
from rankscope.control import ControlChannel, ControlConfig, ControlStartError, record_checkpoint
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

BLOCK, VOCAB = 32, 128
LEARNING_RATE, MIN_LR, WARMUP, DECAY = 6e-4, 6e-5, 20, 2000


def get_lr(it: int) -> float:
    """nanoGPT's schedule: linear warmup, then cosine down to MIN_LR."""
    if it < WARMUP:
        return LEARNING_RATE * (it + 1) / (WARMUP + 1)
    if it > DECAY:
        return MIN_LR
    ratio = (it - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


class Handler:
    """Checkpoint and stop as the control loop asks, on every rank at the same iteration."""

    def __init__(self, monitor: Monitor, out: Path, state: dict) -> None:
        self.monitor, self.out, self.state = monitor, out, state
        self.iter, self.stop = 0, False

    def checkpoint(self, reason: str) -> Path:
        started = time.perf_counter()
        path = self.out / f"ckpt_{self.iter:08d}.pt"
        if dist.get_rank() == 0:  # DDP replicas are identical: rank 0 writes
            snapshot = {name: part() for name, part in self.state.items()}
            torch.save({"iter": self.iter, "reason": reason, **snapshot}, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        dist.barrier()  # every rank waits for the file
        record_checkpoint(self.monitor, reason, time.perf_counter() - started)
        return path

    def request_stop(self, reason: str) -> None:
        self.stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("out-gpt"))
    parser.add_argument("--max-iters", type=int, default=200)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--metrics-port", type=int, default=9400)
    parser.add_argument("--control-port", type=int, default=9300)
    parser.add_argument("--ignore-lr-scale", action="store_true", help="overwrite reductions, as loops used to")
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per iteration")
    parser.add_argument("--resume", type=Path, help="a checkpoint this loop wrote: train on from it")
    parser.add_argument("--linger", type=float, default=7.5, help="seconds every rank serves after the end (>1 scrape)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)

    metrics = MonitorConfig(host="127.0.0.1", base_port=args.metrics_port, module_stats_every_n_steps=5)
    monitor = Monitor(dataclasses.replace(metrics, model_name="gpt2-tiny"))  # rankscope_run_info{model=...}
    monitor.start()
    torch.manual_seed(1337)
    config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2)
    model = DistributedDataParallel(GPT2LMHeadModel(config).to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler(device.type)  # fp16 needs it on CUDA; on CPU it scales fp32 all the same
    autocast = torch.autocast("cuda", dtype=torch.float16) if cuda else contextlib.nullcontext()
    monitor.watch(model, optimizer, scaler=scaler)
    monitor.attach_comm_hook(model)
    try:
        channel = ControlChannel(ControlConfig(port=args.control_port), monitor, optimizer=optimizer)
    except ControlStartError as exc:  # e.g. no RANKSCOPE_CONTROL_TOKEN: one line per rank, exit status 1
        raise SystemExit(f"rankscope: {exc}") from None
    state = {"model": model.module.state_dict, "optimizer": optimizer.state_dict, "scaler": scaler.state_dict,
             "control": channel.state_dict}  # fmt: skip
    handler = Handler(monitor, args.out, state)
    start = 0
    if args.resume is not None:
        saved = torch.load(args.resume, map_location=device, weights_only=False)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
        channel.load_state_dict(saved["control"])
        start = handler.iter = saved["iter"]
        monitor.set_step(start)  # rankscope_global_step goes on from the checkpoint, as /v1/status does

    generator = torch.Generator().manual_seed(rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, VOCAB, (8, BLOCK + 1), generator=generator)
        return data[:, :-1].to(device), data[:, 1:].to(device)

    x, y = get_batch()
    log = open(args.out / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - closed at the end
    for it in range(start, args.max_iters):
        lr = get_lr(it) * (1.0 if args.ignore_lr_scale else channel.lr_scale)  # honour reductions
        for group in optimizer.param_groups:
            group["lr"] = lr
        with monitor.step(samples=8 * args.accumulation, tokens=8 * BLOCK * args.accumulation) as step:
            total = torch.zeros((), device=device)
            for micro in range(args.accumulation):
                last = micro == args.accumulation - 1
                with contextlib.nullcontext() if last else model.no_sync(), autocast:
                    loss = model(input_ids=x, labels=y).loss / args.accumulation
                fetch = time.perf_counter()
                x, y = get_batch()  # prefetch the next micro-batch while the device works
                monitor.record_data_wait(time.perf_counter() - fetch)
                scaler.scale(loss).backward()
                total += loss.detach()
            scaler.unscale_(optimizer)
            norm = monitor.clip_grad_norm_(model.parameters(), 1.0)
            if step.record(loss=total, grad_norm=norm):  # False only when skip_nonfinite skips the step
                scaler.step(optimizer)  # skips by itself a step whose gradients overflowed
            scaler.update()  # always: it backs the scale off after an overflow
            optimizer.zero_grad(set_to_none=True)
        log.write(json.dumps({"iter": step.index, "lr": lr, "lr_scale": channel.lr_scale}) + "\n")
        handler.iter = step.index
        channel.at_step_boundary(step.index, handler)
        time.sleep(args.sleep)
        if handler.stop:
            break
    handler.checkpoint("stop" if handler.stop else "final")
    log.close()
    monitor.finish()
    channel.finish(linger_seconds=args.linger)  # a stop is applied and seen; /metrics serves meanwhile too
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
