"""Hugging Face `transformers.Trainer` integration: rankscope's metrics and control loop in one callback.

    from rankscope.integrations.hf.callback import RankscopeCallback

    trainer = Trainer(model=model, args=args, train_dataset=train_set)
    RankscopeCallback.attach(trainer)            # or Trainer(..., callbacks=[RankscopeCallback()])
    trainer.train()

Every process of a `torchrun` / `accelerate launch` job serves its own
/metrics on base_port + local_rank, labelled with its own rank. Importing this
module imports transformers; `import exporter` alone never does.

Where each signal comes from (Trainer events, in the order the Trainer calls them):

- step_duration_seconds: on_step_begin -> on_step_end, i.e. forward and
  backward of every accumulated micro-batch, the all-reduce, clipping, the
  optimizer and scheduler step, plus the data wait before it (the Trainer
  fetches a step's batches *before* on_step_begin), so that compute = step -
  comm - data wait holds as for any other loop.
- data_wait_seconds: from the last event of the previous step (on_step_end,
  or the on_log / on_evaluate / on_save after it) to on_step_begin: the
  Trainer pulling `gradient_accumulation_steps` batches from its data loader.
  It also holds the Trainer's own small all-gather of the label count
  (`average_tokens_across_devices`) when the model takes loss kwargs.
- comm_duration_seconds / compute_duration_seconds: a DDP comm hook on
  `trainer.model_wrapped` (the public attribute holding the DDP wrapper),
  registered in on_train_begin, before the first backward. Callbacks receive
  only the unwrapped model, so this needs the trainer: use `attach(trainer)`.
  Without it (plain `callbacks=[...]`, or no DDP) comm time is not measured
  and compute time is the whole step.
- loss, grad_norm, non-finite and spike counters: from the Trainer's own logs
  (on_log `loss`, `grad_norm`), which the Trainer already turned into
  numbers: no extra device sync. The logged loss is the mean over
  `logging_steps` steps, and with `logging_nan_inf_filter` (the default) the
  Trainer replaces a NaN/inf loss before logging it, so set `logging_steps=1`
  and `logging_nan_inf_filter=False` to count every non-finite step.
  `eval_loss` becomes loss{split="val"}.
- learning_rate, module_grad_norm, update_ratio: Monitor.watch() on the model
  and the optimizer (per-module norms in on_pre_optimizer_step, while the
  gradients exist).
- samples_total: train batch size per process x gradient accumulation steps
  per optimizer step (nominal: a short last batch counts as full).
- tokens_total: only when TrainingArguments.include_num_input_tokens_seen is
  "non_padding" (or "all", which counts padding too). The Trainer counts the
  tokens of all processes (its own all-gather); each process adds an equal
  share (count / world_size).
- memory, host and GPU probes: sampled at scrape time by the Monitor.
- rankscope_run_info: model = the model's name_or_path (else its class), and
  config_hash = a hash of the TrainingArguments that change the optimisation
  (HASHED_ARGUMENTS), the model's class and its parameter count.

Control (opt in with `control=ControlConfig(...)`): the endpoint runs on the
main process; at every on_step_end all processes take the same actions at the
same step, through the Trainer's own flags: checkpoint -> control.should_save
(the Trainer writes checkpoint-<step>), stop -> should_save and
should_training_stop (train() returns normally), reduce_lr -> the optimizer's
param groups and the scheduler's base LRs, pause/resume -> every process waits
inside on_step_end, where no training collective is in flight, while the
channel's heartbeat keeps its own collectives short. rollback -> the newest
`checkpoint-<N>` before the incident is loaded into the live model,
optimizer, scheduler, scaler and RNG with the Trainer's own loaders,
global_step goes back to N and the data after it is skipped (needs
`attach(trainer)`; what is skipped, and how to resume such a run, in
`rankscope.integrations.hf.recovery`). reduce_micro_batch -> refused_unavailable: the
Trainer builds its DataLoader once per train() and counts micro-batches in
its loop's local variables, so a callback cannot change either mid-run.
Every checkpoint gets `rankscope.json`, the data position it was written at.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from rankscope._lazy import require

require("hf", "transformers", "accelerate")
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from rankscope import create_monitor  # noqa: E402
from rankscope.config import MonitorConfig  # noqa: E402
from rankscope.control import ControlChannel, ControlConfig, ControlStartError, record_checkpoint  # noqa: E402
from rankscope.control.recovery import ActionUnavailable, MicroBatchChange, RollbackDone, RollbackRequest  # noqa: E402
from rankscope.integrations.common import CallbackParts, setup_hash  # noqa: E402
from rankscope.integrations.hf.recovery import TrainerRecovery, micro_batch_unavailable  # noqa: E402
from rankscope.monitor import StepContext  # noqa: E402

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["RankscopeCallback"]

logger = logging.getLogger("rankscope")

#: TrainingArguments that change what the optimisation does; they make rankscope_run_info's config_hash.
HASHED_ARGUMENTS: tuple[str, ...] = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "optim",
    "max_grad_norm",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "seed",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "world_size",
)


class RankscopeCallback(CallbackParts, TrainerCallback):
    """Per-rank metrics (and, optionally, the control endpoint) for a `transformers.Trainer` run."""

    _probe = "hf_callback"
    _what = "Trainer callback"

    def __init__(self, metrics: MonitorConfig | None = None, control: ControlConfig | None = None) -> None:
        """`metrics`: the monitor's settings (model_name and config_hash are filled in from the run
        when left empty). `control`: the control channel's settings; None runs no control endpoint."""
        self.metrics = metrics or MonitorConfig()
        if self.metrics.skip_nonfinite:
            raise ValueError(
                "metrics.skip_nonfinite is not supported with the Trainer callback: the Trainer steps the "
                "optimizer itself (use the Trainer's logging_nan_inf_filter, or your own training loop)"
            )
        self.control = control
        self._init_parts()
        self._trainer: Any | None = None
        self._step_scope = ExitStack()
        self._step: StepContext | None = None
        self._last_step: StepContext | None = None
        self._tokens_at_begin = 0
        self._mark: float | None = None
        self._save_reason: str | None = None
        self._comm_attached: Any | None = None
        self._saves = 0  # the Trainer's saves so far (on_save)
        self._recovery: TrainerRecovery | None = None

    @classmethod
    def attach(
        cls, trainer: Trainer, metrics: MonitorConfig | None = None, control: ControlConfig | None = None
    ) -> RankscopeCallback:
        """Add a callback to `trainer` that also times the gradient all-reduce of its DDP model.

        Callbacks only receive the unwrapped model; the DDP wrapper is the trainer's public
        `model_wrapped`, so timing communication needs the trainer itself.
        """
        callback = cls(metrics, control)
        callback._trainer = trainer
        trainer.add_callback(callback)
        return callback

    # --- Trainer events ------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model, optimizer = kwargs.get("model"), _unwrap_optimizer(kwargs.get("optimizer"))
        if self.monitor is None:
            config = dataclasses.replace(
                self.metrics,
                model_name=self.metrics.model_name or _model_name(model),
                config_hash=self.metrics.config_hash or config_hash(args, model),
            )
            self.monitor = create_monitor(config, device=args.device)
            self.monitor.start()
            # Error counters exist at 0 from the first scrape, so increase() sees the first failure.
            for probe in (self._probe, "comm_hook"):
                self.monitor.inc("monitor_errors_total", 0, probe=probe)
        if model is not None:
            self.monitor.watch(model, optimizer)
        self._attach_comm_hook(args.world_size)
        self.monitor.set_step(state.global_step)  # resumed runs continue their count
        if self.control is not None:  # metrics alone never touch the data or the checkpoints
            self._recovery = TrainerRecovery(self._trainer, self.monitor, lr_floor=self.control.lr_floor)
            with self._guard():
                self._recovery.train_begin(args, state, kwargs.get("train_dataloader"))
        if self.control is not None and self.channel is None:
            # Collective: every process reaches on_train_begin, after the Trainer set up the process group.
            try:
                self.channel = ControlChannel(
                    self.control, self.monitor, optimizer=optimizer, scheduler=kwargs.get("lr_scheduler")
                )
            except ControlStartError as exc:
                # Asked for control and cannot have it: stop before the first step, one line per rank, exit 1.
                raise SystemExit(f"rankscope: {exc}") from None
            self.monitor.set("micro_batch_size", state.train_batch_size or args.per_device_train_batch_size)
        self._mark = time.perf_counter()

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The epoch's data-loader iterator (worker start-up) is created next: count it as data wait.
        self._mark = time.perf_counter()
        if self._recovery is not None:
            with self._guard():
                self._recovery.epoch_begin(kwargs.get("train_dataloader"))

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._recovery is not None:
            self._recovery.micro_batch_done()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is None:
            return
        with self._guard():
            if self._mark is not None:
                self.monitor.record_data_wait(time.perf_counter() - self._mark)
            samples = (state.train_batch_size or args.per_device_train_batch_size) * args.gradient_accumulation_steps
            self._tokens_at_begin = state.num_input_tokens_seen
            self._step = self._step_scope.enter_context(self.monitor.step(samples=samples))

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._step is not None:
            with self._guard():
                self._step.record()  # per-module gradient norms (on their interval) while gradients exist

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self.monitor is not None and self._step is not None:
            with self._guard():
                self._step_scope.close()  # records the step (duration, counters, comm/compute split)
                self._last_step, self._step = self._step, None
                tokens = state.num_input_tokens_seen - self._tokens_at_begin
                if tokens > 0:
                    self.monitor.inc("tokens_total", round(tokens / max(1, args.world_size)))
        if self._recovery is not None:
            self._recovery.micro_batch_done()
            self._recovery.step_done()
        if self.channel is not None:
            # Every process, same step; blocks while paused. Not guarded: a failure here must not
            # leave one process out of the channel's collectives.
            actions = _TrainerActions(control, self, args, state)
            self.channel.at_step_boundary(state.global_step, actions)
            self._save_reason = actions.save_reason or self._save_reason
        # The Trainer evaluates, then saves, right after this event: the goodput's validation and checkpoint.
        if control.should_evaluate:
            self._enter_phase("validation")
        elif control.should_save:
            self._enter_phase("checkpoint")
        self._mark = time.perf_counter()
        return control

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.monitor is not None and logs:
            with self._guard():
                if "loss" in logs:
                    self._record_train_values(logs["loss"], logs.get("grad_norm"))
                if "eval_loss" in logs:
                    self.monitor.record_loss(logs["eval_loss"], split="val")
        self._mark = time.perf_counter()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_save:
            self._enter_phase("checkpoint")
        else:
            self._leave_phase()
        self._mark = time.perf_counter()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # The Trainer saves right after the step's last event (on_step_end, on_log or on_evaluate).
        now = time.perf_counter()
        reason = self._save_reason or ("final" if state.global_step >= state.max_steps else "interval")
        self._save_reason = None
        self._saves += 1
        self._leave_phase()  # marks the saved step: a later resume or rollback to it loses only what came after
        with self._guard():
            if self._recovery is not None:
                self._recovery.saved(args, state)  # the checkpoint's data position, for rollbacks and resumes
            if self._mark is not None:
                record_checkpoint(self.monitor, reason, now - self._mark)
        self._mark = time.perf_counter()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._step_scope.close()
        self._step = None
        self._leave_phase()
        if self.channel is not None:
            self.channel.finish()  # a requested stop is applied now; every rank logs it
            self.channel = None
        if self.monitor is not None:
            with self._guard():
                self.monitor.finish()  # also flushes; the rank-down alert ignores a finished rank

    # --- internals ---------------------------------------------------------------------------

    def _record_train_values(self, loss: float, grad_norm: float | None) -> None:
        if self._last_step is not None:
            # The logged values belong to the step that just ended; its context feeds the loss
            # gauge, the spike detector and the non-finite counter.
            self._last_step.record(loss=loss, grad_norm=grad_norm)
        else:
            self.monitor.set("loss", loss, split="train")

    def _attach_comm_hook(self, world_size: int) -> None:
        if self._trainer is None:
            # Without the Trainer no DDP hook; the collective view, when on, times the collectives anyway.
            if world_size > 1 and getattr(self.monitor, "collectives", None) is None:
                self._log.warning(
                    "comm_hook",
                    "rankscope: comm time not measured; add the callback with RankscopeCallback.attach(trainer)",
                )
            return
        wrapped = getattr(self._trainer, "model_wrapped", None)
        if not isinstance(wrapped, DistributedDataParallel) or self._comm_attached is wrapped:
            return
        try:
            self.monitor.attach_comm_hook(wrapped)
            self._comm_attached = wrapped
        except RuntimeError as exc:  # e.g. a comm hook already set through Accelerate's DDP kwargs
            self.monitor.record_error("comm_hook")
            logger.warning("rankscope: comm time not measured: cannot register the DDP comm hook (%s)", exc)


class _TrainerActions:
    """The channel's handler for one step boundary: actions become the Trainer's own flags.

    The Trainer acts on them right after on_step_end, on every process: it saves
    `checkpoint-<step>` and, for stop, leaves its loop and returns from train().
    A checkpoint is therefore written after this handler returns: it answers with a check
    that the channel asks at later boundaries, true once on_save has reported a save since.
    `rollback` loads the Trainer's own checkpoint into the live run (see `rankscope.integrations.hf.recovery`);
    `reduce_micro_batch` is refused with the reason (see `micro_batch_unavailable`).
    """

    def __init__(self, control: TrainerControl, callback: RankscopeCallback, args: Any, state: TrainerState) -> None:
        self.control = control
        self.save_reason: str | None = None
        self._callback = callback
        self._args = args
        self._state = state

    def checkpoint(self, reason: str) -> Any:
        self.control.should_save = True
        self.save_reason = self.save_reason or reason
        callback, saves = self._callback, self._callback._saves
        return lambda: True if callback._saves > saves else None

    def request_stop(self, reason: str) -> None:
        self.control.should_save = True
        self.control.should_training_stop = True
        self.save_reason = "stop"

    def rollback(self, request: RollbackRequest) -> RollbackDone:
        recovery = self._callback._recovery
        if recovery is None:
            raise ActionUnavailable("the callback saw no on_train_begin")
        # A checkpoint or stop asked at this boundary still saves (checkpoint-N, now with the skipped data position).
        saving, stopping = self.save_reason is not None, self.save_reason == "stop"
        return recovery.rollback(request, self._args, self._state, self.control, saving, stopping)

    def reduce_micro_batch(self, reason: str) -> MicroBatchChange:
        raise ActionUnavailable(micro_batch_unavailable(self._args, self._state))


def _unwrap_optimizer(optimizer: Any) -> Any:
    # Accelerate wraps the optimizer; its step hooks (used for update ratios) live on the inner one.
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _model_name(model: Any) -> str:
    """A Hub id ("org/name") as is; a local checkpoint path by its last part (no paths in labels);
    a model built from a config by its class."""
    config = getattr(model, "config", None)
    name = str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", ""))
    if name.startswith(("/", ".", "~")) or os.path.isdir(name):
        name = os.path.basename(os.path.normpath(name))
    return name or (type(model).__name__ if model is not None else "")


def config_hash(args: TrainingArguments, model: Any = None) -> str:
    """12 hex digits identifying the setup: HASHED_ARGUMENTS, the model's class and parameter count.

    Not the model config: the Trainer's first forward fills some of it in (e.g. `problem_type`),
    which would give one run two hashes.
    """
    document: dict[str, Any] = {name: getattr(args, name, None) for name in HASHED_ARGUMENTS}
    if isinstance(model, torch.nn.Module):
        document["model"] = [type(model).__name__, sum(p.numel() for p in model.parameters())]
    return setup_hash(document)
