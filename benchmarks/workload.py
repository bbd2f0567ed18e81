"""The reference trainer's step, with each way of monitoring it, for the overhead and scrape benchmarks.

    work = Workload.build(steps=50)                # trainer/rankscope_trainer/configs/demo.yaml's model, seed and data
    variant = VARIANTS["rankscope default"]
    run = variant.prepare(work)                    # fresh model (same initial weights), optimizer, monitor
    seconds = run.train()                          # wall time of `steps` steps on the same batches

Everything comes from the trainer's public pieces (`rankscope_trainer.config`, `rankscope_trainer.data`,
`rankscope_trainer.model`, `rankscope_trainer.stats`), so the step here is the trainer's `train_step`
minus its own logging and control loop. Batches are rendered once up front and
replayed, so every variant trains on exactly the same data and no DataLoader
worker competes for the CPU. The model is wrapped in DistributedDataParallel on
a one-rank gloo group (a file store, no network), as under torchrun, so the
monitor's comm hook times a real all-reduce.

The variants:

- ``none``: no monitoring at all.
- ``none again``: the same as ``none``, a second copy: its ratio to ``none``
  shows how finely the benchmark can tell two variants apart (an A/A test).
- ``rankscope default``: the exporter at `MonitorConfig()` defaults, used as the
  module docstring of `rankscope.monitor` shows (comm hook, data wait, step time,
  loss and grad norm, learning rates, module norms every 50 steps).
- ``rankscope trainer``: what `trainer/rankscope_trainer/configs/demo.yaml` runs: the default plus the
  trainer's own accuracy every step, multimodal data and model statistics every
  10 steps (`run.stats_every`), module norms every 10 and the non-finite guard.
- ``exporter all on``: the exporter's own optional work at every step: module
  norms and update ratios, device values resolved every step, the non-finite
  guard (no trainer statistics).
- ``rankscope all on``: issue 8's variant (c), every optional probe on: module grad
  norms and update ratios at every step, device values resolved every step,
  the non-finite guard, and the trainer's multimodal statistics and accuracy
  (statistics at demo.yaml's interval, every 10 steps).
- ``all on, every step``: a stress case beyond (c): the same with the multimodal
  statistics (text lengths, padding, image sizes and channel statistics, fusion
  gate, temperature, attention entropy read from the training forward) at
  every step too.
- ``hand-written``: the style of many tutorials: `psutil` calls, `.item()` on the
  loss and on every parameter's gradient norm, TensorBoard `SummaryWriter`
  scalars and a gradient histogram per parameter, every step.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope_trainer.config import TrainConfig, load_config
from rankscope_trainer.data import Batch, build_data
from rankscope_trainer.loop import warmup_cosine
from rankscope_trainer.metrics import TRAINER_METRICS
from rankscope_trainer.model import DualEncoder, build_model, contrastive_accuracy, contrastive_loss
from rankscope_trainer.stats import record_accuracy, record_batch_stats, record_model_stats
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["VARIANTS", "Run", "Variant", "Workload", "ensure_process_group", "variants"]

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "trainer" / "rankscope_trainer" / "configs" / "demo.yaml"


def ensure_process_group() -> None:
    """A one-rank gloo group through a file store (loopback only, no port), as DDP needs one."""
    if dist.is_initialized():
        return
    handle, path = tempfile.mkstemp(prefix="rankscope-bench-store-")
    os.close(handle)
    os.unlink(path)  # FileStore creates it
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


@dataclass
class Workload:
    """The demo config's model and optimizer settings and a fixed list of its training batches."""

    cfg: TrainConfig
    batches: list[Batch]
    vocab_size: int
    max_length: int
    pad_id: int

    @classmethod
    def build(cls, steps: int, config: Path = DEMO_CONFIG, overrides: tuple[str, ...] = ()) -> Workload:
        cfg = load_config(config, overrides=["data.num_workers=0", *overrides])
        data = build_data(cfg.data, cfg.model.image_size, cfg.run.seed, rank=0, world_size=1)
        data.sampler.set_position(0, 0, cfg.data.batch_size)  # start sample 0; steps of one micro-batch
        batches: list[Batch] = []
        while len(batches) < steps:  # several epochs if the data set is small
            for batch in data.train_loader:
                batches.append(batch)
                if len(batches) == steps:
                    break
        tok = data.tokenizer
        return cls(cfg, batches, tok.vocab_size, tok.max_length, tok.pad_id)

    def new_model(self) -> tuple[DualEncoder, DistributedDataParallel, torch.optim.Optimizer, LambdaLR]:
        """The same initial weights every time (seeded), wrapped in DDP, with AdamW and the trainer's schedule."""
        torch.manual_seed(self.cfg.run.seed)
        model = build_model(self.cfg.model, self.vocab_size, self.max_length, self.pad_id)
        ddp = DistributedDataParallel(model)
        optim = self.cfg.optim
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
        total = optim.decay_steps or self.cfg.run.max_steps
        scheduler = LambdaLR(optimizer, warmup_cosine(optim.warmup_steps, total, optim.min_lr_ratio))
        return model, ddp, optimizer, scheduler


@dataclass
class Run:
    """One prepared trial: iterate `steps()` (one item per training step) or call `train()`, once."""

    work: Workload
    model: DualEncoder
    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loop: Callable[[Run], Iterator[None]]
    monitor: Monitor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def steps(self) -> Iterator[None]:
        """Each `next()` trains one step; the last one also resolves what the monitor still defers."""
        yield from self.loop(self)
        if self.monitor is not None:
            self.monitor.flush()  # values still deferred are part of the cost

    def train(self) -> float:
        """Seconds for all the workload's steps (periodic costs included)."""
        started = time.perf_counter()
        for _ in self.steps():
            pass
        return time.perf_counter() - started

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.ddp(batch.images, batch.input_ids, batch.attention_mask)
        return logits, contrastive_loss(logits)

    def clip(self) -> torch.Tensor:
        """As the trainer clips: through the monitor when there is one (it shares the norms it computes)."""
        max_norm = self.work.cfg.optim.grad_clip or float("inf")
        if self.monitor is not None:
            return self.monitor.clip_grad_norm_(self.ddp.parameters(), max_norm)
        return torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), max_norm)

    def update(self, apply: bool = True) -> None:
        if apply:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()


# --- the loops (generators: one item per step, so a driver can run several side by side) ----------


def _loop_none(run: Run) -> Iterator[None]:
    for batch in run.work.batches:
        _, loss = run.forward_loss(batch)
        loss.backward()
        run.clip()
        run.update()
        yield


def _monitored_loop(stats_every: int | None, accuracy: bool) -> Callable[[Run], Iterator[None]]:
    """The trainer's train_step through the exporter's public API; trainer statistics every `stats_every`
    steps (None: the config's `run.stats_every`, 0: never)."""

    def loop(run: Run) -> Iterator[None]:
        monitor = run.monitor
        assert monitor is not None
        every = run.work.cfg.run.stats_every if stats_every is None else stats_every
        for batch in monitor.data(run.work.batches):
            with monitor.step(samples=len(batch), tokens=batch.tokens) as step:
                due = every and step.index % every == 0
                # As the trainer does: on statistics steps, attention entropy comes from the training forward.
                recording = run.model.recording_attention_entropy(batch.attention_mask) if due else nullcontext()
                with recording as attention:
                    logits, loss = run.forward_loss(batch)
                loss.backward()
                norm = run.clip()
                run.update(step.record(loss=loss, grad_norm=norm))
            if accuracy:
                record_accuracy(monitor, contrastive_accuracy(logits.detach()), split="train")
            if due:
                record_batch_stats(monitor, batch, batch.images)
                record_model_stats(monitor, run.model, batch, attention.value())
            yield

    return loop


def _loop_hand_written(run: Run) -> Iterator[None]:
    """What tutorials show: numbers pulled to the host and written to TensorBoard every step."""
    writer = run.extras["writer"]
    process = psutil.Process()
    for batch in run.work.batches:
        step = run.extras["step"] = run.extras["step"] + 1
        logits, loss = run.forward_loss(batch)
        loss.backward()
        total = run.clip()
        writer.add_scalar("train/loss", loss.item(), step)
        writer.add_scalar("train/grad_norm", total.item(), step)
        writer.add_scalar("train/lr", run.optimizer.param_groups[0]["lr"], step)
        for name, param in run.model.named_parameters():
            if param.grad is not None:
                writer.add_scalar(f"grad_norm/{name}", param.grad.norm().item(), step)
                writer.add_histogram(f"grad/{name}", param.grad, step)
        writer.add_scalar("system/rss_bytes", process.memory_info().rss, step)
        writer.add_scalar("system/cpu_percent", psutil.cpu_percent(), step)
        writer.add_scalar("system/memory_percent", psutil.virtual_memory().percent, step)
        run.update()
        # The writer's thread would otherwise write this step's events during the next variant's
        # step (variants run side by side): charge the writing to this step.
        writer.flush()
        yield


# --- variants -----------------------------------------------------------------------------


@dataclass
class Variant:
    """How one way of monitoring is set up; `prepare` gives a fresh trial, `close` releases what it holds."""

    name: str
    description: str
    loop: Callable[[Run], Iterator[None]]
    monitor_config: Callable[[Workload], MonitorConfig] | None = None
    hand_written: bool = False
    _monitor: Monitor | None = field(default=None, repr=False)
    _writer: Any = field(default=None, repr=False)
    _tmp: Any = field(default=None, repr=False)

    def prepare(self, work: Workload) -> Run:
        model, ddp, optimizer, scheduler = work.new_model()
        run = Run(work, model, ddp, optimizer, scheduler, self.loop)
        if self.monitor_config is not None:
            run.monitor = self.monitor(work)
            run.monitor.watch(ddp, optimizer)
            run.monitor.attach_comm_hook(ddp)
        if self.hand_written:
            run.extras = {"writer": self.writer(), "step": 0}
        return run

    def monitor(self, work: Workload) -> Monitor:
        """This variant's Monitor, created and started (served on a free loopback port) once."""
        if self._monitor is None:
            assert self.monitor_config is not None
            identity = RankIdentity(run_id="bench", rank=0, local_rank=0, world_size=1, node="bench")
            # The trainer's own metrics (its statistics) are declared in trainer/, as any loop declares its own.
            self._monitor = Monitor(self.monitor_config(work), identity, device="cpu", extra_metrics=TRAINER_METRICS)
            self._monitor.start()  # served as in a real run; scraped only where a benchmark says so
        return self._monitor

    def writer(self) -> Any:
        if self._writer is None:
            from rankscope._lazy import require

            require("bench", "tensorboard")  # the hand-written variant logs as tutorials do: one line if missing
            from torch.utils.tensorboard import SummaryWriter

            self._tmp = tempfile.TemporaryDirectory(prefix="rankscope-bench-tb-")
            self._writer = SummaryWriter(self._tmp.name)
        return self._writer

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._writer is not None:
            self._writer.close()
            self._tmp.cleanup()
            self._writer = None


def _default_config(work: Workload) -> MonitorConfig:
    return MonitorConfig(host="127.0.0.1", base_port=0)


def _trainer_config(work: Workload) -> MonitorConfig:
    # The demo config's metrics section, on a free loopback port.
    return replace(work.cfg.metrics, host="127.0.0.1", base_port=0)


def _all_on_config(work: Workload) -> MonitorConfig:
    return MonitorConfig(
        host="127.0.0.1", base_port=0, module_stats_every_n_steps=1, resolve_every_n_steps=1, skip_nonfinite=True
    )


def variants() -> dict[str, Variant]:
    """Fresh Variant objects (each holds its own monitor or writer once prepared)."""
    return {
        v.name: v
        for v in (
            Variant("none", "no monitoring", _loop_none),
            Variant("none again", "a second copy of none: the measurement's own noise (A/A)", _loop_none),
            Variant(
                "rankscope default",
                "MonitorConfig() defaults: module norms every 50 steps",
                _monitored_loop(0, accuracy=False),
                _default_config,
            ),
            Variant(
                "rankscope trainer",
                "demo.yaml: + accuracy every step, multimodal stats and module norms every 10, NaN guard",
                _monitored_loop(None, accuracy=True),
                _trainer_config,
            ),
            Variant(
                "exporter all on",
                "the exporter's optional work every step: module norms, update ratios, NaN guard",
                _monitored_loop(0, accuracy=False),
                _all_on_config,
            ),
            Variant(
                "rankscope all on",
                "(c): module norms + update ratios every step, resolve every step, NaN guard, stats every 10",
                _monitored_loop(None, accuracy=True),
                _all_on_config,
            ),
            Variant(
                "all on, every step",
                "(c) with the multimodal statistics at every step too",
                _monitored_loop(1, accuracy=True),
                _all_on_config,
            ),
            Variant(
                "hand-written",
                "psutil + .item() per parameter + TensorBoard scalars/histograms",
                _loop_hand_written,
                hand_written=True,
            ),
        )
    }


VARIANTS = tuple(variants())
