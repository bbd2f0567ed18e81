"""Prometheus file-based service discovery for a run's ranks.

Every rank tells rank 0 where its metrics live (one all_gather_object, once at
start); rank 0 writes the target file atomically so Prometheus never reads a
half-written file. Target labels (run_id, rank, local_rank, node) give the
`up` series of each rank the same identity as its metrics, which the
rank-down alert needs.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rankscope._files import write_atomically

__all__ = ["write_file_sd"]


def write_file_sd(monitor: Any, path: str | os.PathLike[str], advertise_host: str | None = None) -> list[dict]:
    """Collective when distributed: every rank must call it. Rank 0 writes `path`.

    `advertise_host` is the address Prometheus should use for this rank
    (default: the bind address, or the host name when bound to all interfaces).
    """
    if monitor.port is None:
        raise RuntimeError("write_file_sd needs a started monitor (call monitor.start() first)")
    host = advertise_host or monitor.config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    mine = {"targets": [f"{host}:{monitor.port}"], "labels": monitor.identity.labels()}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if monitor.identity.rank == 0:
        _write_atomically(Path(path), json.dumps(gathered, indent=2) + "\n")
    return gathered


def _write_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda handle: handle.write(text.encode()))
