"""Train a tiny regression model with `lightning.Trainer` and rankscope's callback; nothing is downloaded.

    .venv/bin/python -m examples.lightning_example --root-dir /tmp/pl-run          # from the repository root
    RANKSCOPE_CONTROL_TOKEN=s3cret .venv/bin/torchrun --nproc_per_node=2 -m examples.lightning_example \\
        --root-dir /tmp/pl-run --max-steps 100000 --control

The model is a two-part MLP (`encoder`, `head`: the `module` label of the
per-module statistics) fitted to a generated linear target with noise, with
SGD and a LambdaLR warmup stepped every optimizer step. Under torchrun the
Trainer runs the DDP strategy (gloo on CPU) on the processes torchrun started:
Lightning detects torchrun's environment, so `devices` is the number of
processes per node. Every process serves /metrics on base_port + local_rank;
with `--control` global rank 0 serves the control endpoint (bearer token from
RANKSCOPE_CONTROL_TOKEN or --control-token-file), and control checkpoints go
to <root-dir>/checkpoints/rankscope-step=<step>.ckpt.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from rankscope import MonitorConfig
from rankscope.control import ControlConfig
from rankscope.integrations.lightning.callback import RankscopeCallback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 16


class Regression(pl.LightningModule):
    """y = x @ w + noise, fitted by a small MLP with SGD and a linear warmup."""

    def __init__(self, learning_rate: float = 0.05, warmup_steps: int = 3, hidden: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()  # part of rankscope_run_info's config_hash
        self.encoder = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)  # rankscope: loss{split="val"}

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)
        warmup = max(1, self.hparams.warmup_steps)
        # Warmup recomputes lr = base_lr * factor every step: rankscope's reduce_lr scales base_lr too.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_loader(size: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> DataLoader:
    """A generated, learnable data set (the same on every process; Lightning shards it per rank)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, FEATURES, generator=generator)
    w = torch.randn(FEATURES, generator=generator)
    y = x @ w + 0.1 * torch.randn(size, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=generator)


def build_trainer(
    root_dir: str,
    max_steps: int,
    callbacks: Sequence[pl.Callback],
    *,
    accumulate_grad_batches: int = 1,
    gradient_clip_val: float | None = None,
    ddp_timeout: int = 1800,
    strategy: Any = None,
    **kwargs: Any,
) -> pl.Trainer:
    """A CPU Trainer with `callbacks`, quiet (no logger, no progress bar). Under torchrun (WORLD_SIZE > 1) it uses
    the DDP strategy over torchrun's processes, with `ddp_timeout` seconds before a stuck collective fails, unless
    a `strategy` is given."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if strategy is None and world_size > 1:
        # Every parameter takes part in the forward pass: spare DDP its extra graph traversal.
        strategy = DDPStrategy(timeout=timedelta(seconds=ddp_timeout), find_unused_parameters=False)
    # Tiny in-memory data needs no loader workers; Lightning would suggest some on every run.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    return pl.Trainer(
        default_root_dir=root_dir,
        max_steps=max_steps,
        accelerator="cpu",
        devices=per_node,
        num_nodes=max(1, world_size // per_node),
        strategy=strategy if strategy is not None else "auto",
        callbacks=list(callbacks),
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_clip_val=gradient_clip_val,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root-dir", required=True, help="where Lightning and rankscope write checkpoints")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--ddp-timeout", type=int, default=1800, help="seconds before a stuck collective fails")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--base-port", type=int, default=9400, help="process with local rank r serves base+r")
    parser.add_argument("--module-stats-every", type=int, default=50, help="steps between gradient statistics")
    parser.add_argument("--control", action="store_true", help="serve the control endpoint on global rank 0")
    parser.add_argument("--control-host", default="127.0.0.1")
    parser.add_argument("--control-port", type=int, default=9300)
    parser.add_argument("--control-token-file", default="", help="default: RANKSCOPE_CONTROL_TOKEN")
    options = parser.parse_args(argv)

    torch.manual_seed(0)
    metrics = MonitorConfig(
        host=options.metrics_host, base_port=options.base_port, module_stats_every_n_steps=options.module_stats_every
    )
    control = (
        ControlConfig(host=options.control_host, port=options.control_port, token_file=options.control_token_file)
        if options.control
        else None
    )
    trainer = build_trainer(
        options.root_dir,
        options.max_steps,
        [RankscopeCallback(metrics, control)],
        accumulate_grad_batches=options.accumulate,
        ddp_timeout=options.ddp_timeout,
    )
    train, val = make_loader(4096, options.batch_size), make_loader(256, options.batch_size, seed=1, shuffle=False)
    trainer.fit(Regression(options.learning_rate), train, val)


if __name__ == "__main__":
    main()
