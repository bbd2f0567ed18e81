"""A process group that a `restart` (torchrun --max-restarts) can start again (docs/hangs.md).

torchrun's agent keeps one TCPStore for every restart round (the static rendezvous always; c10d when it
shares its store, the default), and the ``env://`` rendezvous that ``init_process_group`` uses by default adds
no per-attempt prefix to its keys. A rank of a restarted group can then read a peer's address left by the
attempt that exited and fail to connect ("Gloo connectFullMesh failed ... Connection refused"): a race that
ends the job instead of resuming it, seen under torchrun 2.14.1 with gloo. Keys of this attempt only avoid it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

__all__ = ["attempt_store", "init_restartable_process_group"]

#: torch's own default timeout for a process group (NCCL and gloo alike).
DEFAULT_TIMEOUT = timedelta(minutes=30)


def attempt_store(timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[Any, int, int]:
    """torchrun's ``env://`` store (MASTER_ADDR/PORT, RANK, WORLD_SIZE) with keys of this attempt only
    (``TORCHELASTIC_RESTART_COUNT``), and this rank and the world size: what `init_process_group` takes as
    ``store``, ``rank`` and ``world_size``."""
    import torch.distributed as dist

    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"rankscope/attempt_{attempt}", store), rank, world_size


def init_restartable_process_group(backend: str, timeout: timedelta = DEFAULT_TIMEOUT, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, ...)`` under torchrun, on `attempt_store`: call it before
    your Trainer (Lightning and accelerate use a group that already exists) or in place of your loop's own call.
    Other keyword arguments (``device_id``, ``pg_options``) go to ``init_process_group``."""
    import torch.distributed as dist

    store, rank, world_size = attempt_store(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
