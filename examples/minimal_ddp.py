"""The smallest complete rankscope loop: DDP under torchrun, metrics on every rank, the control loop.

RANKSCOPE_CONTROL_TOKEN=s3cret torchrun --nproc_per_node=2 examples/minimal_ddp.py --steps 100000
curl -s -H "Authorization: Bearer s3cret" http://127.0.0.1:9300/v1/status
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from rankscope import Monitor, MonitorConfig
from rankscope.control import ControlChannel, ControlConfig, ControlStartError, record_checkpoint
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Handler:
    """The loop's side of the control loop, called on every rank at the same step boundary."""

    def __init__(self, monitor, model, optimizer, channel_state, directory):
        self.monitor, self.model, self.optimizer, self.channel_state = monitor, model, optimizer, channel_state
        self.directory, self.step, self.stop = directory, 0, False

    def checkpoint(self, reason):
        started = time.perf_counter()
        path = os.path.join(self.directory, f"step_{self.step:08d}.pt")
        if dist.get_rank() == 0:  # the model is replicated: rank 0 writes, every rank waits for the file
            state = {"step": self.step, "model": self.model.module.state_dict(), "reason": reason,
                     "optimizer": self.optimizer.state_dict(), "control": self.channel_state()}  # fmt: skip
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # atomic: a file with the final name is complete
        dist.barrier()
        record_checkpoint(self.monitor, reason, time.perf_counter() - started)  # every rank counts it
        return path  # true: written, so the action is reported "applied"

    def request_stop(self, reason):
        self.stop = True  # the loop leaves after this step and writes its last checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--metrics-port", type=int, default=9400)  # rank with local rank r: +r
    parser.add_argument("--control-port", type=int, default=9300)  # rank 0 only
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step, to watch it go")
    parser.add_argument("--linger", type=float, default=5.0, help="serve this long after the end: one last scrape")
    args = parser.parse_args()
    os.makedirs(args.checkpoint_dir, exist_ok=True)

    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=args.metrics_port))  # identity from torchrun
    monitor.start()  # serves /metrics
    dist.init_process_group("gloo")  # "nccl" on GPUs; after the Monitor, whose collective view sees it from the start
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))  # warmup
    monitor.watch(model, optimizer)  # learning rates, per-module grad norms, update ratios
    monitor.attach_comm_hook(model)  # all-reduce time
    control = ControlConfig(port=args.control_port)
    try:  # no RANKSCOPE_CONTROL_TOKEN: one line, exit 1 before the first step (docs/loop-contract.md)
        channel = ControlChannel(control, monitor, optimizer=optimizer, scheduler=scheduler)
    except ControlStartError as exc:
        raise SystemExit(f"rankscope: {exc}") from None
    handler = Handler(monitor, model, optimizer, channel.state_dict, args.checkpoint_dir)

    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < args.steps and not handler.stop:
        sampler.set_epoch(epoch)
        for inputs, targets in monitor.data(loader):  # times the wait for each batch
            with monitor.step(samples=len(inputs)) as context:  # step time, compute and comm split
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                loss.backward()
                norm = monitor.clip_grad_norm_(model.parameters(), 1.0)  # torch's clipping, bit for bit
                if context.record(loss=loss, grad_norm=norm):  # False only if the non-finite guard skips
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            step = handler.step = context.index
            channel.at_step_boundary(step, handler)  # every rank, every step: actions happen here
            time.sleep(args.sleep)
            if handler.stop or step >= args.steps:
                break
        epoch += 1
    handler.checkpoint("stop" if handler.stop else "final")
    monitor.finish()  # a clean end: the rank-down alert does not page for it
    channel.finish(linger_seconds=args.linger)  # a stop is "applied", logged on every rank, seen in /v1/status
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
