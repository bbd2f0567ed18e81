"""Process-level setup: process group, device, seeds, and RNG state for exact resume.

Backend follows the device: NCCL for CUDA, gloo for CPU. Under torchrun the
group's store keys are scoped to the restart attempt (see `_attempt_store`).
Launched without torchrun (no WORLD_SIZE), the trainer still forms a one-rank
group (through a file store, no port needed), so the loop has a single code path.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rankscope.control.rendezvous import init_restartable_process_group

from rankscope_trainer.config import ConfigError

__all__ = ["Runtime", "get_rng_state", "seed_everything", "set_rng_state"]

logger = logging.getLogger("rankscope_trainer")


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    _store_file: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device: str, timeout_seconds: int, threads: int = 0) -> Runtime:
        """Pick the device, join (or form) the process group. Collective under torchrun."""
        if threads:
            torch.set_num_threads(threads)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda and not torch.cuda.is_available():
            raise ConfigError("run.device is cuda, but no CUDA device is available (use auto or cpu)")
        if use_cuda:
            chosen = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(chosen)
        else:
            chosen = torch.device("cpu")
        backend = "nccl" if use_cuda else "gloo"
        timeout = timedelta(seconds=timeout_seconds)
        store_file = None
        if "WORLD_SIZE" in os.environ:
            # On this attempt's own store keys, so a group restarted by torchrun can connect again.
            init_restartable_process_group(backend, timeout, device_id=chosen if use_cuda else None)
        else:
            handle, store_file = tempfile.mkstemp(prefix="rankscope-store-")
            os.close(handle)
            os.unlink(store_file)  # FileStore wants to create it
            dist.init_process_group(backend, init_method=f"file://{store_file}", rank=0, world_size=1, timeout=timeout)
        runtime = cls(dist.get_rank(), local_rank, dist.get_world_size(), chosen, backend, store_file)
        logger.info("rank %d/%d on %s (backend %s)", runtime.rank, runtime.world_size, chosen, backend)
        return runtime

    def barrier(self) -> None:
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, on every rank (pickled; for small things only)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._store_file:
            for path in (self._store_file, self._store_file + ".lock"):
                if os.path.exists(path):
                    os.unlink(path)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """This process's RNG states in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # the tuple form (the default)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    # random.setstate wants tuples all the way down; a loaded checkpoint may hold lists.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
