"""PyTorch Lightning integration: rankscope's metrics and control loop in one callback.

    from rankscope.integrations.lightning.callback import RankscopeCallback

    trainer = lightning.Trainer(callbacks=[RankscopeCallback()], strategy="ddp", ...)
    trainer.fit(model, train_loader)

Every process of a `torchrun` job (or of Lightning's own launcher) serves its
own /metrics on base_port + local_rank, labelled with its own rank: the identity
(rank, local_rank, world_size, node_rank) is the trainer's, not the
environment's, since Lightning's launcher sets no RANK for the processes it
starts. Importing
this module imports `lightning.pytorch` (or, without it, the standalone
`pytorch_lightning`); `import exporter` alone never does.

One rankscope step is one optimizer step: with `accumulate_grad_batches=k`
the k micro-batches of a step are one step. Where each signal comes from
(Lightning hooks, in the order Lightning calls them):

- step_duration_seconds: the data wait before the step's first micro-batch
  plus on_train_batch_start of that micro-batch to on_train_batch_end of the
  batch after which the optimizer stepped: forward and backward of every
  micro-batch, the all-reduce, clipping, the optimizer and scheduler step.
- data_wait_seconds: from the end of the previous step (this callback's
  on_train_batch_end, or the end of a validation run, or the start of an
  epoch) to on_train_batch_start: the data fetch, moving the batch to the
  device, Lightning's per-batch SIGTERM broadcast under DDP, logging, and what
  callbacks after this one do in on_train_batch_end (e.g. ModelCheckpoint
  writing an interval checkpoint: Lightning has no hook after a save).
  With gradient accumulation only the fetch before the step's first
  micro-batch is data wait; the later micro-batches' fetches happen inside
  the step and count in its compute time.
- comm_duration_seconds / compute_duration_seconds: a DDP comm hook on
  `trainer.strategy.model` (the public attribute holding the
  DistributedDataParallel wrapper under the DDP strategies), registered in
  on_train_start, before the first backward. Other strategies (FSDP,
  ModelParallelStrategy, DeepSpeed) have no DDP wrapper: the monitor's
  collective view times their collectives instead (docs/collectives.md;
  tested under ModelParallelStrategy in tests/test_sharded_lightning.py).
- loss: what training_step returned (Lightning hands it to on_train_batch_end
  as a detached tensor already divided by accumulate_grad_batches, so the sum
  over a step's micro-batches is their mean). Kept as a tensor: no sync.
- grad_norm: Lightning does not expose the norm it computes when clipping
  (its precision plugin discards it), so on the steps where module statistics
  are due (`module_stats_every_n_steps`) the total 2-norm of the optimizer's
  gradients is computed in on_before_optimizer_step, i.e. after the
  all-reduce and AMP unscaling and before any clipping: the value
  `clip_grad_norm_` would return. Read-only: the gradients are never changed.
- learning_rate, module_grad_norm, update_ratio: Monitor.watch() on the
  LightningModule and the first optimizer of `trainer.optimizers`.
- samples_total: the batch's first tensor's first dimension, per micro-batch
  (or `count_samples(batch)`); tokens_total: `count_tokens(batch)` if given.
- loss{split="val"}: `trainer.callback_metrics[val_loss_key]` after each
  validation run (what the LightningModule logged with self.log).
- memory, host and GPU probes: sampled at scrape time by the Monitor.
- rankscope_run_info: model = the LightningModule's class, config_hash =
  :func:`config_hash` of the Trainer settings, hyperparameters and optimizer.

Control (opt in with `control=ControlConfig(...)`): the endpoint runs on
global rank 0; when it cannot start (no RANKSCOPE_CONTROL_TOKEN, the port
taken) the run stops before its first step with one line per rank and exit
status 1, since a run that was asked for control should not train without it
(leave `control` None to train without the endpoint); after every optimizer step, in on_train_batch_end, all ranks
take the same actions at the same step: checkpoint -> `trainer.save_checkpoint`
(collective: every rank calls it, rank 0 writes, then a barrier) into
`checkpoint_dir`; stop -> the same, then `trainer.should_stop = True`
(Lightning leaves its loop after this step, on every rank); reduce_lr -> the
optimizer's param groups and its LR scheduler's base LRs; pause/resume ->
every process waits inside on_train_batch_end, where no training collective
is in flight, while the channel's heartbeat keeps its own collectives short.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package has the same API
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]  # the same API under its standalone name
    except ImportError:
        raise ImportError(
            "rankscope.integrations.lightning.callback needs PyTorch Lightning: pip install 'rankscope[lightning]'"
        ) from None

from rankscope import create_monitor
from rankscope._log import set_log_rank
from rankscope.config import MonitorConfig
from rankscope.control import ControlChannel, ControlConfig, ControlStartError, record_checkpoint
from rankscope.identity import RankIdentity
from rankscope.integrations.common import CallbackParts, setup_hash
from rankscope.monitor import StepContext

__all__ = ["RankscopeCallback", "config_hash"]

logger = logging.getLogger("rankscope")

#: Trainer settings that change what the optimisation does; part of rankscope_run_info's config_hash.
HASHED_SETTINGS: tuple[str, ...] = (
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "precision",
    "max_steps",
    "max_epochs",
    "world_size",
)

Batch = Any
SampleCounter = Callable[[Batch], int]
TokenCounter = Callable[[Batch], "int | torch.Tensor"]


class RankscopeCallback(CallbackParts, pl.Callback):
    """Per-rank metrics (and, optionally, the control endpoint) for a `lightning.Trainer` run."""

    _probe = "lightning_callback"
    _what = "Lightning callback"

    def __init__(
        self,
        metrics: MonitorConfig | None = None,
        control: ControlConfig | None = None,
        *,
        checkpoint_dir: str | None = None,
        count_samples: SampleCounter | None = None,
        count_tokens: TokenCounter | None = None,
        val_loss_key: str = "val_loss",
    ) -> None:
        """`metrics`: the monitor's settings (model_name and config_hash are filled in from the run when
        left empty). `control`: the control channel's settings; None runs no control endpoint.
        `checkpoint_dir`: where control checkpoints go (default: the ModelCheckpoint's directory, else
        <default_root_dir>/checkpoints). `count_samples(batch)` / `count_tokens(batch)`: per micro-batch
        counts (default samples: the first tensor's first dimension; tokens: not counted); a token count
        may be a device tensor (read lazily). `val_loss_key`: the logged metric that is the validation loss."""
        super().__init__()
        self.metrics = metrics or MonitorConfig()
        if self.metrics.skip_nonfinite:
            raise ValueError(
                "metrics.skip_nonfinite is not supported with the Lightning callback: Lightning steps the "
                "optimizer itself (return None from training_step to skip a batch, or use your own loop)"
            )
        self.control = control
        self.checkpoint_dir = checkpoint_dir
        self.count_samples = count_samples or _batch_size
        self.count_tokens = count_tokens
        self.val_loss_key = val_loss_key
        self._init_parts()
        self._step_scope = ExitStack()
        self._step: StepContext | None = None
        self._loss: torch.Tensor | float | None = None
        self._grad_norm: torch.Tensor | None = None
        self._samples = 0
        self._tokens: int | torch.Tensor = 0
        self._boundary_step = 0
        self._mark: float | None = None
        self._comm_attached: Any | None = None

    def save_checkpoint(self, trainer: pl.Trainer, reason: str) -> str | None:
        """Write `<checkpoint_dir>/rankscope-step=<global_step>.ckpt` with Lightning's own
        `trainer.save_checkpoint` and count it; the path, or None when rank 0 finds no file afterwards.

        Collective, like `trainer.save_checkpoint`: every rank calls it, global rank 0 writes, and a
        barrier makes every rank return once the write is done. An error while saving propagates.
        """
        path = os.path.join(self._checkpoint_dir(trainer), f"rankscope-step={trainer.global_step}.ckpt")
        started = time.perf_counter()
        trainer.save_checkpoint(path, weights_only=False)  # everything needed to resume
        seconds = time.perf_counter() - started
        # Only rank 0 writes (and may be the only one to see the file without a shared file system).
        if trainer.is_global_zero and not os.path.exists(path):
            logger.warning("rankscope: checkpoint %s was not written (trainer.save_checkpoint returned)", path)
            return None
        with self._guard():
            record_checkpoint(self.monitor, reason, seconds)
        return path

    # --- Lightning hooks -----------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if self.monitor is None:
            config = dataclasses.replace(
                self.metrics,
                model_name=self.metrics.model_name or type(pl_module).__name__,
                config_hash=self.metrics.config_hash or config_hash(trainer, pl_module),
            )
            # Lightning knows who this process is; its own launcher sets no RANK for the processes it starts.
            set_log_rank(trainer.global_rank)
            self.monitor = create_monitor(config, device=trainer.strategy.root_device, identity=_identity_of(trainer))
            self.monitor.start()
            # Error counters exist at 0 from the first scrape, so increase() sees the first failure.
            for probe in (self._probe, "comm_hook"):
                self.monitor.inc("monitor_errors_total", 0, probe=probe)
        with self._guard():
            self.monitor.watch(pl_module, optimizer)
            self._attach_comm_hook(trainer)
        self.monitor.set_step(trainer.global_step)  # resumed runs continue their count
        self._boundary_step = trainer.global_step
        if self.control is not None and self.channel is None:
            # Collective: every process reaches on_train_start, after Lightning set up the process group.
            try:
                self.channel = ControlChannel(
                    self.control, self.monitor, optimizer=optimizer, scheduler=_scheduler_of(trainer, optimizer)
                )
            except ControlStartError as exc:
                # The run was asked for control and cannot have it: it stops before its first step, with one
                # line per rank and exit status 1 (SystemExit prints no traceback), on every rank alike.
                raise SystemExit(f"rankscope: {exc}") from None
        self._mark = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The epoch's data-loader iterator (worker start-up) is created next: count it as data wait.
        self._mark = time.perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        self._leave_phase()  # a checkpoint written after the last batch ended before this one
        with self._guard():
            if self._step is None:  # the first micro-batch of an optimizer step
                if self._mark is not None:
                    self.monitor.record_data_wait(time.perf_counter() - self._mark)
                self._loss, self._grad_norm, self._samples, self._tokens = None, None, 0, 0
                self._step = self._step_scope.enter_context(self.monitor.step())
            self._samples += int(self.count_samples(batch))
            if self.count_tokens is not None:
                self._tokens = self._tokens + self.count_tokens(batch)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Called after backward (and the all-reduce, and AMP unscaling), before Lightning clips.
        if self._step is None:
            return
        with self._guard():
            self._step.record()  # per-module gradient norms (on their interval) while gradients exist
            every = self.metrics.module_stats_every_n_steps
            if every > 0 and self._step.index % every == 0:
                self._grad_norm = _total_grad_norm(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = trainer.global_step != self._boundary_step  # the optimizer stepped after this batch
        if self._step is not None:
            with self._guard():
                self._add_loss(_loss_of(outputs), pl_module.automatic_optimization)
            if stepped:
                self._end_step()
                if self.monitor.global_step != trainer.global_step:  # manual optimization, several optimizers
                    self.monitor.set_step(trainer.global_step)
        if stepped:
            self._boundary_step = trainer.global_step
            if self.channel is not None:
                # Every process, same step; blocks while paused. Not guarded: a failure here must not
                # leave one process out of the channel's collectives.
                self.channel.at_step_boundary(trainer.global_step, _LightningActions(self, trainer))
        self._mark = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter_phase("validation")  # the goodput's validation bucket, until on_validation_end

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # Lightning calls this while it builds the checkpoint, before writing it, and has no hook after the
        # write: the checkpoint bucket runs until the next batch (or validation, or the end).
        self._enter_phase("checkpoint")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave_phase()
        if self.monitor is None or trainer.sanity_checking:
            return
        with self._guard():
            value = trainer.callback_metrics.get(self.val_loss_key)
            if value is not None:
                self.monitor.record_loss(value.detach() if isinstance(value, torch.Tensor) else value, split="val")
        self._mark = time.perf_counter()  # validation is not data wait

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._discard_step()
        self._leave_phase()
        if self.channel is not None:
            self.channel.finish()  # a requested stop is applied now; every rank logs it
            self.channel = None
        if self.monitor is not None:
            with self._guard():
                self.monitor.finish()  # also flushes; the rank-down alert ignores a finished rank

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # No finish(): a run that died must still look down to the rank-down alert.
        self._discard_step()
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    # --- internals -----------------------------------------------------------------------------

    def _add_loss(self, loss: torch.Tensor | float | None, summed: bool) -> None:
        if loss is None:
            return
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        # Automatic optimization: each micro-batch's loss is already divided by the number of micro-batches.
        self._loss = loss if self._loss is None or not summed else self._loss + loss

    def _end_step(self) -> None:
        """Record the step that the optimizer just completed and close it (always, even if recording fails)."""
        step, self._step = self._step, None
        assert step is not None  # called only while a step is open (on_train_batch_end)
        try:
            with self._guard():
                step.record(loss=self._loss, grad_norm=self._grad_norm)
                if self._samples:
                    self.monitor.inc("samples_total", self._samples)
                if not isinstance(self._tokens, int) or self._tokens:
                    self.monitor.inc("tokens_total", self._tokens)
        finally:
            with self._guard():
                self._step_scope.close()  # records the step (duration, counters, comm/compute split)

    def _discard_step(self) -> None:
        # A step that never reached an optimizer step is not a step: dropped unrecorded.
        self._step_scope.pop_all()
        self._step = None

    def _attach_comm_hook(self, trainer: pl.Trainer) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            # FSDP2 (ModelParallelStrategy), DeepSpeed: no DDP hook; the collective view, when on, times them.
            if trainer.world_size > 1 and getattr(self.monitor, "collectives", None) is None:
                self._log.warning(
                    "comm_hook",
                    "rankscope: comm time not measured: strategy %s does not wrap the model in DDP",
                    type(trainer.strategy).__name__,
                )
            return
        if self._comm_attached is model:
            return
        try:
            self.monitor.attach_comm_hook(model)
            self._comm_attached = model
        except RuntimeError as exc:  # e.g. DDPStrategy(ddp_comm_hook=...) registered one already
            self.monitor.record_error("comm_hook")
            logger.warning("rankscope: comm time not measured: cannot register the DDP comm hook (%s)", exc)

    def _checkpoint_dir(self, trainer: pl.Trainer) -> str:
        if self.checkpoint_dir:
            return self.checkpoint_dir
        callback = trainer.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None)
        return str(dirpath) if dirpath else os.path.join(str(trainer.default_root_dir), "checkpoints")


class _LightningActions:
    """The channel's handler for one step boundary, carried out with Lightning's own mechanisms.

    Called on every rank at the same step; `trainer.save_checkpoint` is itself collective.
    """

    def __init__(self, callback: RankscopeCallback, trainer: pl.Trainer) -> None:
        self.callback, self.trainer = callback, trainer

    def checkpoint(self, reason: str) -> bool:
        """True once the checkpoint is written."""
        return self.callback.save_checkpoint(self.trainer, reason) is not None

    def request_stop(self, reason: str) -> bool:
        """Checkpoint, then make Lightning leave its loop after this step; True when both happened."""
        _check_can_stop(self.trainer)
        written = self.callback.save_checkpoint(self.trainer, "stop") is not None
        self.trainer.should_stop = True
        return written


def _check_can_stop(trainer: pl.Trainer) -> None:
    """Lightning ignores should_stop until min_steps / min_epochs are reached: say so instead of pretending."""
    loop = trainer.fit_loop
    if loop.min_steps and trainer.global_step < loop.min_steps:
        raise RuntimeError(f"Lightning will not stop before min_steps={loop.min_steps} (at {trainer.global_step})")
    if loop.min_epochs and trainer.current_epoch < loop.min_epochs:
        raise RuntimeError(f"Lightning will not stop before min_epochs={loop.min_epochs} (at {trainer.current_epoch})")


def _identity_of(trainer: pl.Trainer) -> RankIdentity:
    """This process's identity as the trainer has it (global, local and node rank, world size); the run id
    and node name from the environment."""
    return RankIdentity.from_env(
        rank=trainer.global_rank,
        local_rank=trainer.local_rank,
        world_size=trainer.world_size,
        node_rank=trainer.node_rank,
    )


def _scheduler_of(trainer: pl.Trainer, optimizer: Any) -> Any:
    """The LR scheduler driving `optimizer` (its base LRs are scaled with the param groups)."""
    for config in trainer.lr_scheduler_configs:
        if getattr(config.scheduler, "optimizer", None) is optimizer:
            return config.scheduler
    return None


def _loss_of(outputs: Any) -> torch.Tensor | float | None:
    """The loss in what training_step returned: a tensor, or the "loss" entry of a mapping."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    return outputs if isinstance(outputs, (torch.Tensor, float, int)) else None


def _batch_size(batch: Batch) -> int:
    """Samples in a batch: the first dimension of its first tensor (nested in mappings, lists, tuples), else 0."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _batch_size(item)
        if found:
            return found
    return 0


def _total_grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Total 2-norm of the gradients of `optimizer`'s parameters, as `clip_grad_norm_` computes it (a device
    tensor; no sync), or None without gradients. Reads the gradients only."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    with torch.no_grad():
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: the function clip_grad_norm_ uses
            return torch.nn.utils.get_total_norm(grads, 2.0)
        norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)


def config_hash(trainer: pl.Trainer, pl_module: torch.nn.Module | None = None) -> str:
    """12 hex digits identifying the setup: HASHED_SETTINGS of the Trainer, the LightningModule's
    hyperparameters (`save_hyperparameters()`), class and parameter count, and the first optimizer's
    class and defaults. Only plain values count (others by their type), so every rank gets the same hash."""
    document: dict[str, Any] = {name: getattr(trainer, name, None) for name in HASHED_SETTINGS}
    if isinstance(pl_module, torch.nn.Module):
        document["model"] = [type(pl_module).__name__, sum(p.numel() for p in pl_module.parameters())]
        document["hparams"] = dict(getattr(pl_module, "hparams", None) or {})
    if trainer.optimizers:
        optimizer = trainer.optimizers[0]
        document["optimizer"] = [type(optimizer).__name__, dict(optimizer.defaults)]
    return setup_hash(_plain(document))


def _plain(value: Any) -> Any:
    """JSON-able and identical on every rank: no reprs holding memory addresses."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        return value.item()
    return type(value).__name__
