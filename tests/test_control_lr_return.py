"""LRReturn: what a reduction for a number of steps owes back, joined with an earlier one, read from a checkpoint."""

from __future__ import annotations

import pytest
from rankscope.control.lr_return import LRReturn


def test_a_second_cut_joins_the_first_and_moves_the_return_to_its_own():
    first = LRReturn.after(None, step=100, steps=2000, ratios=[2.0, 1.0], scale=2.0)
    assert (first.due_step, first.ratios, first.scale, first.reduced_at) == (2100, (2.0, 1.0), 2.0, 100)
    both = LRReturn.after(first, step=500, steps=2000, ratios=[2.0, 2.0], scale=2.0)
    assert (both.due_step, both.ratios, both.scale, both.reduced_at) == (2500, (4.0, 2.0), 4.0, 100)
    shorter = LRReturn.after(first, step=500, steps=10, ratios=[2.0, 2.0], scale=2.0)
    assert shorter.due_step == 2100  # never earlier than what was promised for the first


def test_a_cut_after_param_groups_were_added_drops_the_earlier_promise():
    first = LRReturn.after(None, step=100, steps=2000, ratios=[2.0], scale=2.0)
    later = LRReturn.after(first, step=500, steps=2000, ratios=[2.0, 2.0], scale=2.0)
    assert (later.ratios, later.scale, later.reduced_at) == ((2.0, 2.0), 2.0, 500)


def test_it_reads_back_what_it_wrote_and_names_what_does_not_fit():
    owed = LRReturn.after(None, step=100, steps=2000, ratios=[2.0], scale=2.0)
    assert LRReturn.from_json(owed.to_json(), groups=1) == owed
    with pytest.raises(ValueError, match="lr_return is not a learning-rate return"):
        LRReturn.from_json({"due_step": 5}, groups=1)
    with pytest.raises(ValueError, match="lr_return is not a learning-rate return"):
        LRReturn.from_json({**owed.to_json(), "ratios": "x"}, groups=1)
    with pytest.raises(ValueError, match="would lower a rate"):
        LRReturn.from_json({**owed.to_json(), "scale": 0.5}, groups=1)
