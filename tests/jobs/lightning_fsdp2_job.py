"""Lightning's ModelParallelStrategy (FSDP2 over a 2-rank CPU mesh) with RankscopeCallback (run by torchrun in
tests/test_sharded_lightning.py). Each rank writes `<out>/rank<r>.json`: what its metrics registry holds after
the run, and torch's own total gradient norm of the last step (`clip_grad_norm_`'s, from the full gradients)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from rankscope import MonitorConfig
from rankscope.integrations.lightning.callback import RankscopeCallback
from torch import nn
from torch.distributed.fsdp import fully_shard


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 1)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.first, self.second):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.second(torch.tanh(self.first(inputs))), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TorchNorm(pl.Callback):
    """Torch's total norm of the full gradients before each optimizer step (after rankscope's callback)."""

    norm = 0.0

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer) -> None:  # noqa: ANN001
        grads = [p.grad.full_tensor() for p in module.parameters() if p.grad is not None]
        self.norm = torch.nn.utils.get_total_norm(grads).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    )
    config = MonitorConfig(
        host="127.0.0.1", base_port=args.metrics_port, module_stats_every_n_steps=1, resolve_every_n_steps=1
    )
    rankscope, reference = RankscopeCallback(config), TorchNorm()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=6, callbacks=[rankscope, reference], logger=False, enable_checkpointing=False,
        enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(Sharded(), torch.utils.data.DataLoader(data, batch_size=8))
    registry = rankscope.monitor.registry
    found: dict[str, object] = {"torch_norm": reference.norm}
    for family in registry.collect():
        for sample in family.samples:
            key = sample.name + "".join(
                f"|{k}={v}" for k, v in sorted(sample.labels.items()) if k in ("module", "probe")
            )
            found[key] = sample.value
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
