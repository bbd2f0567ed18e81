"""Who this process is in the job: the identity labels on every series.

Read from torchrun's environment (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE,
TORCHELASTIC_RUN_ID) with explicit overrides, so the same code works under
torchrun, under another launcher that sets these variables, or alone. A
framework that starts its own processes knows better than the environment:
Lightning's launcher (`python train.py` with `devices=2`) sets LOCAL_RANK and
WORLD_SIZE but not RANK, so the integrations pass the framework's ranks as
overrides (:meth:`RankIdentity.from_env`'s keyword arguments).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RankIdentity"]

# Label values stay short and printable: they are bounded identities, not text.
_RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


@dataclass(frozen=True)
class RankIdentity:
    """The identity of one rank of one run."""

    run_id: str
    """Stable across restarts of the same job (torchrun keeps TORCHELASTIC_RUN_ID)."""
    rank: int
    """Global rank (RANK)."""
    local_rank: int
    """Rank on this node (LOCAL_RANK); decides the metrics port."""
    world_size: int
    """Number of ranks (WORLD_SIZE)."""
    node: str
    """Host name, so a multi-node run tells its hosts apart."""
    node_rank: int = 0
    """Index of this node in the job (GROUP_RANK)."""

    def __post_init__(self) -> None:
        if not _RUN_ID_PATTERN.match(self.run_id):
            raise ValueError(
                f"run_id must be 1-64 characters of letters, digits and _.:- (it becomes a label), got {self.run_id!r}"
            )
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        run_id: str | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        node: str | None = None,
        node_rank: int | None = None,
    ) -> RankIdentity:
        """Build from torchrun's variables; keyword arguments override them.

        run_id: explicit > RANKSCOPE_RUN_ID > TORCHELASTIC_RUN_ID (unless torchrun's
        placeholder "none") > "local". Every rank must agree on it, so it is never
        generated at random here.
        """
        env = os.environ if env is None else env
        if run_id is None:
            run_id = env.get("RANKSCOPE_RUN_ID") or ""
        if not run_id:
            elastic = env.get("TORCHELASTIC_RUN_ID", "")
            run_id = elastic if elastic and elastic != "none" else "local"
        return cls(
            run_id=run_id,
            rank=_env_int(env, "RANK", 0) if rank is None else rank,
            local_rank=_env_int(env, "LOCAL_RANK", 0) if local_rank is None else local_rank,
            world_size=_env_int(env, "WORLD_SIZE", 1) if world_size is None else world_size,
            node=node or env.get("RANKSCOPE_NODE") or socket.gethostname(),
            node_rank=_env_int(env, "GROUP_RANK", _env_int(env, "NODE_RANK", 0)) if node_rank is None else node_rank,
        )

    def labels(self) -> dict[str, str]:
        """The identity labels, as on every series."""
        return {"run_id": self.run_id, "rank": str(self.rank), "local_rank": str(self.local_rank), "node": self.node}
