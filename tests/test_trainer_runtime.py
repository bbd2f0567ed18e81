"""rankscope_trainer.runtime: seeding and RNG state that survive a checkpoint exactly."""

from __future__ import annotations

import io
import random

import numpy as np
import torch
from rankscope_trainer.runtime import get_rng_state, seed_everything, set_rng_state


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_the_same_seed_gives_the_same_draws_from_every_generator() -> None:
    seed_everything(7)
    first = _draws()
    seed_everything(7)
    assert _draws() == first
    seed_everything(8)
    assert _draws() != first


def test_rng_state_restored_from_a_weights_only_checkpoint_continues_the_same_streams() -> None:
    seed_everything(3)
    _draws()
    buffer = io.BytesIO()
    torch.save(get_rng_state(), buffer)
    expected = _draws()
    seed_everything(99)  # anything in between
    _draws()
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True))  # the checkpoint format: data only
    assert _draws() == expected
