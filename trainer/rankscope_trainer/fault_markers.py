"""Which injected faults a job has already fired: one small file per fired fault, kept across restarts.

A restarted group replays the steps after its checkpoint; a fault that fired in them must not fire again
(rankscope_trainer.faults). The rank that fires a fault first writes a marker,
`<dir>/<name>.rank<R>.<lineage>.json`, atomically (temporary file, fsync, rename, fsync of the
directory), so a marker is either complete or absent, even after kill -9 or a power loss:

    {"name": "crash-step25", "kind": "crash", "step": 25, "rank": 1, "time": 1764820000.123,
     "lineage": "3f2a9c1b", "run_id": "0b6f...", "attempt": 0, "host": "node-1", "pid": 4242}

A marker belongs to the job that wrote it: a run resumed from a checkpoint continues its lineage
(rankscope_trainer.checkpoint), and torchrun's restarts of one launch share its TORCHELASTIC_RUN_ID, so a
marker counts for this job when either matches. A fresh run in the same directory (a new lineage, a new
launch) starts with no fault fired. A launch whose run id is torchrun's default "none" (static rendezvous
without --rdzv-id) is matched by lineage alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from rankscope._files import write_atomically

__all__ = ["FaultMarkers"]

logger = logging.getLogger("rankscope_trainer")

#: torchrun's run id when none was given: every such launch shares it, so it names no job.
_NO_RUN_ID = ("", "none")


class FaultMarkers:
    """The fault markers of one job in `directory` (None: kept in memory only, for this process)."""

    def __init__(self, directory: str | Path | None, lineage: str = "", run_id: str | None = None) -> None:
        self.directory = Path(directory) if directory else None
        self.lineage = lineage
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID", "") if run_id is None else run_id
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def fired(self) -> set[str]:
        """Names of the faults any rank of this job has fired (read now: call it before the first step)."""
        if self.directory is None or not self.directory.is_dir():
            return set()
        names = set()
        for path in sorted(self.directory.glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                logger.warning("fault marker %s is unreadable, ignored: %s", path, exc)
                continue
            if isinstance(record, dict) and self._ours(record) and isinstance(record.get("name"), str):
                names.add(record["name"])
        return names

    def _ours(self, record: dict[str, Any]) -> bool:
        if self.lineage and record.get("lineage") == self.lineage:
            return True
        return self.run_id not in _NO_RUN_ID and record.get("run_id") == self.run_id

    def record(self, name: str, kind: str, step: int, rank: int) -> dict[str, Any]:
        """Write the marker of fault `name` fired by `rank` at `step` (durable before it returns); the record."""
        record = {
            "name": name, "kind": kind, "step": step, "rank": rank, "time": round(time.time(), 3),
            "lineage": self.lineage, "run_id": self.run_id, "attempt": self.attempt,
            "host": socket.gethostname(), "pid": os.getpid(),
        }  # fmt: skip
        if self.directory is not None:
            path = self.directory / f"{name}.rank{rank}.{self.lineage or 'nolineage'}.json"
            text = json.dumps(record, sort_keys=True) + "\n"
            write_atomically(path, lambda handle: handle.write(text.encode()), sync_directory=True)
        return record
