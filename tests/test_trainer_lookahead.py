"""rankscope_trainer.lookahead: how far a bad stretch of data runs past a rollback's window, in few looks.

The trainer's use of it (the restored model's losses, every rank alike, a resumed run the same) is
tests/test_trainer_recovery.py's, under torchrun.
"""

from __future__ import annotations

import math

import pytest
import torch
from rankscope_trainer.config import ModelConfig
from rankscope_trainer.data import Batch, Collate, ShapesDataset, image_transform
from rankscope_trainer.lookahead import CLEAN_GROUPS, bad_stretch_length, batch_loss, clean_loss
from rankscope_trainer.model import build_model, contrastive_loss
from rankscope_trainer.tokenizer import WordTokenizer


class Stretch:
    """Offsets 1..length are bad; counts the looks."""

    def __init__(self, length: int) -> None:
        self.length, self.looked = length, []

    def __call__(self, offset: int) -> bool:
        assert offset >= 1
        self.looked.append(offset)
        return offset <= self.length


@pytest.mark.parametrize("limit", [1, 2, 7, 64, 1000])
def test_every_stretch_length_is_found_exactly_up_to_the_limit(limit) -> None:
    for length in range(0, 140):
        stretch = Stretch(length)
        assert bad_stretch_length(stretch, limit) == min(length, limit), (length, limit)
        assert max(stretch.looked) <= limit
        # Doubling, then halving the gap: about 2 log2(n) looks, never one batch at a time.
        assert len(stretch.looked) <= 2 * math.ceil(math.log2(max(2, min(length, limit) + 1))) + 1, stretch.looked


def test_clean_data_after_the_window_is_one_look() -> None:
    stretch = Stretch(0)
    assert bad_stretch_length(stretch, 10_000) == 0
    assert stretch.looked == [1]


def test_a_lookahead_of_zero_looks_at_nothing() -> None:
    stretch = Stretch(50)
    assert bad_stretch_length(stretch, 0) == 0 and stretch.looked == []


def test_a_stretch_to_the_limit_ends_there_in_few_looks() -> None:
    stretch = Stretch(10**9)
    assert bad_stretch_length(stretch, 10_000) == 10_000
    assert len(stretch.looked) <= 16 and stretch.looked[-1] == 10_000


@pytest.fixture(scope="module")
def model_and_data():
    data = ShapesDataset(100, 48, 0, "val", image_transform(48))
    tok = WordTokenizer.build(data.captions(), 12)
    model = build_model(ModelConfig(image_layers=1), tok.vocab_size, tok.max_length, tok.pad_id).eval()
    collate = Collate(tok, 48)
    return model, [collate([data[i] for i in range(start, min(start + 30, 100))]) for start in range(0, 100, 30)]


def _step_loss(model, batch: Batch, rows: slice) -> torch.Tensor:
    """The model's loss over some rows of a batch, as one training step computes it."""
    with torch.no_grad():
        return contrastive_loss(model(batch.images[rows], batch.input_ids[rows], batch.attention_mask[rows]))


def _rows(batch: Batch, rows: slice) -> Batch:
    return Batch(batch.images[rows], batch.input_ids[rows], batch.attention_mask[rows], batch.lengths[rows],
                 batch.sizes[rows])  # fmt: skip


def test_a_steps_loss_contrasts_all_its_micro_batches_together(model_and_data) -> None:
    model, (batch, *_) = model_and_data
    parts = [_rows(batch, slice(0, 4)), _rows(batch, slice(4, 8))]
    assert torch.allclose(batch_loss(model, parts, torch.device("cpu")), _step_loss(model, batch, slice(0, 8)))


def test_the_clean_loss_is_over_groups_the_size_of_a_step(model_and_data) -> None:
    model, val = model_and_data
    # Validation batches of 30; steps of 8 samples: CLEAN_GROUPS groups of 8, not batches of 30 (the loss of a
    # contrastive batch grows with its size: chance is log n). Groups cross batch boundaries (24..32).
    images = torch.cat([b.images for b in val])
    ids, mask = torch.cat([b.input_ids for b in val]), torch.cat([b.attention_mask for b in val])
    whole = Batch(images, ids, mask, torch.ones(len(images)), torch.ones(len(images), 2))
    expected = torch.stack([_step_loss(model, whole, slice(i, i + 8)) for i in range(0, 8 * CLEAN_GROUPS, 8)]).mean()
    assert torch.allclose(clean_loss(model, val, 8, torch.device("cpu")), expected, atol=1e-6)
    # A share under one step is taken whole.
    small = [_rows(val[0], slice(0, 5))]
    assert torch.allclose(clean_loss(model, small, 8, torch.device("cpu")), _step_loss(model, val[0], slice(0, 5)))
