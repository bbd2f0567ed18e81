"""The Trainer: every component built from one config, and a loop that reads top to bottom.

    trainer = Trainer(load_config("trainer/rankscope_trainer/configs/demo.yaml"), resume="auto")
    trainer.fit()

Per step (every rank): fetch a batch (timed by the monitor), forward, loss,
backward (DDP all-reduces gradients through the monitor's comm hook), clip,
let the non-finite guard decide, optimizer and scheduler step. Then, at the
step boundary: progress log, validation, control actions (applied by every
rank at the same step), interval checkpoint.

Distributed decisions:
- DDP replicates the model, so rank 0 alone writes checkpoints; every rank
  still takes part (RNG states are gathered, everyone waits for the file).
- The contrastive loss uses each rank's own batch as negatives (no feature
  all-gather): simpler, and each rank's accuracy is its own signal.
- Validation sums loss and hits over ranks with one small all-reduce, so
  every rank reports the same validation numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rankscope import RankIdentity, create_monitor, write_file_sd
from rankscope.control import (
    ActionUnavailable,
    ControlChannel,
    MicroBatchChange,
    RollbackDone,
    RollbackRequest,
    scale_learning_rates,
)
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from rankscope_trainer import _extra  # noqa: F401 - first: the trainer extra's packages, or one line naming the missing one
from rankscope_trainer.checkpoint import CHECKPOINT_FORMAT, Checkpointer, CheckpointError, read_checkpoint
from rankscope_trainer.config import TrainConfig
from rankscope_trainer.data import Batch, DataError, build_data, settle_bad_samples
from rankscope_trainer.fault_markers import FaultMarkers
from rankscope_trainer.faults import FaultInjector
from rankscope_trainer.history import CheckpointHistory
from rankscope_trainer.logbook import ProgressLog
from rankscope_trainer.lookahead import BAD_LOSS_FACTOR, bad_stretch_length, batch_loss, clean_loss
from rankscope_trainer.lost_peer import lost_peer, report_lost_peer
from rankscope_trainer.metrics import TRAINER_METRICS
from rankscope_trainer.model import build_model, contrastive_accuracy, contrastive_loss
from rankscope_trainer.onset import LOSS_HISTORY_STEPS, LossHistory, excursion_start, rate_raised
from rankscope_trainer.runtime import Runtime, get_rng_state, seed_everything, set_rng_state
from rankscope_trainer.skips import SkipRecord, merge_skips, read_skip_file, write_skip_file
from rankscope_trainer.stats import record_accuracy, record_batch_stats, record_model_stats
from rankscope_trainer.tokenizer import WordTokenizer

__all__ = ["Trainer", "warmup_cosine"]

logger = logging.getLogger("rankscope_trainer")


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """LR multiplier: linear warmup over `warmup` steps, then cosine from 1 down to `min_ratio` at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # Matrices decay; biases, norms and the temperature do not.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class Trainer:
    """Builds the run from `cfg` (collective: every rank constructs it) and trains with `fit()`."""

    def __init__(self, cfg: TrainConfig, resume: str = "none") -> None:
        self.cfg = cfg
        run = cfg.run
        self.rt = Runtime.start(run.device, run.dist_timeout_seconds, run.threads)
        seed_everything(run.seed)  # same seed on every rank: identical initial weights
        identity = RankIdentity.from_env(run_id=run.run_id or None)
        metrics = replace(
            cfg.metrics,
            model_name=cfg.metrics.model_name or f"clip-{cfg.model.image_encoder}",
            config_hash=cfg.metrics.config_hash or cfg.hash(),
            goodput_dir=cfg.metrics.goodput_dir or cfg.checkpoint.dir,  # the job's accounting beside its checkpoints
        )
        self.monitor = create_monitor(metrics, identity=identity, device=self.rt.device, extra_metrics=TRAINER_METRICS)
        self.monitor.start()
        if metrics.enabled and metrics.file_sd_path:
            write_file_sd(self.monitor, metrics.file_sd_path, metrics.advertise_host or None)  # collective
        self.checkpoints = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep, self.rt, self.monitor)
        resumed = self.checkpoints.load(resume)  # collective
        state = resumed[1] if resumed else None

        tokenizer = WordTokenizer.from_state_dict(state["tokenizer"]) if state else None
        self.data = build_data(
            cfg.data, cfg.model.image_size, run.seed, self.rt.rank, self.rt.world_size, tokenizer,
            pin_memory=self.rt.device.type == "cuda",
        )  # fmt: skip
        if self.rt.is_main:
            for reason, count in self.data.skipped.items():
                # Counted once, on rank 0, so a sum over ranks is the run's total.
                self.monitor.inc("data_skipped_samples_total", count, reason=reason)
        tok = self.data.tokenizer
        model = build_model(cfg.model, tok.vocab_size, tok.max_length, tok.pad_id).to(self.rt.device)
        on_cuda = self.rt.device.type == "cuda"
        # broadcast_buffers=False: the default starts every forward with a broadcast from rank 0, whose
        # wait counts as the peers' compute time, so a slow data loader on rank 0 would make rank 1 look
        # like the straggler. The ViT/BERT buffers are constants; with the ResNet encoder each rank keeps
        # its own BatchNorm running statistics (rank 0's are checkpointed).
        # torch 2.14 calls broadcast_buffers deprecated but itself advises keeping broadcast_buffers=False
        # until `init_sync_buffers` exists (its replacement still syncs at init): quiet that one warning.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated", category=FutureWarning)
            self.model = DistributedDataParallel(
                model, device_ids=[self.rt.device.index] if on_cuda else None, broadcast_buffers=False
            )
        self.monitor.attach_comm_hook(self.model)
        self.optimizer = torch.optim.AdamW(_param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr)
        total = cfg.optim.decay_steps or run.max_steps
        self.scheduler = LambdaLR(self.optimizer, warmup_cosine(cfg.optim.warmup_steps, total, cfg.optim.min_lr_ratio))
        self.amp_dtype = self._amp_dtype()
        self.scaler = torch.amp.GradScaler(self.rt.device.type, enabled=self.amp_dtype is torch.float16)
        self.monitor.watch(self.model, self.optimizer)
        self.micro_batch = cfg.data.batch_size
        self.accumulation = cfg.data.accumulation_steps
        self.log = ProgressLog(run.log_file, self.rt.is_main, run.max_steps, self.step_samples * self.rt.world_size)
        markers = FaultMarkers(cfg.faults.state_dir or Path(cfg.checkpoint.dir) / "faults", self.checkpoints.lineage)
        # Every rank gets the union of what each read (collective, before any rank can fire): they agree on
        # which faults this job already fired, also where a node does not see another's markers.
        fired = set().union(*self.rt.gather_objects(markers.fired())) if cfg.faults.events() else set()
        self.faults = FaultInjector(cfg.faults, self.rt.rank, markers, on_fire=self.log.fault, fired=fired)

        self.step = 0
        self.epoch = 0
        self.sample_in_epoch = 0
        """The data position: samples of this rank's epoch share already trained on (or skipped)."""
        self.skips: list[SkipRecord] = []
        """Data windows that rollbacks skipped, applied again by a run resumed before them
        (`rankscope_trainer.skips`)."""
        self._history = CheckpointHistory(cfg.checkpoint.keep)
        """The checkpoints this run's current history passed through, also before a restart: what rollback may load."""
        self._losses = LossHistory(LOSS_HISTORY_STEPS)
        """The last steps' losses, where a rollback looks for the start of the excursion it undoes."""
        self._reposition = False
        """Set by an action that moved the data position or changed the loader: the epoch's iteration restarts."""
        self.best_val_loss = math.inf
        self.last_val_step = -1
        self.stop_reason: str | None = None
        # Per-rank streams from here on (dropout, faults' choices); restored exactly on resume.
        seed_everything(run.seed + 1000 * self.rt.rank)
        if resumed:
            self._restore(*resumed)
            self._history.resumed(Path(resumed[0]), resumed[1])
        self.monitor.set("micro_batch_size", self.micro_batch)
        self.channel = self._control_channel()  # collective; from here on SIGTERM means checkpoint-then-stop
        if self.channel is not None and state and state.get("control"):
            self.channel.load_state_dict(state["control"])
        self.log.event("start", step=self.step, world_size=self.rt.world_size, resumed=bool(resumed),
                       config_hash=metrics.config_hash)  # fmt: skip

    # --- the loop ------------------------------------------------------------------------------

    def fit(self) -> None:
        """Train to run.max_steps (or until a stop request), validate, checkpoint, clean up."""
        try:
            self.log.restart_clock()
            while self.step < self.cfg.run.max_steps and self.stop_reason is None:
                self._train_epoch()
            self._finish()
        except RuntimeError as exc:
            if lost_peer(exc):  # said before close(): the launcher's SIGTERM may end this rank during it
                report_lost_peer(self.rt.rank, exc)
            raise
        finally:
            self.close()

    @property
    def step_samples(self) -> int:
        """Samples per rank per optimizer step: micro-batch x accumulation (reduce_micro_batch keeps it)."""
        return self.micro_batch * self.accumulation

    def _train_epoch(self) -> None:
        self._reposition = False
        self._replay_skips()
        self.data.sampler.set_position(self.epoch, self.sample_in_epoch, self.step_samples)
        batches = self.faults.slow_data(self.data.train_loader, lambda: self.step + 1)
        micro_batches: list[Batch] = []
        for batch in self.monitor.data(batches):
            micro_batches.append(batch)
            if len(micro_batches) < self.accumulation:
                continue
            self.train_step(micro_batches)
            micro_batches = []
            self._advance(1)  # the position a checkpoint records
            self._at_step_boundary()
            if self.step >= self.cfg.run.max_steps or self.stop_reason is not None or self._reposition:
                return
            if self._skip_due() is not None:  # a run resumed before a rollback's checkpoint reaches it mid-epoch
                return

    def _advance(self, steps: int) -> None:
        """Move the data position on by `steps` steps' worth of samples, into later epochs if need be."""
        self.epoch, self.sample_in_epoch = self._position_after(steps)

    def _position_after(self, steps: int) -> tuple[int, int]:
        """The data position (epoch, sample in it) `steps` steps' worth of samples after the current one."""
        per_epoch = self.data.steps_per_epoch(self.step_samples) * self.step_samples
        epochs, sample = divmod(self.sample_in_epoch + steps * self.step_samples, per_epoch)
        return self.epoch + epochs, sample

    @property
    def data_batch(self) -> int:
        """1-based index of the next step's batch in this rank's data stream, across epochs."""
        per_epoch = self.data.steps_per_epoch(self.step_samples)
        return self.epoch * per_epoch + self.sample_in_epoch // self.step_samples + 1

    def train_step(self, micro_batches: Batch | list[Batch]) -> None:
        """One optimizer step on one batch, given as its micro-batches (every rank, in lockstep through DDP's
        all-reduce, which runs once, on the last micro-batch's backward)."""
        micro_batches = [micro_batches] if isinstance(micro_batches, Batch) else micro_batches
        micro_batches = self.faults.poison(self.data_batch, micro_batches)
        for batch in micro_batches:
            settle_bad_samples(batch.bad, self.cfg.data.on_bad_sample, self.monitor)
            if len(batch) == 0:
                raise DataError("every sample of a training batch was unreadable; see the warnings above")
        samples = sum(len(batch) for batch in micro_batches)
        tokens = sum(batch.tokens for batch in micro_batches)
        # The longest caption of the step, from host-side lengths (no device sync).
        longest = max(int(batch.lengths.max()) for batch in micro_batches)
        last = len(micro_batches) - 1
        with self.monitor.step(samples=samples, tokens=tokens, max_seq_len=longest) as step:
            self.faults.at_step_start(step.index, self.optimizer, self.scheduler)
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses (host float, no sync)
            stats_due = self._due_at(step.index, self.cfg.run.stats_every)
            on_device = [batch.to(self.rt.device) for batch in micro_batches]
            cached = self._embeddings(on_device) if last else None
            for index, inputs in enumerate(on_device):
                # On statistics steps the attention entropy is read from the first forward (no extra pass).
                recording = (
                    self.model.module.recording_attention_entropy(inputs.attention_mask)
                    if stats_due and index == 0
                    else contextlib.nullcontext(None)
                )
                # Gradients of all but the last micro-batch stay local: one all-reduce per step.
                # (faults.hang, kind collective: this rank leaves the step's all-reduce out and hangs in the next.)
                syncing = (
                    contextlib.nullcontext()
                    if index == last and not self.faults.skips_collective(step.index)
                    else self.model.no_sync()
                )
                with syncing:
                    with self._autocast(), recording as recorded:
                        if cached is None:
                            logits = self.model(inputs.images, inputs.input_ids, inputs.attention_mask)
                        else:
                            logits = self._step_logits(inputs, index, cached, live_scale=index == last)
                        loss = contrastive_loss(logits)
                    if index == last:
                        loss = self.faults.after_forward(step.index, loss)
                    self.scaler.scale(loss).backward()
                    if index == last:
                        self.faults.after_backward(step.index)
                if index == 0:
                    attention = recorded
            self.scaler.unscale_(self.optimizer)
            max_norm = self.cfg.optim.grad_clip or math.inf
            norm = self.monitor.clip_grad_norm_(self.model.parameters(), max_norm)
            loss = loss.detach()
            if step.record(loss=loss, grad_norm=norm):
                self.scaler.step(self.optimizer)
            self.scaler.update()  # also after a skipped step, so an fp16 scale can shrink
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.step = step.index
        accuracy = contrastive_accuracy(logits.detach())
        record_accuracy(self.monitor, accuracy, split="train")
        self.log.record_step(self.step, loss, accuracy, lr)
        self._losses.record(self.step, loss)
        if stats_due:
            assert attention is not None  # a step with stats due records the first micro-batch's attention
            record_batch_stats(self.monitor, micro_batches[0], on_device[0].images)
            record_model_stats(self.monitor, self.model.module, on_device[0], attention.value())

    # --- accumulation: the contrastive loss over the whole step's batch ---------------------------------

    @torch.no_grad()
    def _embeddings(self, on_device: list[Batch]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every micro-batch's embeddings, without gradients (activations freed at once).

        The contrastive loss takes its negatives from the whole batch: with micro-batches alone each would
        see only its own, and the optimisation would change with the micro-batch. As OpenCLIP's accum_freq
        does, each micro-batch is then run again with gradients, its embeddings put in place of its cached
        ones, and the loss over the whole step's batch backpropagated: the gradients sum to the full
        batch's, for one micro-batch's activations at a time (and one more forward per micro-batch)."""
        with self._autocast():
            return [self.model.module(b.images, b.input_ids, b.attention_mask, features=True) for b in on_device]

    def _step_logits(self, inputs: Batch, index: int, cached: list[Any], live_scale: bool) -> torch.Tensor:
        image, text, scale = self.model(inputs.images, inputs.input_ids, inputs.attention_mask, features=True)
        images = [c[0] for c in cached]
        texts = [c[1] for c in cached]
        images[index], texts[index] = image, text
        # The temperature's gradient is taken once, in the last (all-reducing) backward, so DDP sees it
        # there; the other micro-batches use the same value without gradient.
        scale = scale if live_scale else cached[index][2]
        return scale * torch.cat(images) @ torch.cat(texts).t()

    def _at_step_boundary(self) -> None:
        run = self.cfg.run
        if self._due(run.log_every):
            self.log.flush()
        if self._due(run.val_every):
            with self.monitor.phase("validation"):
                self.validate()
        if self.channel is not None:
            applied = self.channel.at_step_boundary(self.step, self)  # may call checkpoint() / request_stop()
            if self.log.enabled:  # rank 0: the outcomes as /v1/status has them, each at its own time
                self.log.actions(self.channel.queue.snapshot()["recent"])
            if "pause" in applied or "resume" in applied:
                self.log.restart_clock()  # a pause is not step time
        # A stop requested at this boundary checkpoints on the way out (reason "stop:..."): not twice.
        due = self._due(self.cfg.checkpoint.every_steps) and self.checkpoints.last_step != self.step
        if due and self.stop_reason is None:
            self.save_checkpoint("interval")

    def _due(self, every: int) -> bool:
        return self._due_at(self.step, every)

    @staticmethod
    def _due_at(step: int, every: int) -> bool:
        return every > 0 and step % every == 0

    def _finish(self) -> None:
        self.log.flush()
        if self.stop_reason is not None:
            self.save_checkpoint(f"stop:{self.stop_reason}")
        else:
            if self.last_val_step != self.step:
                with self.monitor.phase("validation"):
                    self.validate()
            if self.cfg.checkpoint.save_final and self.checkpoints.last_step != self.step:
                self.save_checkpoint("final")
        self.log.event("finished", step=self.step, stopped=self.stop_reason)
        if self.rt.is_main:
            stopped = f" (stopped: {self.stop_reason})" if self.stop_reason else ""
            logger.info("finished at step %d%s", self.step, stopped)
        # Before the linger, so a scrape sees it: the rank-down alert ignores ranks that finished cleanly.
        self.monitor.finish()
        signalled = (self.stop_reason or "").startswith("signal:")  # the sender waits a grace period, not more
        if self.cfg.run.linger_seconds and not signalled:
            if self.rt.is_main:
                logger.info("serving metrics for %.0fs more (run.linger_seconds)", self.cfg.run.linger_seconds)
            time.sleep(self.cfg.run.linger_seconds)
        self.rt.barrier()  # leave together: no rank tears down while a peer still needs it

    # --- validation -------------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and in-batch accuracy on the validation set, summed over every rank's shard."""
        model = self.model.module  # no DDP forward: nothing to synchronise, no gradients
        model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=self.rt.device)
        try:
            for index, batch in enumerate(self.data.val_loader):
                settle_bad_samples(batch.bad, self.cfg.data.on_bad_sample, self.monitor)
                if len(batch) == 0:
                    continue
                on_device = batch.to(self.rt.device)
                with self._autocast():
                    logits = model(on_device.images, on_device.input_ids, on_device.attention_mask)
                if index == 0 and self.rt.is_main:  # the first samples' attention maps, for the run report
                    from rankscope_trainer.attention_maps import save_attention_maps

                    save_attention_maps(self.cfg.run, self.step, model, batch, self.data.tokenizer.vocab)
                n = float(len(batch))
                accuracy = contrastive_accuracy(logits)
                totals += torch.stack([contrastive_loss(logits) * n, accuracy[0] * n, accuracy[1] * n,
                                       torch.tensor(n, device=totals.device)]).to(torch.float64)  # fmt: skip
        finally:
            model.train()
        torch.distributed.all_reduce(totals)
        loss_sum, i2t, t2i, count = totals.tolist()
        self.last_val_step = self.step
        if count == 0:
            return {}
        result = {"loss": loss_sum / count, "acc_i2t": i2t / count, "acc_t2i": t2i / count}
        self.monitor.record_loss(result["loss"], split="val")
        record_accuracy(self.monitor, [result["acc_i2t"], result["acc_t2i"]], split="val")
        self.best_val_loss = min(self.best_val_loss, result["loss"])
        self.log.event("val", step=self.step, **result)
        if self.rt.is_main:
            logger.info(
                "validation at step %d | loss %.4f | acc i2t %.3f t2i %.3f",
                self.step, result["loss"], result["acc_i2t"], result["acc_t2i"],
            )  # fmt: skip
        return result

    # --- bad samples, control, checkpoints ------------------------------------------------------

    def checkpoint(self, reason: str) -> Path | None:
        """Control handler: checkpoint now (every rank calls this at the same boundary); the path, or None
        if it could not be written (the action is then reported failed)."""
        return self.save_checkpoint(reason)

    def request_stop(self, reason: str) -> None:
        """Control handler: leave the loop after this step; `_finish` writes the stop checkpoint."""
        self.stop_reason = reason

    def save_checkpoint(self, reason: str) -> Path | None:
        with self.monitor.phase("checkpoint"):
            path = self.checkpoints.save(self.step, self.faults.slow_checkpoint(self.step, self.state_dict), reason)
        if path is not None:
            self._history.add(self.step, path, self.checkpoints.last_saved_at)
            self.log.event("checkpoint", step=self.step, reason=reason, path=str(path))
        else:
            self.log.event("checkpoint_failed", step=self.step, reason=reason, error=self.checkpoints.failures[-1])
        return path

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (RNG states are added by the Checkpointer)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.sample_in_epoch // self.step_samples,
            "sample_in_epoch": self.sample_in_epoch,
            "world_size": self.rt.world_size,
            "batch_size": self.step_samples,  # samples per rank per step: the layout a position counts in
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation,
            "skips": [record.to_json() for record in self.skips],
            "history": self._history.to_state(),
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "tokenizer": self.data.tokenizer.state_dict(),
            "config": self.cfg.to_dict(),
            "monitor": {"best_val_loss": self.best_val_loss, "last_val_step": self.last_val_step},
            "control": self.channel.state_dict() if self.channel is not None else {},
        }

    def _restore(self, path: Any, state: dict[str, Any], event: str = "resume", **event_fields: Any) -> None:
        try:  # first, so that a damaged record changes nothing
            recorded = read_skip_file(self.checkpoints.directory, self.checkpoints.lineage)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        try:
            self.model.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            detail = " ".join(str(exc).split())[:300]
            raise CheckpointError(f"checkpoint {path} does not fit this model/config: {detail}") from None
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        saved_step_samples = int(state.get("batch_size") or self.step_samples)
        self.sample_in_epoch = int(state.get("sample_in_epoch", int(state["batch_in_epoch"]) * saved_step_samples))
        layout = (state.get("world_size"), saved_step_samples)
        same_layout = layout == (self.rt.world_size, self.cfg.data.batch_size * self.cfg.data.accumulation_steps)
        if not same_layout:
            # The saved position counts samples of another layout: start the next epoch instead.
            logger.warning("checkpoint %s was written with another world size or batch size; "
                           "data order restarts at epoch %d", path, self.epoch + 1)  # fmt: skip
            self.epoch, self.sample_in_epoch = self.epoch + 1, 0
        elif "micro_batch" in state:
            self._set_micro_batch(int(state["micro_batch"]), int(state["accumulation_steps"]))
        monitor_state = state.get("monitor", {})
        self.best_val_loss = float(monitor_state.get("best_val_loss", math.inf))
        self.last_val_step = int(monitor_state.get("last_val_step", -1))
        rng = state["rng"]
        set_rng_state(rng[self.rt.rank] if self.rt.rank < len(rng) else rng[0])
        self.skips = merge_skips([SkipRecord.from_json(item) for item in state.get("skips", [])], self.skips, recorded)
        self.monitor.set_step(self.step)
        self.checkpoints.last_step = self.step
        self.log.event(event, step=self.step, path=str(path), reason=state.get("reason", ""), **event_fields)
        if self.rt.is_main:
            logger.info("%s from %s at step %d (epoch %d, sample %d; written for: %s)", event, path, self.step,
                        self.epoch, self.sample_in_epoch, state.get("reason", "?"))  # fmt: skip

    def _set_micro_batch(self, micro_batch: int, accumulation: int) -> None:
        if (micro_batch, accumulation) == (self.micro_batch, self.accumulation):
            return
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.data.set_micro_batch(micro_batch)
        self.monitor.set("micro_batch_size", micro_batch)
        self._reposition = True

    # --- recovery actions (control handler; every rank, at the same boundary) -------------------

    def rollback(self, request: RollbackRequest) -> RollbackDone:
        """Load the newest checkpoint of this run's history before `request.before_step` (or a newer one written
        before the step losses left their level, `_before_onset`), then skip the data window after it (applied by
        `_replay_skips` when the loop reaches the checkpoint's position).

        Collective: every rank finds and reads its candidate first, and all compare before any changes, so a
        rank that cannot read the file refuses the rollback on every rank instead of leaving replicas apart."""
        left = self.step
        losses = self._step_losses() if request.onset_window_steps > 0 else None  # collective: every rank
        found, problem = self._rollback_source(request)
        bound, onset, pruned_from = (found[0] if found else None), None, None
        if found is not None and losses is not None:
            found, onset = self._before_onset(found, *losses, request.onset_window_steps)
        elif losses is not None:
            found, onset, pruned_from = self._past_every_kept(*losses, request.onset_window_steps)
        choices = self.rt.gather_objects((str(found[1]) if found else None, problem))
        if found is None or len({path for path, _ in choices}) != 1:
            if len(set(choices)) == 1:
                raise ActionUnavailable(problem)
            answers = [f"rank {rank}: {why or path}" for rank, (path, why) in enumerate(choices)]
            raise ActionUnavailable(("the ranks disagree: " + "; ".join(answers))[:300])
        step, path, state = found
        self.log.flush()  # the steps trained before the rollback go to the log before its record
        left_batch = self.data_batch
        self._restore(path, state, event="rollback", action_reason=request.reason, rolled_back_from=left,
                      loss_rose_at=onset)  # fmt: skip
        self._history.truncate(step)
        self._losses.clear()  # the steps after the checkpoint are trained again
        window = request.window(step, trained_batches=left_batch - self.data_batch)
        # An operator's explicit skip_batches is taken as given; the default window is extended over the bad
        # data the restored model still finds after it (`rankscope_trainer.lookahead`).
        ahead = self._bad_data_after(window, request.lookahead_batches) if request.skip_batches is None else 0
        record = SkipRecord(step, self.epoch, self.sample_in_epoch, window + ahead, request.lr_factor,
                            request.incident_step, left, request.reason, lookahead=ahead)  # fmt: skip
        self.skips = merge_skips(self.skips, [record])
        if self.rt.is_main:
            try:
                write_skip_file(self.checkpoints.directory, self.checkpoints.lineage, self.skips)
            except OSError as exc:  # later checkpoints still carry the record
                logger.error("rollback record not written beside the checkpoints: %s", exc)
        self._reposition = True
        where = f"epoch {record.epoch} sample {record.sample}"
        detail = f"from step {left}; data from {where} skipped"
        if pruned_from is not None:
            detail += (f" (no readable checkpoint before step {request.checkpoint_bound} is left; the loss stayed at"
                       f" its level from step {pruned_from} until after step {onset})")  # fmt: skip
        elif onset is not None and step != bound:
            detail += f" (the loss left its level after step {onset}: a newer checkpoint than step {bound})"
        if ahead:
            detail += f" ({ahead} of the batches after the window looked bad to the restored model)"
        return RollbackDone(step, path.name, record.batches, detail)

    def _bad_data_after(self, window: int, limit: int) -> int:
        """How many batches right after the first `window` ones from the restored position the restored model
        finds bad (at most `limit`; `rankscope_trainer.lookahead`). Collective: every rank reads its own share
        of each batch and all decide on the all-reduced losses, so all skip alike. The random states and the
        loader's generator are put back, so training on from here is what it would have been without it."""
        if limit <= 0:
            return 0
        model = self.model.module
        rng, generator = get_rng_state(), self.data.train_loader.generator
        loader_rng = generator.get_state() if generator is not None else None
        model.eval()
        try:
            # Forward passes over data, as validation is (its phase, so a long look is not taken for a hang).
            with self.monitor.phase("validation"), self._autocast():
                clean = self._all_reduce(clean_loss(model, self.data.val_loader, self.step_samples, self.rt.device))
                clean /= self.rt.world_size

                def is_bad(offset: int) -> bool:
                    epoch, sample = self._position_after(window + offset - 1)
                    batches = self.faults.poison(self.data_batch + window + offset - 1,
                                                 self._batches_at(epoch, sample), record=False)  # fmt: skip
                    loss = batch_loss(model, batches, self.rt.device)
                    return self._all_reduce(loss, torch.distributed.ReduceOp.MAX) > BAD_LOSS_FACTOR * clean

                if clean > 0:
                    ahead = bad_stretch_length(is_bad, limit)
                else:
                    ahead = 0
                    if self.rt.is_main:
                        logger.warning("no validation loss to compare with: the rollback does not read ahead")
        finally:
            model.train()
            set_rng_state(rng)
            if loader_rng is not None:
                generator.set_state(loader_rng)
        if ahead and self.rt.is_main:
            logger.warning("the %d batches after the rollback's window of %d look bad to the restored model "
                           "(loss over %.0fx its validation loss %.4g): skipped too", ahead, window,
                           BAD_LOSS_FACTOR, clean)  # fmt: skip
        return ahead

    def _batches_at(self, epoch: int, sample: int) -> list[Batch]:
        """The micro-batches of one step's data at a data position (the loop sets its position again after)."""
        self.data.sampler.set_position(epoch, sample, self.step_samples)
        batches = iter(self.data.train_loader)
        return [next(batches) for _ in range(self.accumulation)]

    def _all_reduce(self, value: torch.Tensor, op: Any = torch.distributed.ReduceOp.SUM) -> float:
        total = value.detach().to(self.rt.device, torch.float64).reshape(1)
        torch.distributed.all_reduce(total, op=op)
        return float(total.item())

    def _step_losses(self) -> tuple[list[int], list[float]]:
        """(steps, the mean loss over every rank at each), oldest first: one all-reduce, so every rank decides
        on the same numbers."""
        steps, values = self._losses.ordered(self.rt.device)
        torch.distributed.all_reduce(values)
        return steps, (values[: len(steps)] / self.rt.world_size).tolist()

    def _before_onset(self, found: tuple[int, Path, dict[str, Any]], steps: list[int], losses: list[float],
                      window: int) -> tuple[tuple[int, Path, dict[str, Any]], int | None]:  # fmt: skip
        """The newest readable checkpoint between `found` (the alert's bound) and the start of the loss excursion
        that lasts to now (`rankscope_trainer.onset`), and that start; `found` and None when there is none.
        A checkpoint whose learning rate was raised since `found` is passed over: a raised rate is the commonest
        cause of divergence, and it lives in the checkpoint."""
        bound = found[0]
        first = next((i for i, step in enumerate(steps) if step > bound), len(steps))
        start = excursion_start(losses[first:], window)
        if start is None:
            return found, None
        onset = steps[first + start]
        paths = self._history.paths()
        for step in sorted((s for s in paths if bound < s < onset), reverse=True):
            state = self._read_passed(step, paths[step])
            if state is not None and not rate_raised(state, found[2]):
                return (step, paths[step], state), onset
        return found, onset

    def _past_every_kept(
        self, steps: list[int], losses: list[float], window: int
    ) -> tuple[tuple[int, Path, dict[str, Any]] | None, int | None, int | None]:
        """Where every checkpoint before the request's bound was pruned: the oldest readable checkpoint the step
        losses reach back to stands in for the bound when the losses after it stayed at their level until an
        excursion that lasts to now; then (`_before_onset`'s choice from it, the excursion's start, its step).
        (None, None, None) otherwise: damage that began before it, or losses that do not reach it, leave the
        refusal as it was, and so does a stand-in whose learning rates are over the configured ones: with no
        checkpoint from before it to compare with, a raised rate (the commonest cause of divergence) would be
        restored with it. An operator's answer minutes late asks past the kept checkpoints (the fault campaign's
        loop-off arm), while the checkpoint before the damage is still on disk."""
        if not steps:
            return None, None, None
        paths = self._history.paths()
        configured = {"scheduler": {"base_lrs": [self.cfg.optim.lr] * len(self.scheduler.base_lrs)}}
        for step in sorted(s for s in paths if s >= steps[0] - 1):  # its next step's loss is in the history
            if (state := self._read_passed(step, paths[step])) is None:
                continue
            if rate_raised(state, configured):
                return None, None, None
            found, onset = self._before_onset((step, paths[step], state), steps, losses, window)
            return (found, onset, step) if onset is not None else (None, None, None)
        return None, None, None

    def _rollback_source(self, request: RollbackRequest) -> tuple[tuple[int, Path, dict[str, Any]] | None, str]:
        """(step, path, state) of the first readable checkpoint of this run's history in the request's order (the
        newest before its step, `RollbackRequest.checkpoint_order`; where its lookback reaches past this process's
        first step, the newest written before that moment, also by the process before a restart), or (None, why
        not)."""
        paths = self._history.paths()
        order = request.checkpoint_order(paths)
        if request.from_start and request.before_time is not None:  # the newest written before the lookback's moment
            earlier = self._history.written_before(request.before_time, request.checkpoint_bound)
            order = earlier + [step for step in order if step not in earlier]
        for step in order:
            if paths[step].is_file() and (state := self._read_passed(step, paths[step])) is not None:
                return (step, paths[step], state), ""
        known = ", ".join(str(s) for s in self._history.steps()) or "none"
        where = self.checkpoints.directory
        bound = request.checkpoint_bound
        return None, f"no readable checkpoint of this run before step {bound} in {where} (history: {known})"

    def _read_passed(self, step: int, path: Path) -> dict[str, Any] | None:
        """The checkpoint the history passed at `step`, or None (logged) if it is unreadable or another branch of the
        run wrote over it since."""
        try:
            state = read_checkpoint(path)
        except CheckpointError as exc:
            logger.warning("%s; rollback tries another", exc)
            return None
        if not self._history.holds(step, state):
            logger.warning("checkpoint %s was written over by another branch of this run; rollback tries another", path)
            return None
        return state

    def _skip_due(self) -> SkipRecord | None:
        """The recorded window that starts at the run's step and data position now, if any."""
        if not self.skips:  # every step asks: nothing to build when no rollback happened
            return None
        here = (self.step, self.epoch, self.sample_in_epoch)
        return next((record for record in self.skips if record.key == here), None)

    def _replay_skips(self) -> None:
        """Skip the recorded window whose checkpoint step and data position the run is at now."""
        record = self._skip_due()
        if record is not None:
            self._advance(record.batches)
            if record.lr_factor < 1.0:
                scale_learning_rates(self.optimizer, self.scheduler, record.lr_factor)
            self.monitor.inc("skipped_batches_total", record.batches)
            self.log.event("skip", step=self.step, batches=record.batches, from_epoch=record.epoch,
                           from_sample=record.sample, to_epoch=self.epoch, to_sample=self.sample_in_epoch,
                           lr_factor=record.lr_factor, reason=record.reason)  # fmt: skip
            logger.warning("rank %d skips %d batches of data after step %d (rollback: %s); now at epoch %d sample %d",
                           self.rt.rank, record.batches, self.step, record.reason, self.epoch,
                           self.sample_in_epoch)  # fmt: skip

    def reduce_micro_batch(self, reason: str) -> MicroBatchChange:
        """Checkpoint, then halve the micro-batch and double accumulation from the next step on."""
        before = (self.micro_batch, self.accumulation)
        if self.micro_batch % 2 or self.micro_batch // 2 < 2:
            raise ActionUnavailable(
                f"the micro-batch of {self.micro_batch} samples cannot be halved (the contrastive loss needs at "
                "least 2 per micro-batch, and an odd size would change the global batch)"
            )
        self.save_checkpoint(reason)  # the state before the change (a failure is counted; memory comes first)
        self._set_micro_batch(self.micro_batch // 2, self.accumulation * 2)
        self.log.event("micro_batch", step=self.step, micro_batch=self.micro_batch, accumulation=self.accumulation,
                       reason=reason)  # fmt: skip
        return MicroBatchChange(self.micro_batch, self.accumulation, *before)

    def _control_channel(self) -> ControlChannel | None:
        if not self.cfg.control.enabled:
            return None
        # A `restart` in flight and its stacks are kept beside the checkpoints unless configured elsewhere.
        control = dataclasses.replace(self.cfg.control, state_dir=self.cfg.control.state_dir or self.cfg.checkpoint.dir)
        return ControlChannel(control, self.monitor, optimizer=self.optimizer, scheduler=self.scheduler)

    # --- precision and teardown -----------------------------------------------------------------

    def _amp_dtype(self) -> torch.dtype | None:
        amp = self.cfg.run.amp
        if amp == "off":
            return None
        if self.rt.device.type != "cuda":
            if self.rt.is_main:
                logger.warning("run.amp=%s needs a CUDA device; training in float32 on %s", amp, self.rt.device)
            return None
        return torch.float16 if amp == "fp16" else torch.bfloat16

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.amp_dtype)

    def close(self) -> None:
        """Stop serving and leave the process group (local: no collectives)."""
        channel = getattr(self, "channel", None)  # None when start-up failed before it existed
        if channel is not None:
            channel.close()
            self.log.actions(channel.queue.snapshot()["recent"])  # a stop is settled by close()
        self.monitor.close()
        self.rt.close()
