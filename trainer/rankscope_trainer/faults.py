"""Fault injection: real failures, switched on at a chosen step, for tests and demos.

Each switch is off while its `at_step` is 0. Steps are the 1-based global
step being trained. `rank: -1` means every rank.

    faults:
      diverge:        {at_step: 200, lr_factor: 300}        # learning rate blown up -> loss spikes, divergence
      nonfinite:      {at_step: 50, steps: 2, rank: 0}      # loss becomes NaN -> rankscope_nonfinite_steps_total
      memory_balloon: {at_step: 20, rank: 1, bytes: 2000000000, step_bytes: 100000000}  # host memory -> RSS
      straggler:      {at_step: 10, rank: 1, seconds: 0.2}  # slow rank -> its compute_duration_seconds
      slow_data:      {at_step: 10, rank: 0, seconds: 0.2}  # slow loader -> its data_wait_seconds
      crash:          {at_step: 30, rank: 1}                # os._exit -> rank down; torchrun restarts the group
      poison:         {at_batch: 300, batches: 60}          # a stretch of mislabelled data -> loss diverges
      hang:           {at_step: 40, rank: 1, kind: data}    # rank blocks for ever -> RankscopeRankHung, restart
      slow_checkpoint: {at_step: 20, seconds: 5}            # one save takes 5 s longer -> goodput's checkpoint time

What each one does, and the signal it leaves:

* diverge: from `at_step` on, every learning rate (and the scheduler's base
  rates, so the schedule keeps the factor) is multiplied by `lr_factor`. Loss
  and gradient norm climb: `rankscope_loss_spikes_total`, `rankscope_learning_rate`.
* nonfinite: for `steps` steps from `at_step`, the rank's loss is made NaN
  before backward; the NaN reaches every rank through the all-reduce.
  `rankscope_nonfinite_steps_total` (and `skipped_steps_total` with
  `metrics.skip_nonfinite`).
* memory_balloon: from `at_step`, the rank allocates host memory (touched,
  so it is resident) `step_bytes` per step (0 = all at once) until it holds
  `bytes`, and keeps it. `rankscope_process_resident_memory_bytes`,
  `rankscope_host_memory_used_ratio`.
* straggler: from `at_step`, the rank spends `seconds` more per step between
  forward and backward, sleeping (`mode: sleep`) or multiplying matrices
  (`mode: compute`, a real busy CPU/GPU). Its `compute_duration_seconds`
  grows; the other ranks wait in `comm_duration_seconds`.
* slow_data: from `at_step`, the rank's next batch is delivered `seconds`
  late, as from slow storage. Its `data_wait_seconds` grows (the others wait
  in communication).
* crash: at `at_step`, the rank exits at once with `exit_code` (no cleanup,
  like a segfault or an OOM kill). Only on the first attempt: torchrun sets
  TORCHELASTIC_RESTART_COUNT, and a restarted group (`--max-restarts`) resumes
  from the last checkpoint without crashing again.
* poison: a stretch of bad data, not of steps: the `batches` batches of the
  rank's data stream from batch `at_batch` on (1-based; one batch = one
  optimizer step's data, counted across epochs and resumes) have their
  captions scrambled (each image paired with the next sample's caption), as
  from a broken shard. The loss spikes and diverges while they are trained
  on; a `rollback` that skips them leaves training clean again, because the
  fault follows the data position, not the step.
* hang: at `at_step` (first attempt only, as `crash`), the rank blocks for ever,
  as a hung rank of a large job does, in one of three places (`kind`):
  `data`: its data loader never delivers the step's batch (a worker
  deadlock, a read that never returns); `compute`: it never leaves the
  step's forward (a wedged device); `collective`: it leaves the step's
  gradient all-reduce out (as a rank that took another branch) and blocks
  after its backward, so every other rank waits in the all-reduce it never
  entered and its collective count lags theirs. (It blocks rather than
  issuing its next collective: gloo aborts a process whose collectives
  mismatch, which is a crash, not a hang.) In the first two kinds the other
  ranks wait in the step's all-reduce. `RankscopeRankHung` names the rank and its phase, and
  its `restart` action gets the group training again from the newest
  checkpoint (`torchrun --max-restarts`).
* slow_checkpoint: the first checkpoint saved at or after `at_step` takes
  `seconds` longer (first attempt only, as `crash`), as on a slow or contended filesystem: rank 0 writes the
  file that much later and every rank waits for it inside the save (the
  `checkpoint` phase). The save's printed duration and
  `rankscope_checkpoint_duration_seconds` include it; goodput counts it as
  checkpoint time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["FaultInjector", "FaultsConfig"]

logger = logging.getLogger("rankscope_trainer")


def _check(condition: bool, message: str) -> None:
    # ValueError (not rankscope_trainer.config.ConfigError) to keep this module free of the config module;
    # build_section turns it into a ConfigError with the same text.
    if not condition:
        raise ValueError(message)


def _check_common(name: str, at_step: int, rank: int, switch: str = "at_step") -> None:
    _check(at_step >= 0, f"faults.{name}.{switch} must be >= 0 (0 = off), got {at_step}")
    _check(rank >= -1, f"faults.{name}.rank must be >= -1 (-1 = every rank), got {rank}")


@dataclass
class DivergeFault:
    at_step: int = 0
    """Step from which the learning rate is multiplied (0 = off)."""
    lr_factor: float = 100.0
    """Factor applied to every learning rate."""

    def __post_init__(self) -> None:
        _check_common("diverge", self.at_step, -1)
        _check(self.lr_factor > 0, f"faults.diverge.lr_factor must be > 0, got {self.lr_factor}")


@dataclass
class NonfiniteFault:
    at_step: int = 0
    """First step whose loss becomes NaN (0 = off)."""
    steps: int = 1
    """Number of consecutive NaN steps."""
    rank: int = -1
    """Rank whose loss becomes NaN (-1 = every rank)."""

    def __post_init__(self) -> None:
        _check_common("nonfinite", self.at_step, self.rank)
        _check(self.steps >= 1, f"faults.nonfinite.steps must be >= 1, got {self.steps}")


@dataclass
class MemoryBalloonFault:
    at_step: int = 0
    """Step from which host memory is allocated (0 = off)."""
    rank: int = -1
    """Rank that allocates (-1 = every rank)."""
    bytes: int = 0
    """Total bytes to allocate and hold."""
    step_bytes: int = 0
    """Bytes added per step until `bytes` is reached (0 = all at once)."""

    def __post_init__(self) -> None:
        _check_common("memory_balloon", self.at_step, self.rank)
        _check(self.bytes >= 0, f"faults.memory_balloon.bytes must be >= 0, got {self.bytes}")
        _check(self.step_bytes >= 0, f"faults.memory_balloon.step_bytes must be >= 0, got {self.step_bytes}")
        _check(self.at_step == 0 or self.bytes > 0, "faults.memory_balloon.bytes must be > 0 when the balloon is on")


@dataclass
class StragglerFault:
    at_step: int = 0
    """Step from which the rank is slow (0 = off)."""
    rank: int = 1
    """The slow rank (-1 = every rank)."""
    seconds: float = 0.2
    """Extra time per step."""
    mode: str = "sleep"
    """sleep, or compute (busy matrix multiplications for `seconds`)."""

    def __post_init__(self) -> None:
        _check_common("straggler", self.at_step, self.rank)
        _check(self.seconds >= 0, f"faults.straggler.seconds must be >= 0, got {self.seconds}")
        _check(self.mode in ("sleep", "compute"), f"faults.straggler.mode must be sleep or compute, got {self.mode!r}")


@dataclass
class SlowDataFault:
    at_step: int = 0
    """Step from which batches arrive late (0 = off)."""
    rank: int = 0
    """The rank with the slow loader (-1 = every rank)."""
    seconds: float = 0.2
    """Delay per batch."""

    def __post_init__(self) -> None:
        _check_common("slow_data", self.at_step, self.rank)
        _check(self.seconds >= 0, f"faults.slow_data.seconds must be >= 0, got {self.seconds}")


@dataclass
class CrashFault:
    at_step: int = 0
    """Step at which the rank exits (0 = off)."""
    rank: int = 1
    """The rank that crashes (-1 = every rank)."""
    exit_code: int = 13
    """Exit status of the crashed process."""

    def __post_init__(self) -> None:
        _check_common("crash", self.at_step, self.rank)
        _check(1 <= self.exit_code <= 255, f"faults.crash.exit_code must be in 1..255, got {self.exit_code}")


@dataclass
class PoisonFault:
    at_batch: int = 0
    """First poisoned batch of the data stream, 1-based (0 = off)."""
    batches: int = 50
    """How many consecutive batches are poisoned."""
    rank: int = -1
    """Rank whose data is poisoned (-1 = every rank)."""

    def __post_init__(self) -> None:
        _check_common("poison", self.at_batch, self.rank, "at_batch")
        _check(self.batches >= 1, f"faults.poison.batches must be >= 1, got {self.batches}")

    @property
    def at_step(self) -> int:
        # The on/off switch every fault shares (FaultsConfig.active): this one is on from a data batch.
        return self.at_batch


#: Where faults.hang blocks its rank.
HANG_KINDS = ("data", "compute", "collective")


@dataclass
class HangFault:
    at_step: int = 0
    """Step at which the rank hangs (0 = off); the first attempt only."""
    rank: int = 1
    """The rank that hangs (-1 = every rank)."""
    kind: str = "data"
    """Where: data (the loader never delivers), compute (the forward never ends), collective (it skips the
    step's all-reduce and waits in the next collective)."""

    def __post_init__(self) -> None:
        _check_common("hang", self.at_step, self.rank)
        _check(self.kind in HANG_KINDS, f"faults.hang.kind must be one of {', '.join(HANG_KINDS)}, got {self.kind!r}")


@dataclass
class SlowCheckpointFault:
    at_step: int = 0
    """The first checkpoint saved at or after this step is the slow one (0 = off)."""
    seconds: float = 5.0
    """How much longer that save takes."""

    def __post_init__(self) -> None:
        _check_common("slow_checkpoint", self.at_step, -1)
        _check(self.seconds >= 0, f"faults.slow_checkpoint.seconds must be >= 0, got {self.seconds}")


@dataclass
class FaultsConfig:
    """Fault switches (all off by default). See the module docstring."""

    diverge: DivergeFault = field(default_factory=DivergeFault)
    nonfinite: NonfiniteFault = field(default_factory=NonfiniteFault)
    memory_balloon: MemoryBalloonFault = field(default_factory=MemoryBalloonFault)
    straggler: StragglerFault = field(default_factory=StragglerFault)
    slow_data: SlowDataFault = field(default_factory=SlowDataFault)
    crash: CrashFault = field(default_factory=CrashFault)
    poison: PoisonFault = field(default_factory=PoisonFault)
    hang: HangFault = field(default_factory=HangFault)
    slow_checkpoint: SlowCheckpointFault = field(default_factory=SlowCheckpointFault)

    def active(self) -> list[str]:
        """Names of the switches that are on."""
        return [name for name in self.__dataclass_fields__ if getattr(self, name).at_step > 0]


class FaultInjector:
    """Applies the configured faults for one rank. The loop calls each hook at its place."""

    def __init__(self, config: FaultsConfig, rank: int, restart_count: int | None = None) -> None:
        self.config = config
        self.rank = rank
        self.restart_count = (
            restart_count if restart_count is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        )
        self._balloon: list[torch.Tensor] = []
        self._balloon_bytes = 0
        self._announced: set[str] = set()

    def _mine(self, name: str, rank: int) -> bool:
        return getattr(self.config, name).at_step > 0 and rank in (-1, self.rank)

    def _announce(self, name: str, step: int, detail: str) -> None:
        if name not in self._announced:
            self._announced.add(name)
            logger.warning("fault injection: %s on rank %d from step %d (%s)", name, self.rank, step, detail)

    # --- hooks, in the order the loop calls them ------------------------------------

    def slow_data(self, batches: Iterable[Any], next_step: Callable[[], int]) -> Iterator[Any]:
        """Wrap the batch iterator; delays delivery on the slow rank (inside the monitor's data timing)."""
        fault = self.config.slow_data
        for batch in batches:
            step = next_step()
            if self._hangs("data", step):
                _hang_in_data_loader()
            if self._mine("slow_data", fault.rank) and step >= fault.at_step:
                self._announce("slow_data", step, f"{fault.seconds}s per batch")
                time.sleep(fault.seconds)
            yield batch

    def at_step_start(self, step: int, optimizer: Any, scheduler: Any) -> None:
        """Crash, memory balloon and divergence act at the start of a step."""
        crash = self.config.crash
        if self._mine("crash", crash.rank) and step == crash.at_step and self.restart_count == 0:
            logger.error("fault injection: rank %d crashes at step %d (exit %d)", self.rank, step, crash.exit_code)
            logging.shutdown()
            os._exit(crash.exit_code)
        balloon = self.config.memory_balloon
        if self._mine("memory_balloon", balloon.rank) and step >= balloon.at_step:
            self._grow_balloon(balloon, step)
        diverge = self.config.diverge
        if diverge.at_step > 0 and step == diverge.at_step:
            # Every rank scales alike (the replicas must stay identical); base_lrs too, or the
            # LambdaLR schedule would undo it at the next scheduler step.
            self._announce("diverge", step, f"learning rate x{diverge.lr_factor}")
            for group in optimizer.param_groups:
                group["lr"] *= diverge.lr_factor
            scheduler.base_lrs = [lr * diverge.lr_factor for lr in scheduler.base_lrs]

    def after_forward(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Straggler delay and NaN loss, between forward and backward (inside compute time)."""
        if self._hangs("compute", step):
            _hang_in_compute()
        straggler = self.config.straggler
        if self._mine("straggler", straggler.rank) and step >= straggler.at_step:
            self._announce("straggler", step, f"+{straggler.seconds}s per step ({straggler.mode})")
            _spend(straggler.seconds, straggler.mode, loss.device)
        nonfinite = self.config.nonfinite
        if self._mine("nonfinite", nonfinite.rank) and nonfinite.at_step <= step < nonfinite.at_step + nonfinite.steps:
            self._announce("nonfinite", step, f"{nonfinite.steps} step(s)")
            # Multiplied, not added: backward runs and every gradient becomes NaN, as after a real
            # overflow, and the all-reduce carries the NaN to every rank.
            loss = loss * float("nan")
        return loss

    def skips_collective(self, step: int) -> bool:
        """Whether this rank leaves the step's gradient all-reduce out (faults.hang, kind collective); it then
        blocks in `after_backward`."""
        return self._hangs("collective", step)

    def after_backward(self, step: int) -> None:
        """The rank that skipped the step's all-reduce waits elsewhere, for ever."""
        hang = self.config.hang
        mine = hang.kind == "collective" and step == hang.at_step and self._mine("hang", hang.rank)
        if mine and not self.restart_count:
            _hang_outside_the_collective()

    def _hangs(self, kind: str, step: int) -> bool:
        hang = self.config.hang
        if not (self._mine("hang", hang.rank) and hang.kind == kind and step == hang.at_step):
            return False
        if self.restart_count:
            return False  # a restarted group trains on, as after a real fault that a restart cleared
        logger.error("fault injection: rank %d hangs at step %d (%s)", self.rank, step, kind)
        return True

    def slow_checkpoint(self, step: int, state_fn: Callable[[], Any]) -> Callable[[], Any]:
        """`state_fn`, slowed by `seconds` if this is the slow save (rank 0 calls it, inside the save)."""
        fault = self.config.slow_checkpoint
        if not (fault.at_step and step >= fault.at_step and "slow_checkpoint" not in self._announced):
            return state_fn
        if self.restart_count:
            return state_fn  # a restarted group saves at normal speed, as after crash and hang
        self._announce("slow_checkpoint", step, f"+{fault.seconds}s writing the checkpoint")

        def slowed() -> Any:
            time.sleep(fault.seconds)  # the filesystem's delay: a real wait, as a slow write is
            return state_fn()

        return slowed

    def poison(self, data_batch: int, micro_batches: list[Any]) -> list[Any]:
        """The step's micro-batches, captions scrambled if `data_batch` (1-based) is in the poisoned stretch."""
        fault = self.config.poison
        if not (self._mine("poison", fault.rank) and fault.at_batch <= data_batch < fault.at_batch + fault.batches):
            return micro_batches
        self._announce("poison", data_batch, f"{fault.batches} batches of scrambled captions from data batch")
        return [_scrambled(batch) for batch in micro_batches]

    def _grow_balloon(self, balloon: MemoryBalloonFault, step: int) -> None:
        missing = balloon.bytes - self._balloon_bytes
        if missing <= 0:
            return
        chunk = min(missing, balloon.step_bytes) if balloon.step_bytes else missing
        self._announce("memory_balloon", step, f"{balloon.bytes} bytes")
        # torch.ones writes every page, so the memory is resident, not just reserved.
        self._balloon.append(torch.ones(chunk, dtype=torch.uint8))
        self._balloon_bytes += chunk


def _hang_in_data_loader() -> None:
    """Wait for a batch that never comes: the frame a hung rank's stacks show (issue 26)."""
    threading.Event().wait()


def _hang_outside_the_collective() -> None:
    """A rank that skipped the all-reduce its peers wait in: the frame its stacks show."""
    threading.Event().wait()


def _hang_in_compute() -> None:
    """A forward that never ends, as on a wedged device: the frame a hung rank's stacks show."""
    while True:
        time.sleep(1.0)


def _scrambled(batch: Any) -> Any:
    """The batch with every caption moved to the next image (deterministic: the RNG is not touched)."""
    roll = {name: torch.roll(getattr(batch, name), 1, dims=0) for name in ("input_ids", "attention_mask", "lengths")}
    return replace(batch, **roll)


def _spend(seconds: float, mode: str, device: torch.device) -> None:
    if seconds <= 0:
        return
    if mode == "sleep":
        time.sleep(seconds)
        return
    deadline = time.perf_counter() + seconds
    # Constant input: the global RNG stays untouched, so the loss curve is the same as without the fault.
    matrix = torch.full((256, 256), 0.01, device=device)
    while time.perf_counter() < deadline:
        matrix = torch.tanh(matrix @ matrix)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
