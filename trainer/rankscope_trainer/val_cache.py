"""The validation set's batches, read once and then kept in host memory when they fit.

Every validation goes over the same samples in the same order (an unshuffled sampler, deterministic
transforms), yet a DataLoader renders or decodes every image again each time: half of each validation's time in
a 1-rank profile over the fault campaign's 1024 synthetic samples (a third, in steps' worth, in its 2-rank arm),
time the goodput ledger rightly counts against the run. The first
complete pass keeps the collated batches; later passes hand out those same batches, so every validation loss is
the one a fresh read gives (tests/test_trainer_val_cache.py compares whole runs). A rank's shard over the limit,
or a pass that met a bad sample (its file may be mended by the next validation), is read every time, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # data.py builds these around its loader
    from rankscope_trainer.data import Batch

__all__ = ["CachedBatches", "batch_bytes"]

logger = logging.getLogger("rankscope_trainer")


def batch_bytes(batch: Batch) -> int:
    """Host memory held by a collated batch's tensors."""
    tensors = (batch.images, batch.input_ids, batch.attention_mask, batch.lengths, batch.sizes)
    return sum(t.numel() * t.element_size() for t in tensors)


class CachedBatches:
    """Iterates `loader` until one complete pass of at most `limit_bytes` without a bad sample is kept; then
    iterates the kept batches. `limit_bytes` 0: never keeps. A pass left early (a caller that needs only its
    first batches) keeps nothing."""

    def __init__(self, loader: Iterable[Batch], limit_bytes: int, announce: bool = False) -> None:
        self.loader = loader
        self.limit_bytes = limit_bytes
        self.announce = announce
        """Log one line when the batches are kept (the main rank)."""
        self._kept: list[Batch] | None = None

    @property
    def kept(self) -> bool:
        return self._kept is not None

    def __iter__(self) -> Iterator[Batch]:
        if self._kept is not None:
            yield from self._kept
            return
        keeping: list[Batch] | None = [] if self.limit_bytes > 0 else None
        size = 0
        for batch in self.loader:
            if keeping is not None:
                size += batch_bytes(batch)
                if batch.bad or size > self.limit_bytes:
                    keeping = None
                else:
                    keeping.append(batch)
            yield batch
        if keeping is not None:  # reached only when the caller took every batch
            self._kept = keeping
            if self.announce:
                logger.info(
                    "validation set kept in memory (%d batches, %.1f MiB): later validations reuse it",
                    len(keeping), size / 2**20,
                )  # fmt: skip
