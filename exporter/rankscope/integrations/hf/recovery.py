"""The `rollback` action for the Hugging Face Trainer callback, on the Trainer's own `checkpoint-<N>` directories.

The user guide (what a rollback does, the data position, resuming a run that rolled back) is
docs/integrations.md, "Rollback under the Hugging Face Trainer".
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rankscope._files import write_atomically
from rankscope.control.lr import scale_learning_rates
from rankscope.control.recovery import ActionUnavailable, RollbackDone, RollbackRequest

__all__ = [
    "POSITION_FILE",
    "RECORD_FILE",
    "ROLLED_BACK_DIR",
    "TrainerRecovery",
    "micro_batch_unavailable",
    "read_position",
]

logger = logging.getLogger("rankscope")

#: In `args.output_dir`: the rollbacks of the run, a JSON list appended to at each one.
RECORD_FILE = "rankscope-rollbacks.json"
#: In each `checkpoint-<N>`: {"global_step": N, "data_steps": batches of data consumed by then}.
POSITION_FILE = "rankscope.json"
#: In `args.output_dir`: where the checkpoints of an abandoned trajectory are moved.
ROLLED_BACK_DIR = "rankscope-rolled-back"

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
#: What the rollback uses of the Trainer beyond its public API (present in transformers 4.4x to 5.x).
_TRAINER_METHODS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
_TRAINER_ATTRIBUTES = ("_globalstep_last_logged", "_tr_loss")


def micro_batch_unavailable(args: Any, state: Any) -> str:
    """Why `reduce_micro_batch` cannot be done from a Trainer callback (one line, under the channel's 200 characters).

    The Trainer builds its DataLoader once per train() call (its batch size fixed), accelerate's loader
    already holds the next batch at on_step_end, and `_run_epoch` counts micro-batches against
    gradient_accumulation_steps in its own local variables (`step`, `steps_in_epoch`): changing either
    mid-run would make the next optimizer step mix micro-batch sizes or accumulate the wrong number."""
    batch = int(state.train_batch_size or args.per_device_train_batch_size)
    accumulation = int(args.gradient_accumulation_steps)
    if batch < 2 or batch % 2:
        return f"a micro-batch of {batch} cannot be halved into equal micro-batches"
    return (
        f"transformers.Trainer builds its DataLoader (batch {batch}) once per train() and counts micro-batches in "
        f"its loop: restart with per_device_train_batch_size={batch // 2}, gradient_accumulation_steps="
        f"{2 * accumulation}"
    )


def read_position(checkpoint: str) -> int | None:
    """The data position (batches consumed) recorded in a checkpoint directory; None if it has no record."""
    try:
        with open(os.path.join(checkpoint, POSITION_FILE), encoding="utf-8") as handle:
            return int(json.load(handle)["data_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class _Plan:
    """What a rollback will do; every process computes its own and all must be equal."""

    checkpoint: str
    step: int
    data_from: int
    """Batches of data consumed when the checkpoint was written."""
    skip: int
    """Batches skipped after the checkpoint: those trained since it plus `extra`."""
    extra: int
    here: int
    """Micro-batches dropped from the epoch being iterated."""
    carry: int
    """Micro-batches dropped at the start of the next epoch."""
    abandoned: tuple[str, ...] = ()

    def summary(self) -> tuple[int, int, int, int]:
        return self.step, self.skip, self.here, self.carry


@dataclass
class TrainerRecovery:
    """The callback's rollback state: the data position and the data skips it set (one per callback)."""

    trainer: Any
    monitor: Any
    lr_floor: float = 0.0
    data_steps: int = 0
    """Batches of data consumed so far: trained, plus skipped by rollbacks."""
    _epoch_micro: int = 0
    """Micro-batches the Trainer took from this epoch's iterator."""
    _epoch_dropped: int = 0
    """Micro-batches of this epoch's iterator dropped by a skip set here."""
    _next_epoch_skip: int = 0
    _loader: Any = None
    """The Trainer's train DataLoader (each epoch iterates it, except the first of a resume it fast-forwards)."""
    _skipping: list[Any] = field(default_factory=list)
    """Data loaders whose skip_batches was set here (put back to 0 at the next epoch)."""

    # --- Trainer events (called by the callback) -----------------------------------------------------------------

    def train_begin(self, args: Any, state: Any, train_dataloader: Any) -> None:
        """Where the data is at the start of train(): 0, or the resumed checkpoint's position (see the module doc)."""
        resumed = int(state.global_step)
        self.data_steps = resumed
        self._loader = train_dataloader
        if resumed == 0:
            return
        recorded = read_position(os.path.join(args.output_dir, f"checkpoint-{resumed}"))
        per_epoch = _steps_per_epoch(train_dataloader, args.gradient_accumulation_steps)
        if not args.ignore_data_skip:
            if recorded is not None and recorded != resumed:
                logger.warning(
                    "rankscope: resumed at step %d from data position %d: the Trainer fast-forwards only %d batches, "
                    "so batches %d-%d, which the run had skipped or trained already, are trained on again; resume "
                    "with TrainingArguments(ignore_data_skip=True) to let rankscope continue at %d",
                    resumed, recorded, resumed, resumed, recorded - 1, recorded,
                )  # fmt: skip
            return
        if per_epoch is None:
            return
        epoch_start = (resumed // per_epoch) * per_epoch
        if recorded is None or recorded == resumed:
            # ignore_data_skip where no rollback skipped data: the user's choice stands, the data is not moved.
            self.data_steps = epoch_start
            return
        if not _can_drop(train_dataloader):
            logger.warning(
                "rankscope: cannot move the resumed run's data to position %d: the Trainer's data loader (%s) "
                "cannot drop batches", recorded, type(train_dataloader).__name__,
            )  # fmt: skip
            self.data_steps = epoch_start
            return
        target = recorded
        if recorded // per_epoch != resumed // per_epoch:
            logger.warning(
                "rankscope: resumed at step %d from data position %d, in a later epoch than the Trainer starts: the "
                "data moves to position %d instead, so batches %d-%d, which the run had skipped or trained already, "
                "are trained on again", resumed, recorded, resumed, resumed, recorded - 1,
            )  # fmt: skip
            target = resumed
        micro = (target - epoch_start) * args.gradient_accumulation_steps
        problem = _unaligned(len(train_dataloader), args.gradient_accumulation_steps) if micro else None
        if problem:
            logger.warning("rankscope: cannot move the resumed run's data to position %d: %s", target, problem)
            self.data_steps = epoch_start
            return
        self._next_epoch_skip = micro
        self.data_steps = target

    def epoch_begin(self, train_dataloader: Any) -> None:
        """Before the Trainer iterates the epoch: undo this run's skips, then start with any carried over."""
        for loader in self._skipping:
            loader.skip_batches = 0
        self._skipping.clear()
        self._epoch_micro = self._epoch_dropped = 0
        self._loader = train_dataloader
        if self._next_epoch_skip and _can_drop(train_dataloader):
            train_dataloader.skip_batches = self._next_epoch_skip
            self._skipping.append(train_dataloader)
            self._epoch_dropped = self._next_epoch_skip
        self._next_epoch_skip = 0

    def micro_batch_done(self) -> None:
        self._epoch_micro += 1

    def step_done(self) -> None:
        self.data_steps += 1

    def saved(self, args: Any, state: Any) -> None:
        """After the Trainer wrote checkpoint-<step>: record its data position beside it."""
        if not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            _write_json(
                os.path.join(folder, POSITION_FILE), {"global_step": state.global_step, "data_steps": self.data_steps}
            )

    # --- the action ---------------------------------------------------------------------------------------------

    def rollback(
        self, request: RollbackRequest, args: Any, state: Any, control: Any, saving: bool, stopping: bool
    ) -> RollbackDone:
        """Carry out `request` on this process (see the module doc); `saving` / `stopping`: a checkpoint or a stop
        was asked at this boundary too. Raises ActionUnavailable, with nothing changed and the same reason on every
        process, when it cannot be done."""
        try:
            plan = self._plan(request, args)
        except Exception as exc:  # every process must reach the agreement below, whatever happened here
            plan = f"{type(exc).__name__}: {exc}"
        plan = self._agreed(plan)
        left = int(state.global_step)
        self._load(plan, request, state, control, saving, stopping)
        record = {
            "time": time.time(),
            "step": left,
            "checkpoint": os.path.basename(plan.checkpoint),
            "checkpoint_step": plan.step,
            "incident_step": request.incident_step,
            "skipped_batches": plan.skip,
            "data_from": plan.data_from,
            "data_to": plan.data_from + plan.skip,
            "lr_factor": request.lr_factor,
            "reason": request.reason,
        }
        if args.should_save:
            self._write_record(args.output_dir, record, plan.abandoned, left)
        detail = (
            f"from step {left}; the {plan.skip} batches after data position {plan.data_from} skipped "
            f"({plan.skip - plan.extra} trained and dropped, {plan.extra} never trained)"
        )
        logger.warning(
            "rankscope: rank %d rolled back from step %d to %s, skipping %d batches of data (%s)",
            args.process_index, left, plan.checkpoint, plan.skip, request.reason,
        )  # fmt: skip
        return RollbackDone(plan.step, os.path.basename(plan.checkpoint), plan.skip, detail)

    def _plan(self, request: RollbackRequest, args: Any) -> _Plan | str:
        """This process's plan, or why it cannot roll back. Reads files only: changes nothing."""
        trainer = self.trainer
        if trainer is None:
            return "rollback needs the Trainer: add the callback with RankscopeCallback.attach(trainer)"
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
            return "rollback is not supported under DeepSpeed or FSDP (their checkpoints load through the engine)"
        if args.save_only_model:
            return "the Trainer's checkpoints hold no optimizer state (save_only_model=True): nothing to roll back to"
        missing = [n for n in _TRAINER_METHODS + _TRAINER_ATTRIBUTES if not hasattr(trainer, n)]
        if missing:
            return f"this transformers.Trainer has no {', '.join(missing)}: rollback cannot load its checkpoints"
        found = _checkpoints(args.output_dir)
        order = request.checkpoint_order(found)
        if not order:
            return f"no checkpoint-<N> with N < {request.checkpoint_bound} in {args.output_dir}"
        step = order[0]
        path = os.path.join(args.output_dir, f"checkpoint-{step}")
        names = set(os.listdir(path))
        if not names & set(_WEIGHTS) or not {"optimizer.pt", "scheduler.pt"} <= names:
            return f"{path} lacks model weights, optimizer.pt or scheduler.pt"
        data_from = read_position(path)
        data_from = step if data_from is None else data_from
        trained = self.data_steps - data_from
        if trained < 0:
            return f"{path} records data position {data_from}, beyond this run's {self.data_steps}"
        asked = request.window(step, trained_batches=trained)
        if request.skip_batches is not None and asked < trained:
            return (
                f"skip_batches={asked} is less than the {trained} batches trained since checkpoint-{step}, "
                "which the Trainer cannot replay"
            )
        extra = max(asked, trained) - trained
        placed = self._place(extra, args.gradient_accumulation_steps) if extra else (0, 0)
        if isinstance(placed, str):
            return placed
        abandoned = tuple(f"checkpoint-{s}" for s in found if s > step)  # found is in step order
        return _Plan(path, step, data_from, trained + extra, extra, *placed, abandoned=abandoned)

    def _place(self, extra: int, accumulation: int) -> tuple[int, int] | str:
        """Where `extra` batches are dropped: (micro-batches in this epoch, at the start of the next)."""
        loader = _active_loader()
        if not _can_drop(loader) or not _can_drop(self._loader) or loader.dataset is not self._loader.dataset:
            return f"the Trainer's data loader ({type(loader).__name__}) cannot drop batches; ask skip_batches=0"
        passed = self._epoch_micro + self._epoch_dropped
        remaining = len(loader) - passed
        here_steps = min(extra, math.ceil(remaining / accumulation))
        here = min(here_steps * accumulation, remaining)
        carry = (extra - here_steps) * accumulation
        length = len(self._loader)
        if carry >= length:
            return f"skipping {extra} more batches reaches past the next epoch ({length} micro-batches)"
        ends_inside = carry > 0 or here < remaining
        problem = _unaligned(length, accumulation) if ends_inside else None
        return problem or (here, carry)

    def _agreed(self, plan: _Plan | str) -> _Plan:
        """Every process's plan must be the same; else ActionUnavailable on every process alike."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            mine = plan if isinstance(plan, str) else plan.summary()
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            for rank, theirs in enumerate(every):
                if isinstance(theirs, str):
                    raise ActionUnavailable(f"rank {rank}: {theirs}")
            if len(set(every)) > 1:
                seen = ", ".join(f"rank {r}: checkpoint-{s[0]}, skip {s[1]}" for r, s in enumerate(every))
                raise ActionUnavailable(f"the processes disagree on the rollback ({seen})")
        if isinstance(plan, str):
            raise ActionUnavailable(plan)
        return plan

    def _load(
        self, plan: _Plan, request: RollbackRequest, state: Any, control: Any, saving: bool, stopping: bool
    ) -> None:
        """Load the checkpoint into the live run and move the data on. A failure from here on is "failed"."""
        trainer = self.trainer
        trainer._load_from_checkpoint(plan.checkpoint)
        trainer._load_optimizer_and_scheduler(plan.checkpoint)
        trainer._load_scaler(plan.checkpoint)
        trainer._load_rng_state(plan.checkpoint)
        if request.lr_factor != 1.0:
            optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            scale_learning_rates(optimizer, trainer.lr_scheduler, request.lr_factor, self.lr_floor)
        at_the_end = control.should_training_stop and state.global_step >= state.max_steps and not stopping
        state.global_step = plan.step
        # The loss summed since the last log belongs to dropped steps; logging restarts at the checkpoint.
        trainer._globalstep_last_logged = plan.step
        with torch.no_grad():
            trainer._tr_loss.zero_()
        control.should_log = False
        if not saving:  # the Trainer's own save of the dropped step would rewrite checkpoint-N
            control.should_save = False
        if at_the_end and plan.step < state.max_steps:
            control.should_training_stop = False  # set for max_steps, which the run is below again
        best = getattr(state, "best_global_step", None)
        if best is not None and best > plan.step:  # the best checkpoint is moved away with the abandoned ones
            state.best_global_step = state.best_metric = state.best_model_checkpoint = None
        if plan.here:
            loader = _active_loader()
            loader.skip_batches = self._epoch_micro + self._epoch_dropped + plan.here
            self._epoch_dropped += plan.here
            self._skipping.append(loader)
        self._next_epoch_skip = plan.carry
        self.data_steps = plan.data_from + plan.skip
        if self.monitor is not None:
            self.monitor.set_step(plan.step)
            self.monitor.inc("skipped_batches_total", plan.skip)

    def _write_record(self, output_dir: str, record: dict[str, Any], abandoned: tuple[str, ...], left: int) -> None:
        """Append the rollback to RECORD_FILE and move the abandoned checkpoints away (main process).

        A failure here is logged, not raised: the live run has rolled back already."""
        path = os.path.join(output_dir, RECORD_FILE)
        try:
            records = _read_records(path)
        except ValueError as exc:
            logger.error("rankscope: %s; the rollback is not recorded there: %s", exc, json.dumps(record))
            records = None
        number = len(records or []) + 1
        if abandoned:
            target = os.path.join(output_dir, ROLLED_BACK_DIR, f"rollback-{number}-at-step-{left}")
            record["abandoned"] = {"moved_to": target, "checkpoints": list(abandoned)}
            for name in abandoned:
                try:
                    os.makedirs(target, exist_ok=True)
                    os.replace(os.path.join(output_dir, name), os.path.join(target, name))
                except FileNotFoundError:
                    pass  # another node's main process moved it already (save_on_each_node on shared storage)
                except OSError as exc:
                    logger.error("rankscope: could not move abandoned %s out of %s: %s", name, output_dir, exc)
        if records is not None:
            try:
                _write_json(path, [*records, record])
            except OSError as exc:
                logger.error("rankscope: cannot write %s: %s; the rollback: %s", path, exc, json.dumps(record))


def _checkpoints(output_dir: str) -> list[int]:
    """The steps of the Trainer's checkpoint-<N> directories in `output_dir`."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = (_CHECKPOINT.fullmatch(name) for name in names)
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(output_dir, m.group(0))))


def _active_loader() -> Any:
    """The accelerate data loader whose iterator is running now: during training, the epoch's."""
    from accelerate.state import GradientState

    return GradientState().active_dataloader


def _can_drop(loader: Any) -> bool:
    """An accelerate DataLoaderShard reads `skip_batches` before each batch it yields: setting it drops batches."""
    from accelerate.data_loader import DataLoaderShard

    return isinstance(loader, DataLoaderShard)


def _steps_per_epoch(train_dataloader: Any, accumulation: int) -> int | None:
    """Optimizer steps per epoch, as the Trainer counts them; None for a loader without a length."""
    try:
        length = len(train_dataloader)
    except TypeError:
        return None
    return math.ceil(length / accumulation)


def _unaligned(length: int, accumulation: int) -> str | None:
    """Why a skip ending inside an epoch of `length` micro-batches would leave its last step untaken, or None."""
    if accumulation > 1 and length % accumulation:
        return (
            f"an epoch of {length} micro-batches is not a multiple of gradient_accumulation_steps={accumulation}: "
            "after a skip the Trainer would not take its last, short step"
        )
    return None


def _read_records(path: str) -> list[Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            records = json.load(handle)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable ({exc})") from None
    if not isinstance(records, list):
        raise ValueError(f"{path} does not hold a JSON list")
    return records


def _write_json(path: str, document: Any) -> None:
    text = json.dumps(document, indent=1)
    write_atomically(Path(path), lambda handle: handle.write(text.encode()))
