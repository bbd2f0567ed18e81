"""After a rollback, how much of the data ahead is still bad: read ahead with the restored model.

A rollback skips the window from its checkpoint through the incident and the batches trained since,
plus a margin. A bad stretch of data (a corrupt shard, captions scrambled) can be longer: the run then
resumes inside it and trains the damage in again (the fault campaign's poisoned stretch outlasted the
alert's detection and the rollback by minutes). The restored model, from before the incident, tells
bad data from good: its loss on a bad batch is far above its loss on clean data. So the trainer looks at
single batches after the window, doubling the distance while they are bad and then halving the gap
between the last bad and the first clean one: about 2 log2(n) batches for a stretch of n, each one
forward pass without gradients. It assumes one contiguous stretch, as a corrupt shard is; a clean batch
at the first look (a learning-rate divergence, whose data was fine) ends it at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from rankscope_trainer.data import Batch
from rankscope_trainer.model import contrastive_loss

__all__ = ["BAD_LOSS_FACTOR", "CLEAN_GROUPS", "bad_stretch_length", "batch_loss", "clean_loss"]

#: A batch is bad when the restored model's loss on it is more than this many times its loss on clean
#: (validation) data. Scrambled captions take a trained contrastive model from ~0.05 to chance (2.8) and
#: more; a clean batch's loss seldom reaches 4x the mean, and one that does costs one batch: the search
#: stops at the next clean look.
BAD_LOSS_FACTOR = 4.0


#: The clean yardstick: the restored model's mean loss over this many step-sized groups of validation
#: samples (fewer where the rank's validation share is smaller).
CLEAN_GROUPS = 8


def bad_stretch_length(is_bad: Callable[[int], bool], limit: int) -> int:
    """How many batches from offset 1 on are bad (offsets are 1-based, at most `limit` looked at), for a
    single contiguous bad stretch that starts at offset 1 or nowhere: `limit` if it runs that far."""
    if limit <= 0 or not is_bad(1):
        return 0
    bad, look = 1, 2  # the last offset known bad, the next to look at
    while True:
        look = min(look, limit)
        if look == bad:
            return bad  # bad up to the limit
        if not is_bad(look):
            clean = look
            break
        bad, look = look, 2 * look
    while clean - bad > 1:
        middle = (bad + clean) // 2
        if is_bad(middle):
            bad = middle
        else:
            clean = middle
    return bad


Features = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _features(model: Any, batches: Iterable[Batch], device: torch.device) -> list[Features]:
    return [
        model(b.images, b.input_ids, b.attention_mask, features=True)
        for b in (batch.to(device) for batch in batches)
        if len(b)
    ]


def _loss(features: list[Features]) -> torch.Tensor:
    """The contrastive loss over every sample of `features` together, as a training step computes it over its
    micro-batches (the negatives are the whole step's)."""
    images = torch.cat([f[0] for f in features])
    texts = torch.cat([f[1] for f in features])
    return contrastive_loss(features[0][2] * images @ texts.t())


@torch.no_grad()
def batch_loss(model: Any, micro_batches: list[Batch], device: torch.device) -> torch.Tensor:
    """The loss of one step's data (its micro-batches together), without gradients; 0 if it has no sample."""
    features = _features(model, micro_batches, device)
    return _loss(features) if features else torch.zeros((), device=device)


@torch.no_grad()
def clean_loss(model: Any, val_batches: Iterable[Batch], step_samples: int, device: torch.device) -> torch.Tensor:
    """The mean loss over up to CLEAN_GROUPS groups of `step_samples` validation samples: groups the size of a
    training step, because a contrastive loss depends on how many samples it contrasts (chance is log n)."""
    wanted = CLEAN_GROUPS * step_samples
    features: list[Features] = []
    for batch in val_batches:
        features += _features(model, [batch], device)
        if sum(len(f[0]) for f in features) >= wanted:
            break
    if not features:
        return torch.zeros((), device=device)
    images, texts = (torch.cat([f[i] for f in features])[:wanted] for i in (0, 1))
    scale = features[0][2]
    groups = [(i, t, scale) for i, t in zip(images.split(step_samples), texts.split(step_samples), strict=True)]
    whole = [g for g in groups if len(g[0]) == step_samples] or groups  # a share under one step: what there is
    return torch.stack([_loss([group]) for group in whole]).mean()
