"""Atomic checkpoints that are never lost, and choosing one to resume from.

Files are `<dir>/step_XXXXXXXX-LINEAGE.pt`. A *lineage* is one run and its resumptions: a run that
starts fresh gets a new random lineage id; a run resumed from a checkpoint continues that
checkpoint's lineage. Pruning keeps the newest `keep` complete checkpoints of the run's own lineage
and removes only older ones of that lineage: never a checkpoint of another run sharing the directory,
never one with a higher step than the run has reached (a newer one), never a file it cannot
recognise (older names `step_XXXXXXXX.pt` included). A file that is not a complete archive (empty,
truncated, garbage) is never counted as one of the kept.

A write goes to a temporary file in the same directory, is fsynced, then renamed over the final name
(and the directory fsynced), so a file with a final name is always complete: a kill during the write
leaves only a temporary file, removed by the lineage's next save.

Under DDP the model is replicated, so rank 0 writes; every rank takes part, because each rank's RNG
state is gathered into the file (exact resume) and because every rank must wait until the file
exists before going on. All of them record the outcome: `rankscope_checkpoints_total{reason}`
(interval, alert, operator, stop, final; the free text such as "alert:HostMemoryHigh" is stored in
the file: use max by run, not sum) or `rankscope_checkpoint_failures_total{reason}` (no_space,
permission, io_error, other), and `failures` remembers each failure so the run can fail at its end.

`--resume auto` takes the most recently written readable checkpoint in the directory (of whichever
run: "auto" continues what ran there last); a truncated or corrupt one is reported in one line and
skipped for the one before it. The directory is checked for writing at start.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rankscope._files import write_atomically as write_file_atomically
from rankscope.control import record_checkpoint, record_checkpoint_failure

from rankscope_trainer.runtime import Runtime, get_rng_state

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "CheckpointError",
    "CheckpointFile",
    "Checkpointer",
    "checkpoint_path",
    "list_checkpoints",
    "read_checkpoint",
    "write_atomically",
]

logger = logging.getLogger("rankscope_trainer")

CHECKPOINT_FORMAT = 1
_REQUIRED = ("format", "step", "epoch", "batch_in_epoch", "model", "optimizer", "scheduler", "rng", "tokenizer")
#: A checkpoint's final file name: its step, then its lineage (none in the older names).
CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})(?:-([0-9a-f]{8}))?\.pt$")
_LINEAGE = re.compile(r"^[0-9a-f]{8}$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used or written (one line: which file or directory, what is wrong)."""


@dataclass(frozen=True)
class CheckpointFile:
    """A file with a checkpoint's final name."""

    path: Path
    step: int
    lineage: str | None
    """None for the older `step_XXXXXXXX.pt` names: no run prunes those."""
    written_ns: int


def checkpoint_path(directory: str | Path, step: int, lineage: str | None = None) -> Path:
    suffix = f"-{lineage}" if lineage else ""
    return Path(directory) / f"step_{step:08d}{suffix}.pt"


def new_lineage() -> str:
    return secrets.token_hex(4)


def checkpoint_files(directory: str | Path) -> list[CheckpointFile]:
    """Files with a checkpoint's final name, most recently written first (then highest step)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match is None:
            continue
        try:
            stat = path.stat()
        except OSError:
            continue  # removed meanwhile (another run pruning its own)
        if path.is_file():
            found.append(CheckpointFile(path, int(match.group(1)), match.group(2), stat.st_mtime_ns))
    return sorted(found, key=lambda f: (f.written_ns, f.step), reverse=True)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Paths of the checkpoint files, most recently written first."""
    return [f.path for f in checkpoint_files(directory)]


def write_atomically(state: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file, fsync, rename over `path`, fsync the directory."""
    write_file_atomically(path, lambda handle: torch.save(state, handle), sync_directory=True)


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and sanity-check a checkpoint. CheckpointError (one line) if truncated, corrupt or foreign."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        # weights_only: a checkpoint is data (tensors, numbers, strings), never code to run.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged zip or pickle
        detail = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt: {detail})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a rankscope checkpoint (holds {type(state).__name__})")
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a rankscope checkpoint (missing {', '.join(missing)})")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {state['format']}, this trainer reads {CHECKPOINT_FORMAT}")
    return state


def check_writable(directory: Path) -> None:
    """Create `directory` if needed and write, fsync and remove a probe file in it; CheckpointError if not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-check.", suffix=".tmp")
        try:
            os.write(fd, b"rankscope")
            os.fsync(fd)
        finally:
            os.close(fd)
            Path(probe).unlink(missing_ok=True)
    except OSError as exc:
        raise CheckpointError(f"checkpoint.dir {directory} is not writable: {exc.strerror or exc}") from None


def _state_bytes(state: Any) -> int:
    """Roughly what a state takes on disk: the bytes of its tensors."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _mib(count: float) -> str:
    return f"{count / 2**20:.1f} MiB"


def classify_failure(exc: BaseException, directory: Path, needed_bytes: int) -> tuple[str, str]:
    """(reason label, one-line description) of a failed write. torch's zip writer reports a full disk as
    "unexpected pos ..." without an errno, so the free space is looked at too."""
    code = getattr(exc, "errno", None)
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = None
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < needed_bytes):
        where = f"{_mib(free)} free on {directory}" if free is not None else f"on {directory}"
        return "no_space", f"no space left on device ({where}; this checkpoint needs about {_mib(needed_bytes)})"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission", f"not allowed to write in {directory}: {os.strerror(code)}"
    detail = " ".join(str(exc).split())[:200]
    if isinstance(exc, OSError):
        return "io_error", detail
    return "other", f"{type(exc).__name__}: {detail}"


class Checkpointer:
    """Saves and finds checkpoints for one run. The constructor, `save` and `load` are collective."""

    def __init__(self, directory: str | Path, keep: int, runtime: Runtime, monitor: Any) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.runtime = runtime
        self.monitor = monitor
        self.lineage = new_lineage()
        """This run's lineage id: new for a fresh start, the checkpoint's own after `load`."""
        self.last_step: int | None = None
        self.last_path: Path | None = None
        self.last_saved_at: float | None = None
        """The `saved_at` written into the last checkpoint (every rank holds rank 0's): names that very file."""
        self.failures: list[str] = []
        """One line per failed save, in order (every rank holds the same list)."""
        record_checkpoint_failure(self.monitor, None)  # the counters exist at 0 before any failure
        error = None
        if runtime.is_main:
            try:
                check_writable(self.directory)
            except CheckpointError as exc:
                error = str(exc)
        error = self.runtime.broadcast_object(error)
        if error:
            raise CheckpointError(error)
        # Rank 0 writes and names the files: every rank must hold its lineage (paths, rollback, skip records).
        self.lineage = self.runtime.broadcast_object(self.lineage)

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]], reason: str) -> Path | None:
        """Write the checkpoint of `step` (state from `state_fn`, called on rank 0 only).

        Returns the path, or None if rank 0 could not write it (logged, counted and remembered in
        `failures` on every rank; training goes on)."""
        started = time.perf_counter()
        # Every rank's RNG state goes into the file, so each rank resumes its own stream.
        rng_states = self.runtime.gather_objects(get_rng_state())
        path = checkpoint_path(self.directory, step, self.lineage)
        failure, saved_at = None, None
        if self.runtime.is_main:
            state: dict[str, Any] = {}
            try:
                state = state_fn()
                saved_at = time.time()
                state.update(rng=rng_states, reason=reason, saved_at=saved_at, lineage=self.lineage)
                write_atomically(state, path)
            except Exception as exc:
                label, description = classify_failure(exc, self.directory, _state_bytes(state))
                failure = (label, f"checkpoint {path} ({reason}) failed: {description}")
            else:
                self._prune(step, path)
        # Doubles as the barrier: nobody goes on before the file exists (or has failed).
        failure, saved_at = self.runtime.broadcast_object((failure, saved_at))
        if failure:
            label, message = failure
            record_checkpoint_failure(self.monitor, label)
            self.failures.append(message)
            logger.error("%s; training goes on, and the run will exit with an error", message)
            return None
        seconds = time.perf_counter() - started
        record_checkpoint(self.monitor, reason, seconds)
        self.last_step, self.last_path, self.last_saved_at = step, path, saved_at
        if self.runtime.is_main:
            logger.info("checkpoint step %d -> %s (%s, %.2fs)", step, path, reason, seconds)
        return path

    def _prune(self, step: int, written: Path) -> None:
        """Remove this lineage's checkpoints older than the newest `keep` complete ones (rank 0).

        Only files of this lineage with a step below `step` are candidates; a newer or foreign file is
        never touched, and a file that is not a complete archive never counts as kept."""
        mine = sorted(
            (f for f in checkpoint_files(self.directory) if f.lineage == self.lineage and f.path != written),
            key=lambda f: f.step,
            reverse=True,
        )
        kept = 1  # the one just written
        for candidate in mine:
            if candidate.step >= step:
                continue  # a higher step of this lineage (written before a rollback): newer, kept
            if kept < self.keep and zipfile.is_zipfile(candidate.path):
                kept += 1
                continue
            candidate.path.unlink(missing_ok=True)
        # Left by a writer of this lineage that was killed mid-write (another run's are not ours).
        for stale in self.directory.glob(f".step_*-{self.lineage}.pt.*.tmp"):
            stale.unlink(missing_ok=True)

    def load(self, resume: str) -> tuple[Path, dict[str, Any]] | None:
        """`none`: None. `auto`: the most recently written readable checkpoint, or None if there is none.
        Else a path. Continuing from a checkpoint continues its lineage.

        Rank 0 chooses (so every rank resumes from the same file); every rank then reads it.
        """
        if resume == "none":
            return None
        if resume != "auto":
            given = read_checkpoint(resume)
            self._continue(given)
            return Path(resume), given
        chosen: str | None = None
        state: dict[str, Any] | None = None
        if self.runtime.is_main:
            for candidate in checkpoint_files(self.directory):
                try:
                    state = read_checkpoint(candidate.path)
                except CheckpointError as exc:
                    logger.warning("%s; trying the previous one", exc)
                    continue
                chosen = str(candidate.path)
                break
            if chosen is None:
                logger.info("no usable checkpoint in %s; starting from step 0", self.directory)
        chosen = self.runtime.broadcast_object(chosen)
        if chosen is None:
            return None
        if state is None:
            state = read_checkpoint(chosen)
        self._continue(state)
        return Path(chosen), state

    def _continue(self, state: dict[str, Any]) -> None:
        lineage = state.get("lineage")
        if isinstance(lineage, str) and _LINEAGE.match(lineage):
            self.lineage = lineage
        # Rank 0 writes; its lineage is the one every rank must hold.
        self.lineage = self.runtime.broadcast_object(self.lineage)
