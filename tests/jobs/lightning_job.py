"""A 2-process `lightning.Trainer` DDP job with rankscope's callback, and its launcher for tests.

Run by torchrun (`torchrun --nproc_per_node=2 tests/jobs/lightning_job.py --out DIR ...`), each
process fits examples/lightning_example.py's model with the DDP strategy (gloo on CPU) and writes what
its trainer did, so tests can check every control action's effect from outside:

- DIR/rank<r>.ready.json once training runs: pid, control URL (rank 0), metrics port;
- DIR/rank<r>.jsonl, one line per optimizer step, written just before the optimizer steps: the step
  it completes, the learning rate it uses and the wall time; plus {"saved_at": step} for every
  checkpoint the trainer saved;
- DIR/rank<r>.result.json and DIR/rank<r>.metrics.txt when fit() returned: the trainer's final
  state and the rank's last metrics page.

Checkpoints go to DIR/checkpoints. Tests use :class:`LightningJob` to start it and read these files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.jobs.common import ControlClient, job_parser, write_ready
from tests.support import tail

# --- the job (runs under torchrun) ------------------------------------------------------


def _job_log_callback(out: Path, rank: int, rankscope: Any, step_seconds: float, pg_timeout: float) -> Any:
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch.distributed as dist

    class JobLog(pl.Callback):
        """Writes what the trainer did (after rankscope's callback, which comes first in the list)."""

        def __init__(self) -> None:
            self.lines = open(out / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in on_train_end

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            write_ready(out, rank, rankscope.control_url, rankscope.monitor.port)
            # Training runs (rankscope's control group exists): the training group's timeout, low on purpose.
            dist.set_timeout(timedelta(seconds=pg_timeout))

        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            time.sleep(step_seconds)  # stands in for real compute; keeps two shared cores usable

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
            record = {"step": trainer.global_step + 1, "lr": optimizer.param_groups[0]["lr"], "t": time.time()}
            self.lines.write(json.dumps(record) + "\n")

        def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
            self.lines.write(json.dumps({"saved_at": trainer.global_step}) + "\n")

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.lines.close()

    return JobLog()


def _model_parallel(regression: type) -> tuple[Any, type]:
    """Lightning's ModelParallelStrategy over the 2 ranks (data parallel only: FSDP2), and the example's model
    sharded per layer and at the root, as that strategy asks of `configure_model`."""
    from datetime import timedelta

    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    class ShardedRegression(regression):  # type: ignore[misc, valid-type]
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.encoder, self.head):
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=120))
    return strategy, ShardedRegression


def _main(argv: list[str]) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from prometheus_client import generate_latest
    from rankscope import MonitorConfig, config_from_mapping
    from rankscope.control import ControlConfig, init_restartable_process_group
    from rankscope.integrations.lightning import RankscopeCallback, newest_checkpoint

    from examples.lightning_example import Regression, build_trainer, make_loader

    parser = job_parser()
    parser.add_argument("--model-parallel", action="store_true", help="FSDP2 through Lightning's ModelParallelStrategy")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Start-up on a busy machine can be slow: a long timeout until training runs (JobLog sets the short
    # one then). Lightning's strategies use a process group that already exists; this one a restarted
    # group (the `restart` action) can start again (docs/hangs.md).
    init_restartable_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    metrics = MonitorConfig(host="127.0.0.1", base_port=0, module_stats_every_n_steps=2, probes=("host",))
    control = config_from_mapping(ControlConfig, json.loads(args.control), "control")
    rankscope = RankscopeCallback(metrics, control, checkpoint_dir=str(args.out / "checkpoints"))
    job_log = _job_log_callback(args.out, rank, rankscope, args.step_seconds, args.pg_timeout)
    strategy, model_class = None, Regression
    if args.model_parallel:
        strategy, model_class = _model_parallel(Regression)
    callbacks = [rankscope, job_log]
    trainer = build_trainer(str(args.out), args.max_steps, callbacks, strategy=strategy, use_distributed_sampler=True)
    model = model_class(learning_rate=0.05, warmup_steps=3)
    # Restarted by torchrun (the `restart` action): resume from the newest checkpoint, as docs/hangs.md says.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resume = newest_checkpoint(args.out / "checkpoints") if restarted else None
    trainer.fit(model, make_loader(4096, 8), make_loader(64, 8, seed=1, shuffle=False), ckpt_path=resume)

    result = {"global_step": trainer.global_step, "should_stop": trainer.should_stop, "status": trainer.state.status}
    (args.out / f"rank{rank}.result.json").write_text(json.dumps(result, default=str))
    (args.out / f"rank{rank}.metrics.txt").write_bytes(generate_latest(rankscope.monitor.registry))
    rankscope.close()
    dist.destroy_process_group()
    return 0


# --- the launcher (runs in the test process) -----------------------------------------------


class LightningJob(ControlClient):
    """A running 2-process lightning_job under torchrun; ControlClient's methods talk to it
    (status, post_action, wait_settled, steps, ready, close): the files it writes have the same shape."""

    def __init__(
        self,
        out: Path,
        control_port: int,
        master_port: int,
        pg_timeout: float = 4.0,
        model_parallel: bool = False,
        control: dict[str, Any] | None = None,
        max_restarts: int = 0,
    ) -> None:
        super().__init__(out, control_port, "lightning-test")
        extra = ["--model-parallel"] if model_parallel else []
        job = "tests/jobs/lightning_job.py"
        self.start_job(job, master_port, control, pg_timeout, extra=extra, max_restarts=max_restarts)

    def step_lines(self, rank: int) -> list[dict[str, Any]]:
        """The rank's per-optimizer-step lines, in order."""
        return [line for line in self.steps(rank) if "step" in line]

    def saved_at(self, rank: int) -> list[int]:
        """The steps at which the rank's trainer saved a checkpoint."""
        return [line["saved_at"] for line in self.steps(rank) if "saved_at" in line]

    def result(self, rank: int) -> dict[str, Any]:
        return json.loads((self.out / f"rank{rank}.result.json").read_text())

    def diagnose(self) -> str:
        return tail(self.log)

    def final_page(self, rank: int) -> str:
        return (self.out / f"rank{rank}.metrics.txt").read_text()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
