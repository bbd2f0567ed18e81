"""The checkpoints a run's current history passed through: what a rollback may load.

A rollback goes back along the line the model actually trained, never onto a branch an earlier rollback
abandoned: after one, the kept line writes its checkpoints under the same names (`step_N-LINEAGE.pt`) as the
abandoned branch did. Every checkpoint carries the line before it (each file's name and write time), so a
process resumed from a checkpoint, after a restart or a preemption, can still roll back past the step it
resumed at. A recorded file whose write time no longer matches was written over by another branch since, and
is passed over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope_trainer.checkpoint import CHECKPOINT_NAME

__all__ = ["CheckpointHistory", "PassedCheckpoint"]

logger = logging.getLogger("rankscope_trainer")


@dataclass(frozen=True)
class PassedCheckpoint:
    step: int
    path: Path
    saved_at: float | None
    """The file's own `saved_at` when the line passed it; None where unknown (a checkpoint of an older trainer)."""


class CheckpointHistory:
    """The kept line's checkpoints, oldest first, at most one per step, the newest `keep` of them: the checkpointer
    keeps the newest `keep` files of the run's lineage, of which the line's are some, so an older entry names a
    pruned file (trimmed alike on every rank, unlike a look at the disk)."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self._passed: list[PassedCheckpoint] = []

    def add(self, step: int, path: Path, saved_at: float | None) -> None:
        self._passed = [p for p in self._passed if p.step != step]
        self._passed.append(PassedCheckpoint(step, Path(path), saved_at))
        del self._passed[: -self.keep]

    def resumed(self, path: Path, state: dict[str, Any]) -> None:
        """Start from the line recorded in the checkpoint resumed from (`state`, at `path`), then that checkpoint.
        The line's files are looked for beside it: a copied or moved directory resolves them in its new place."""
        self._passed = []
        step = int(state["step"])
        for passed, name, saved_at in _recorded_line(path, step, state.get("history", [])):
            self.add(passed, Path(path).parent / name, saved_at)
        self.add(step, Path(path), _float_or_none(state.get("saved_at")))

    def truncate(self, step: int) -> None:
        """Forget the checkpoints after `step`: a rollback to it leaves them on the abandoned branch."""
        self._passed = [p for p in self._passed if p.step <= step]

    def paths(self) -> dict[int, Path]:
        return {p.step: p.path for p in self._passed}

    def steps(self) -> list[int]:
        return [p.step for p in self._passed]

    def written_before(self, moment: float, bound: int) -> list[int]:
        """The steps below `bound` whose checkpoint was written before the Unix time `moment`, newest first."""
        written = [p for p in reversed(self._passed) if p.saved_at is not None and p.saved_at < moment]
        return [p.step for p in written if p.step < bound]

    def holds(self, step: int, state: dict[str, Any]) -> bool:
        """Whether `state`, read from the history's file at `step`, is the checkpoint the line passed (not one
        another branch wrote over it since)."""
        passed = next((p for p in self._passed if p.step == step), None)
        if passed is None or passed.saved_at is None:
            return passed is not None
        return _float_or_none(state.get("saved_at")) == passed.saved_at

    def to_state(self) -> list[dict[str, Any]]:
        """The line for a checkpoint's file: the checkpoints still on disk (rank 0 writes, so rank 0's view)."""
        return [{"step": p.step, "name": p.path.name, "saved_at": p.saved_at} for p in self._passed if p.path.is_file()]


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _recorded_line(path: Path, resumed_step: int, recorded: Any) -> list[tuple[int, str, float | None]]:
    """The (step, name, saved_at) entries of a checkpoint's `history`, each the file of its step before the resumed
    one; a damaged record is reported in one line and read as none (the resumed checkpoint stays usable; only
    rollbacks past it are lost)."""
    entries = []
    try:
        for item in recorded:
            step, name, saved_at = item["step"], item["name"], item.get("saved_at")
            # A checkpoint's own file name, resolved beside the checkpoint resumed from: never a path elsewhere.
            named = CHECKPOINT_NAME.match(name) if isinstance(name, str) else None
            well_formed = (
                isinstance(step, int) and not isinstance(step, bool) and named is not None
                and int(named.group(1)) == step < resumed_step
                and (saved_at is None or _float_or_none(saved_at) is not None)
            )  # fmt: skip
            if not well_formed:
                raise ValueError(f"{item!r}"[:80])
            entries.append((step, name, _float_or_none(saved_at)))
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        logger.warning("checkpoint %s has a damaged history (%s); a rollback can reach no checkpoint before it",
                       path, exc)  # fmt: skip
        return []
    return entries
