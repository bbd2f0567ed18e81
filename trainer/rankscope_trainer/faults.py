"""Fault injection: real failures at chosen steps, for tests, demos and fault campaigns.

Steps are the 1-based global step being trained. `rank: -1` means every rank.
One switch per kind (off while its `at_step` is 0):

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

and a schedule, any number of faults of any kind, each `{kind: <kind>, <that kind's fields>}` (the
hang's own place is `where`, as `kind` names the fault):

    faults:
      schedule:
        - {kind: nonfinite, at_step: 40, steps: 3, rank: 0}
        - {kind: straggler, at_step: 100, until_step: 160, rank: 1, seconds: 0.3}
        - {kind: hang, at_step: 220, rank: 1, where: data}
        - {kind: crash, at_step: 300, rank: 0, exit_code: 9}
        - {kind: hang, at_step: 380, rank: 0, where: collective}
      state_dir: ""   # where fired faults are marked ("" = faults/ in checkpoint.dir)

A schedule entry is checked as the switch of its kind is (errors name `faults.schedule[3].at_step`) and
must have a step (`at_step`, or `at_batch` for poison, >= 1). Two faults of one kind at one step whose
ranks overlap are refused: they would be one fault.

What each one does, and the signal it leaves:

* diverge: at `at_step`, every learning rate (and the scheduler's base
  rates, so the schedule keeps the factor) is multiplied by `lr_factor`. Loss
  and gradient norm climb: `rankscope_loss_spikes_total`, `rankscope_learning_rate`.
  The raised rate is training state: a checkpoint saved after it keeps it, so a
  group resumed from that checkpoint stays diverged (it does not recover by itself).
* nonfinite: for `steps` steps from `at_step`, the rank's loss is made NaN
  before backward; the NaN reaches every rank through the all-reduce.
  `rankscope_nonfinite_steps_total` (and `skipped_steps_total` with
  `metrics.skip_nonfinite`).
* memory_balloon: from `at_step`, the rank allocates host memory (touched,
  so it is resident) `step_bytes` per step (0 = all at once) until it holds
  `bytes`, and keeps it until `until_step` (0 = for ever), where it drops every
  tensor and asks the C allocator to hand freed memory back (glibc's
  malloc_trim). `rankscope_process_resident_memory_bytes`,
  `rankscope_host_memory_used_ratio`: RankscopeHostMemoryHigh fires once the node's
  ratio stays above its threshold for its `for`, and its action (`checkpoint`)
  saves but frees nothing; the ratio falls at `until_step` and the alert resolves.
  Under glibc, chunks of 32 MB or more are unmapped at once and malloc_trim
  returns the heap's free pages; another allocator (jemalloc, tcmalloc through
  LD_PRELOAD) may keep what it freed, so RSS may not shrink everywhere.
* straggler: from `at_step` until `until_step` (0 = for ever), the rank spends
  `seconds` more per step between forward and backward, sleeping (`mode: sleep`)
  or multiplying matrices (`mode: compute`, a real busy CPU/GPU). Its
  `compute_duration_seconds` grows; the other ranks wait in `comm_duration_seconds`.
* slow_data: from `at_step` until `until_step` (0 = for ever), the rank's next
  batch is delivered `seconds` late, as from slow storage. Its `data_wait_seconds`
  grows (the others wait in communication).
* crash: at `at_step`, the rank exits at once with `exit_code` (no cleanup,
  like a segfault or an OOM kill); torchrun (`--max-restarts`) restarts the group,
  which resumes from the newest checkpoint.
* poison: a stretch of bad data, not of steps: the `batches` batches of the
  rank's data stream from batch `at_batch` on (1-based; one batch = one
  optimizer step's data, counted across epochs and resumes) have their
  captions scrambled (each image paired with the next sample's caption), as
  from a broken shard. The loss spikes and diverges while they are trained
  on; a `rollback` that skips them leaves training clean again, because the
  fault follows the data position, not the step.
* hang: at `at_step`, the rank blocks for ever, as a hung rank of a large job
  does, in one of three places (`kind`, or `where` in a schedule):
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
  `seconds` longer, as on a slow or contended filesystem: rank 0 writes the
  file that much later and every rank waits for it inside the save (the
  `checkpoint` phase). The save's printed duration and
  `rankscope_checkpoint_duration_seconds` include it; goodput counts it as
  checkpoint time.

Once per job. A fault is an event in time: it fires at most once in the whole job, however often a
restarted, resumed or rolled-back group replays its steps. The rank that fires a fault first writes
its marker (rankscope_trainer.fault_markers: one file per fault and rank in `faults.state_dir`,
written atomically and fsynced), then logs a `fault` record in `run.log_file`, then acts. Each attempt
reads the markers once, before its first step: every rank reads, and all take the union (one
collective at start, before any rank can fire), so a fault that any rank of the job has marked acts
again on no rank. Per kind:

* crash, hang, diverge, slow_checkpoint: fire once, at their step (slow_checkpoint: at the first
  save at or after it). A restarted group trains through the step clean, as after a real fault that
  a restart cleared; a second crash or hang later in the schedule is a fault of its own and fires.
  A diverged rate survives in the checkpoints saved after it (see diverge), not by firing again.
* nonfinite, straggler, slow_data, memory_balloon: a window of steps, acted in by the process that
  fired it, each step at most once (an in-process rollback into the window does not act again on the
  steps already passed). A restart ends the window: the restarted group does not resume the
  remainder (a campaign spaces its faults so each is over before the next). A window that ends
  (`until_step`) logs a `fault_end` record.
* poison: follows the data position on purpose, so batches that are replayed stay poisoned (the data
  is bad, not the moment), and only a rollback that skips the data skips the fault. Its marker and
  `fault` record are written when it first poisons a batch, for the ground truth of when it began.

A job is a lineage of checkpoints plus one torchrun launch's restarts (see fault_markers): a fresh
run in the same directory fires every fault again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from rankscope import config_from_mapping

from rankscope_trainer.fault_markers import FaultMarkers

__all__ = ["FaultEvent", "FaultInjector", "FaultsConfig"]

logger = logging.getLogger("rankscope_trainer")


def _check(condition: bool, message: str) -> None:
    # ValueError (not rankscope_trainer.config.ConfigError) to keep this module free of the config module;
    # build_section turns it into a ConfigError with the same text.
    if not condition:
        raise ValueError(message)


def _check_common(name: str, at_step: int, rank: int, switch: str = "at_step") -> None:
    _check(at_step >= 0, f"faults.{name}.{switch} must be >= 0 (0 = off), got {at_step}")
    _check(rank >= -1, f"faults.{name}.rank must be >= -1 (-1 = every rank), got {rank}")


def _check_until(name: str, at_step: int, until_step: int) -> None:
    _check(
        until_step == 0 or until_step > at_step,
        f"faults.{name}.until_step must be 0 (never ends) or after at_step ({at_step}), got {until_step}",
    )


@dataclass
class DivergeFault:
    at_step: int = 0
    """Step at which the learning rate is multiplied (0 = off)."""
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
    until_step: int = 0
    """Step at which the memory is freed (0 = held for ever)."""

    def __post_init__(self) -> None:
        _check_common("memory_balloon", self.at_step, self.rank)
        _check(self.bytes >= 0, f"faults.memory_balloon.bytes must be >= 0, got {self.bytes}")
        _check(self.step_bytes >= 0, f"faults.memory_balloon.step_bytes must be >= 0, got {self.step_bytes}")
        _check(self.at_step == 0 or self.bytes > 0, "faults.memory_balloon.bytes must be > 0 when the balloon is on")
        _check_until("memory_balloon", self.at_step, self.until_step)


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
    until_step: int = 0
    """First step at normal speed again (0 = slow for ever)."""

    def __post_init__(self) -> None:
        _check_common("straggler", self.at_step, self.rank)
        _check(self.seconds >= 0, f"faults.straggler.seconds must be >= 0, got {self.seconds}")
        _check(self.mode in ("sleep", "compute"), f"faults.straggler.mode must be sleep or compute, got {self.mode!r}")
        _check_until("straggler", self.at_step, self.until_step)


@dataclass
class SlowDataFault:
    at_step: int = 0
    """Step from which batches arrive late (0 = off)."""
    rank: int = 0
    """The rank with the slow loader (-1 = every rank)."""
    seconds: float = 0.2
    """Delay per batch."""
    until_step: int = 0
    """First step whose batch arrives on time again (0 = slow for ever)."""

    def __post_init__(self) -> None:
        _check_common("slow_data", self.at_step, self.rank)
        _check(self.seconds >= 0, f"faults.slow_data.seconds must be >= 0, got {self.seconds}")
        _check_until("slow_data", self.at_step, self.until_step)


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
    """Step at which the rank hangs (0 = off)."""
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


#: Each kind's settings; a switch of FaultsConfig and a schedule entry's `kind`.
KINDS: dict[str, type] = {
    "diverge": DivergeFault,
    "nonfinite": NonfiniteFault,
    "memory_balloon": MemoryBalloonFault,
    "straggler": StragglerFault,
    "slow_data": SlowDataFault,
    "crash": CrashFault,
    "poison": PoisonFault,
    "hang": HangFault,
    "slow_checkpoint": SlowCheckpointFault,
}

#: Kinds that act over a window of steps ending at `until_step` (a `fault_end` record).
_LASTING = ("memory_balloon", "straggler", "slow_data")


@dataclass(frozen=True)
class FaultEvent:
    """One fault of the job: a switch that is on, or a schedule entry."""

    kind: str
    fault: Any
    source: str
    """The setting it comes from: faults.crash, faults.schedule[3]."""

    @property
    def start(self) -> int:
        """Its step (poison: its first data batch)."""
        return int(self.fault.at_step)

    @property
    def rank(self) -> int:
        """The rank it acts on (-1 = every rank); slow_checkpoint's is rank 0, which writes the file."""
        if self.kind == "slow_checkpoint":
            return 0
        return int(getattr(self.fault, "rank", -1))

    @property
    def name(self) -> str:
        """Its name in markers and log records: kind and step, unique per rank (FaultsConfig checks)."""
        return f"{self.kind}-{'batch' if self.kind == 'poison' else 'step'}{self.start}"

    @property
    def end(self) -> int | None:
        """First step (poison: batch) after its window; None = open (slow_checkpoint: until a save)."""
        fault = self.fault
        if self.kind == "nonfinite":
            return self.start + fault.steps
        if self.kind == "poison":
            return self.start + fault.batches
        if self.kind in _LASTING:
            return fault.until_step or None
        if self.kind == "slow_checkpoint":
            return None
        return self.start + 1

    def covers(self, step: int) -> bool:
        end = self.end
        return self.start <= step and (end is None or step < end)

    def describe(self) -> str:
        """Its settings in words, for the log line that says it fired."""
        fault, kind = self.fault, self.kind
        until = f" until step {fault.until_step}" if kind in _LASTING and fault.until_step else ""
        if kind == "diverge":
            return f"learning rate x{fault.lr_factor}"
        if kind == "nonfinite":
            return f"{fault.steps} step(s)"
        if kind == "memory_balloon":
            return f"{fault.bytes} bytes{until}"
        if kind == "straggler":
            return f"+{fault.seconds}s per step ({fault.mode}){until}"
        if kind == "slow_data":
            return f"{fault.seconds}s per batch{until}"
        if kind == "crash":
            return f"exit {fault.exit_code}"
        if kind == "poison":
            return f"{fault.batches} batches of scrambled captions"
        if kind == "hang":
            return f"in {fault.kind}"
        return f"+{fault.seconds}s writing the checkpoint"


def _scheduled(index: int, entry: Any) -> tuple[str, Any]:
    """(kind, settings) of schedule entry `index`, checked; errors name `faults.schedule[index].<key>`."""
    where = f"faults.schedule[{index}]"
    _check(isinstance(entry, dict), f"{where} must be a mapping with a kind, got {type(entry).__name__} {entry!r}")
    settings = dict(entry)
    kind = settings.pop("kind", None)
    _check(kind is not None, f"{where}.kind is missing: one of {', '.join(KINDS)}")
    _check(kind in KINDS, f"{where}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    known = sorted(_entry(kind, KINDS[kind]()))
    known.remove("kind")
    for key in settings:
        _check(key in known, f"unknown setting {where}.{key}; known: {', '.join(known)}")
    if kind == "hang" and "where" in settings:  # the hang's own `kind` (its place) is `where` here
        settings["kind"] = settings.pop("where")
    try:
        fault = config_from_mapping(KINDS[kind], settings, where)
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("faults.hang.kind", f"{where}.where").replace(f"faults.{kind}.", f"{where}.")
        if kind == "hang":  # a type error names the setting by its field, `kind`
            message = message.replace(f"{where}.kind", f"{where}.where")
        raise ValueError(message) from None
    switch = "at_batch" if kind == "poison" else "at_step"
    _check(fault.at_step >= 1, f"{where}.{switch} must be >= 1 (a scheduled fault has a step), got {fault.at_step}")
    return kind, fault


def _entry(kind: str, fault: Any) -> dict[str, Any]:
    """A schedule entry with every setting spelled out (what the config hash and a checkpoint keep)."""
    settings = asdict(fault)
    if kind == "hang":
        settings["where"] = settings.pop("kind")
    return {"kind": kind, **settings}


@dataclass
class FaultsConfig:
    """Fault switches and a schedule (all off by default). See the module docstring."""

    diverge: DivergeFault = field(default_factory=DivergeFault)
    nonfinite: NonfiniteFault = field(default_factory=NonfiniteFault)
    memory_balloon: MemoryBalloonFault = field(default_factory=MemoryBalloonFault)
    straggler: StragglerFault = field(default_factory=StragglerFault)
    slow_data: SlowDataFault = field(default_factory=SlowDataFault)
    crash: CrashFault = field(default_factory=CrashFault)
    poison: PoisonFault = field(default_factory=PoisonFault)
    hang: HangFault = field(default_factory=HangFault)
    slow_checkpoint: SlowCheckpointFault = field(default_factory=SlowCheckpointFault)
    schedule: list[dict[str, Any]] = field(default_factory=list)
    """Faults at chosen steps, any number of each kind: `- {kind: crash, at_step: 300, rank: 1}` (a list)."""
    state_dir: str = ""
    """Where each fired fault's marker is kept, so it fires once per job across restarts and resumes
    ("" = `faults/` in checkpoint.dir; shared by all nodes, as that is)."""

    def __post_init__(self) -> None:
        _check(
            isinstance(self.schedule, list),
            f"faults.schedule must be a list of faults, got {type(self.schedule).__name__} {self.schedule!r}",
        )
        self.schedule = [_entry(*_scheduled(index, entry)) for index, entry in enumerate(self.schedule)]
        self.events()  # refuses repeats

    def active(self) -> list[str]:
        """Names of the switches that are on."""
        return [name for name in KINDS if getattr(self, name).at_step > 0]

    def events(self) -> list[FaultEvent]:
        """Every fault of the job: the switches that are on, then the schedule's entries, in order."""
        events = [FaultEvent(name, getattr(self, name), f"faults.{name}") for name in self.active()]
        events += [FaultEvent(*_scheduled(i, entry), f"faults.schedule[{i}]") for i, entry in enumerate(self.schedule)]
        for later, event in enumerate(events):
            for earlier in events[:later]:
                same = (earlier.kind, earlier.start) == (event.kind, event.start)
                if same and (-1 in (earlier.rank, event.rank) or earlier.rank == event.rank):
                    on = "every rank" if event.rank == -1 else f"rank {event.rank}"
                    _check(False, f"{event.source} repeats {earlier.source} ({event.name} on {on}): "
                                  "give it another step or rank")  # fmt: skip
        return events


class FaultInjector:
    """Applies the job's faults for one rank. The loop calls each hook at its place.

    `markers` is the job's record of fired faults (None: this process's memory only); `fired` the names of
    the faults the job fired before (None: what `markers` holds now; the loop gives every rank the union of
    all ranks' reads); `on_fire` gets each `fault` and `fault_end` record (the run log's).
    """

    def __init__(
        self,
        config: FaultsConfig,
        rank: int,
        markers: FaultMarkers | None = None,
        on_fire: Callable[[dict[str, Any]], None] | None = None,
        fired: set[str] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.markers = markers or FaultMarkers(None)
        self.on_fire = on_fire or (lambda record: None)
        self.events = config.events()
        self._over = set(self.markers.fired() if fired is None else fired)
        """Faults this job fired before this process started: they do not act again."""
        self._acted: dict[str, int] = {}
        """Fault name -> the last step (poison: data batch) it acted at in this process."""
        self._ended: set[str] = set()
        self._balloons: dict[str, list[torch.Tensor]] = {}
        self._hang_after_backward: int | None = None

    def _of(self, kind: str) -> list[FaultEvent]:
        return [e for e in self.events if e.kind == kind and e.rank in (-1, self.rank)]

    def _acts(self, event: FaultEvent, step: int) -> bool:
        """Whether `event` acts at `step` here: in its window, not fired by an earlier attempt, and not at a
        step it already acted at (a replay after a rollback). The first time, it fires (marker, record)."""
        if event.name in self._over or not event.covers(step):
            return False
        last = self._acted.get(event.name)
        if last is not None and step <= last:
            return False
        if last is None:
            self._fire(event, step)
        self._acted[event.name] = step
        return True

    def _fire(self, event: FaultEvent, step: int) -> None:
        # The marker first: a crash or kill right after must not let a restarted group fire it again.
        marker = self.markers.record(event.name, event.kind, step, self.rank)
        unit = "data batch" if event.kind == "poison" else "step"
        logger.warning("fault injection: %s on rank %d from %s %d (%s)", event.kind, self.rank, unit, step,
                       event.describe())  # fmt: skip
        self.on_fire({"type": "fault", "kind": event.kind, "name": event.name, "step": step, "rank": self.rank,
                      "source": event.source, "attempt": marker["attempt"], "time": marker["time"]})  # fmt: skip

    def _ends(self, event: FaultEvent, step: int) -> bool:
        """Whether a lasting fault that acted here ends at `step` (once; logs a `fault_end` record)."""
        end = event.end
        if event.name not in self._acted or event.name in self._ended or end is None or step < end:
            return False
        self._ended.add(event.name)
        logger.warning("fault injection: %s on rank %d ends at step %d", event.kind, self.rank, step)
        self.on_fire({"type": "fault_end", "kind": event.kind, "name": event.name, "step": step, "rank": self.rank,
                      "source": event.source, "time": round(time.time(), 3)})  # fmt: skip
        return True

    # --- hooks, in the order the loop calls them ------------------------------------

    def slow_data(self, batches: Iterable[Any], next_step: Callable[[], int]) -> Iterator[Any]:
        """Wrap the batch iterator; delays delivery on the slow rank (inside the monitor's data timing)."""
        delay_step, delay = 0, 0.0
        for batch in batches:
            step = next_step()
            if self._hangs("data", step):
                _hang_in_data_loader()
            if step != delay_step:  # decided once per step, then every micro-batch of the step is late
                delay_step, delay = step, 0.0
                for event in self._of("slow_data"):
                    if self._acts(event, step):
                        delay += event.fault.seconds
                    else:
                        self._ends(event, step)
            if delay:
                time.sleep(delay)
            yield batch

    def at_step_start(self, step: int, optimizer: Any, scheduler: Any) -> None:
        """Crash, memory balloon and divergence act at the start of a step."""
        for event in self._of("crash"):
            if self._acts(event, step):
                code = event.fault.exit_code
                logger.error("fault injection: rank %d crashes at step %d (exit %d)", self.rank, step, code)
                logging.shutdown()
                os._exit(code)
        for event in self._of("memory_balloon"):
            if self._acts(event, step):
                self._grow_balloon(event)
            elif self._ends(event, step):
                self._free_balloon(event)
        for event in self._of("diverge"):
            if self._acts(event, step):
                # Every rank scales alike (the replicas must stay identical); base_lrs too, or the
                # LambdaLR schedule would undo it at the next scheduler step.
                factor = event.fault.lr_factor
                for group in optimizer.param_groups:
                    group["lr"] *= factor
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def after_forward(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Straggler delay and NaN loss, between forward and backward (inside compute time)."""
        if self._hangs("compute", step):
            _hang_in_compute()
        for event in self._of("straggler"):
            if self._acts(event, step):
                _spend(event.fault.seconds, event.fault.mode, loss.device)
            else:
                self._ends(event, step)
        for event in self._of("nonfinite"):
            if self._acts(event, step):
                # Multiplied, not added: backward runs and every gradient becomes NaN, as after a real
                # overflow, and the all-reduce carries the NaN to every rank.
                loss = loss * float("nan")
        return loss

    def skips_collective(self, step: int) -> bool:
        """Whether this rank leaves the step's gradient all-reduce out (a hang of kind collective); it then
        blocks in `after_backward`."""
        if self._hangs("collective", step):
            self._hang_after_backward = step
            return True
        return False

    def after_backward(self, step: int) -> None:
        """The rank that skipped the step's all-reduce waits elsewhere, for ever."""
        if self._hang_after_backward == step:
            _hang_outside_the_collective()

    def _hangs(self, kind: str, step: int) -> bool:
        for event in self._of("hang"):
            if event.fault.kind == kind and self._acts(event, step):
                logger.error("fault injection: rank %d hangs at step %d (%s)", self.rank, step, kind)
                return True
        return False

    def slow_checkpoint(self, step: int, state_fn: Callable[[], Any]) -> Callable[[], Any]:
        """`state_fn`, slowed if this is a slow save (rank 0 calls it, inside the save)."""
        due = [e for e in self._of("slow_checkpoint") if e.covers(step) and e.name not in self._over]
        if not due:
            return state_fn

        def slowed() -> Any:
            seconds = sum(e.fault.seconds for e in due if self._acts(e, step))
            self._over.update(e.name for e in due)  # the first save at or after its step only
            time.sleep(seconds)  # the filesystem's delay: a real wait, as a slow write is
            return state_fn()

        return slowed

    def poison(self, data_batch: int, micro_batches: list[Any], record: bool = True) -> list[Any]:
        """The step's micro-batches, captions scrambled if `data_batch` (1-based) is in a poisoned stretch.
        `record=False`: data looked at, not trained on (a rollback reading ahead), does not fire the fault."""
        hit = [e for e in self._of("poison") if e.covers(data_batch)]
        if not hit:
            return micro_batches
        for event in hit if record else ():  # marked and logged the first time only; the data stays bad when replayed
            if event.name not in self._over and event.name not in self._acted:
                self._fire(event, data_batch)
                self._acted[event.name] = data_batch
        return [_scrambled(batch) for batch in micro_batches]

    def _grow_balloon(self, event: FaultEvent) -> None:
        balloon: MemoryBalloonFault = event.fault
        held = self._balloons.setdefault(event.name, [])
        missing = balloon.bytes - sum(t.numel() for t in held)
        if missing <= 0:
            return
        chunk = min(missing, balloon.step_bytes) if balloon.step_bytes else missing
        # torch.ones writes every page, so the memory is resident, not just reserved.
        held.append(torch.ones(chunk, dtype=torch.uint8))

    def _free_balloon(self, event: FaultEvent) -> None:
        self._balloons.pop(event.name, None)  # the last references: the tensors are freed here
        _return_freed_memory()


def _return_freed_memory() -> None:
    """Ask glibc to hand its freed heap memory back to the OS (large chunks are unmapped anyway); elsewhere
    a no-op, and the resident size may stay up."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


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
