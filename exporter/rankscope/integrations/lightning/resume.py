"""Which checkpoint a restarted Lightning run resumes from (the `restart` action, docs/hangs.md)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["newest_checkpoint"]


def newest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The newest `*.ckpt` in `directory`, or None when there is none (or no such directory).

    rankscope's control checkpoints (`rankscope-step=<N>.ckpt`) and ModelCheckpoint's alike, each a file or
    the folder of a distributed checkpoint (then its `.metadata`, written last, dates it; a folder without
    one is an unfinished write and is passed over). Pass the result as `trainer.fit(..., ckpt_path=...)`
    when the run was restarted: Lightning's `ckpt_path="last"` looks only for ModelCheckpoint's `last*.ckpt`,
    so it never finds a checkpoint rankscope wrote."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    dated: list[tuple[float, str]] = []
    for path in folder.glob("*.ckpt"):
        marker = path / ".metadata" if path.is_dir() else path
        if marker.is_file():
            dated.append((marker.stat().st_mtime, str(path)))
    return max(dated)[1] if dated else None
