"""Atomic checkpoints, kept K deep, and choosing one to resume from.

Files are `<dir>/step_XXXXXXXX.pt`. A write goes to a temporary file in the
same directory, is fsynced, then renamed over the final name (and the
directory fsynced), so a file with a final name is always complete: a kill
during the write leaves only a temporary file, removed by the next save.

Under DDP the model is replicated, so rank 0 writes; every rank takes part,
because each rank's RNG state is gathered into the file (exact resume) and
because every rank must wait until the file exists before going on. All of
them record the checkpoint with `exporter.control.record_checkpoint`
(`rankscope_checkpoints_total{reason}` with the reason's kind as label:
interval, alert, operator, stop, final; the free text such as
"alert:HostMemoryHigh" is stored in the file): use max by run, not sum.

`--resume auto` takes the newest readable checkpoint; a truncated or corrupt
one is reported in one line and skipped for the one before it.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from exporter.control import record_checkpoint

from .runtime import Runtime, get_rng_state

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "Checkpointer",
    "checkpoint_path",
    "list_checkpoints",
    "read_checkpoint",
    "write_atomically",
]

logger = logging.getLogger("trainer")

CHECKPOINT_FORMAT = 1
_REQUIRED = ("format", "step", "epoch", "batch_in_epoch", "model", "optimizer", "scheduler", "rng", "tokenizer")
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (one line: which file, what is wrong)."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoint files (final names only), newest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found, reverse=True)]


def write_atomically(state: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file, fsync, rename over `path`, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power loss
    finally:
        os.close(directory)


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


class Checkpointer:
    """Saves and finds checkpoints for one run. `save` and `load` are collective: every rank calls them."""

    def __init__(self, directory: str | Path, keep: int, runtime: Runtime, monitor: Any) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.runtime = runtime
        self.monitor = monitor
        self.last_step: int | None = None
        self.last_path: Path | None = None

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]], reason: str) -> Path | None:
        """Write the checkpoint of `step` (state from `state_fn`, called on rank 0 only).

        Returns the path, or None if rank 0 could not write it (logged on every rank; training goes on).
        """
        started = time.perf_counter()
        # Every rank's RNG state goes into the file, so each rank resumes its own stream.
        rng_states = self.runtime.gather_objects(get_rng_state())
        path = checkpoint_path(self.directory, step)
        error = None
        if self.runtime.is_main:
            try:
                state = state_fn()
                state.update(rng=rng_states, reason=reason, saved_at=time.time())
                write_atomically(state, path)
                self._prune()
            except Exception as exc:
                error = f"checkpoint {path} ({reason}) failed: {' '.join(str(exc).split())[:200]}"
        # Doubles as the barrier: nobody goes on before the file exists (or has failed).
        error = self.runtime.broadcast_object(error)
        if error:
            logger.error("%s; training goes on", error)
            return None
        seconds = time.perf_counter() - started
        record_checkpoint(self.monitor, reason, seconds)
        self.last_step, self.last_path = step, path
        if self.runtime.is_main:
            logger.info("checkpoint step %d -> %s (%s, %.2fs)", step, path, reason, seconds)
        return path

    def _prune(self) -> None:
        for old in list_checkpoints(self.directory)[self.keep :]:
            old.unlink(missing_ok=True)
        for stale in self.directory.glob(".step_*.tmp"):  # left by a writer that was killed mid-write
            stale.unlink(missing_ok=True)

    def load(self, resume: str) -> tuple[Path, dict[str, Any]] | None:
        """`none`: None. `auto`: the newest readable checkpoint, or None if there is none. Else a path.

        Rank 0 chooses (so every rank resumes from the same file); every rank then reads it.
        """
        if resume == "none":
            return None
        if resume != "auto":
            return Path(resume), read_checkpoint(resume)
        chosen: str | None = None
        state: dict[str, Any] | None = None
        if self.runtime.is_main:
            for candidate in list_checkpoints(self.directory):
                try:
                    state = read_checkpoint(candidate)
                except CheckpointError as exc:
                    logger.warning("%s; trying the previous one", exc)
                    continue
                chosen = str(candidate)
                break
            if chosen is None:
                logger.info("no usable checkpoint in %s; starting from step 0", self.directory)
        chosen = self.runtime.broadcast_object(chosen)
        if chosen is None:
            return None
        if state is None:
            state = read_checkpoint(chosen)
        return Path(chosen), state
