"""Which data a rollback skipped, kept so that a resumed run skips the same batches.

A rollback loads a checkpoint and then skips a window of the data stream that followed it. The
window is a *record*: at the checkpoint's step and data position, move on by `batches` batches (one
batch = one optimizer step's data on each rank) and multiply the learning rates by `lr_factor`. The
loop applies every record whose step and position it reaches, so a run resumed from that same
checkpoint later skips exactly what the rolled-back run skipped.

Records travel in two places: in every later checkpoint (`state["skips"]`), and in a file beside the
checkpoints, `skips-<lineage>.json`, written at the rollback, because the checkpoint rolled back to
was written before the rollback and cannot hold it. A second rollback to the same checkpoint replaces
the first one's record: the latest decision is the one a resume reproduces.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rankscope._files import write_atomically

__all__ = ["SkipRecord", "merge_skips", "read_skip_file", "skip_file", "write_skip_file"]


@dataclass(frozen=True)
class SkipRecord:
    checkpoint_step: int
    """The step of the checkpoint rolled back to (the record applies at this step)."""
    epoch: int
    sample: int
    """The data position the checkpoint resumes at: epoch and samples into it, per rank."""
    batches: int
    """Batches skipped from there."""
    lr_factor: float = 1.0
    incident_step: int = 0
    rolled_back_from: int = 0
    """The step the run was at when it rolled back."""
    reason: str = ""
    lookahead: int = 0
    """Of `batches`, those after the default window that the restored model found bad (`lookahead`)."""

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.checkpoint_step, self.epoch, self.sample)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SkipRecord:
        return cls(
            int(data["checkpoint_step"]),
            int(data["epoch"]),
            int(data["sample"]),
            int(data["batches"]),
            float(data.get("lr_factor", 1.0)),
            int(data.get("incident_step", 0)),
            int(data.get("rolled_back_from", 0)),
            str(data.get("reason", "")),
            int(data.get("lookahead", 0)),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def merge_skips(*sources: list[SkipRecord]) -> list[SkipRecord]:
    """One record per (step, position): a later source (or a later record) replaces an earlier one."""
    merged: dict[tuple[int, int, int], SkipRecord] = {}
    for source in sources:
        for record in source:
            merged.pop(record.key, None)
            merged[record.key] = record
    return list(merged.values())


def skip_file(directory: str | Path, lineage: str) -> Path:
    return Path(directory) / f"skips-{lineage}.json"


def read_skip_file(directory: str | Path, lineage: str) -> list[SkipRecord]:
    """The lineage's records; [] if there is no file. ValueError (one line) if it is damaged."""
    path = skip_file(directory, lineage)
    if not path.is_file():
        return []
    try:
        return [SkipRecord.from_json(item) for item in json.loads(path.read_text(encoding="utf-8"))]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"rollback record {path} is unreadable ({type(exc).__name__}: {exc})") from None


def write_skip_file(directory: str | Path, lineage: str, records: list[SkipRecord]) -> Path:
    """Write the lineage's records atomically (temporary file, fsync, rename)."""
    path = skip_file(directory, lineage)
    text = json.dumps([record.to_json() for record in records], indent=1)
    write_atomically(path, lambda handle: handle.write(text.encode()))
    return path
