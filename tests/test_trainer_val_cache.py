"""The validation set is read once and its batches reused, with the same losses as reading it every time."""

from __future__ import annotations

import pytest
import torch
from rankscope_trainer.config import DataConfig, SyntheticConfig
from rankscope_trainer.data import BadSample, Collate, ShapesDataset, build_data, image_transform
from rankscope_trainer.val_cache import CachedBatches, batch_bytes
from torch.utils.data import DataLoader, Dataset


def _bundle(val_cache_mib: int = 256):
    cfg = DataConfig(batch_size=4, val_batch_size=4, num_workers=0, val_cache_mib=val_cache_mib,
                     synthetic=SyntheticConfig(train_size=40, val_size=16, image_size=24))  # fmt: skip
    return build_data(cfg, image_size=24, seed=0, rank=0, world_size=2)


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in ("images", "input_ids", "attention_mask", "lengths", "sizes"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name


def test_the_second_pass_hands_out_the_first_passes_batches_which_a_fresh_read_equals() -> None:
    val = _bundle().val_loader
    first = list(val)
    assert len(first) == 2 and val.kept  # 8 samples of this rank's share, batches of 4
    second = list(val)
    assert all(a is b for a, b in zip(first, second, strict=True))
    _same(second, list(val.loader))  # what reading the set again gives


def test_a_limit_of_0_or_under_the_shard_reads_the_set_every_time() -> None:
    assert not _bundle(val_cache_mib=0).val_loader.kept
    off = _bundle(val_cache_mib=0).val_loader
    _same(list(off), list(off))
    assert not off.kept
    loader = _bundle().val_loader.loader
    one = batch_bytes(next(iter(loader)))
    tight = CachedBatches(loader, limit_bytes=one)  # the first batch fits, the second does not
    assert len(list(tight)) == 2 and not tight.kept
    roomy = CachedBatches(loader, limit_bytes=2 * one)
    assert len(list(roomy)) == 2 and roomy.kept


def test_a_pass_left_early_keeps_nothing_and_the_next_whole_one_does() -> None:
    val = _bundle().val_loader
    assert next(iter(val)) is not None
    assert not val.kept
    assert len(list(val)) == 2 and val.kept


class _OneBad(Dataset):
    """The synthetic set with one sample that cannot be loaded (as a manifest image broken after the check)."""

    def __init__(self) -> None:
        self.shapes = ShapesDataset(8, 24, 0, "val", image_transform(24))

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index: int):
        return BadSample("unreadable_image", f"val.jsonl:{index + 1}: broken") if index == 5 else self.shapes[index]


def test_a_pass_that_met_a_bad_sample_keeps_nothing_so_the_next_reads_the_file_again() -> None:
    tokenizer = _bundle().tokenizer
    val = CachedBatches(DataLoader(_OneBad(), batch_size=4, collate_fn=Collate(tokenizer, 24)), limit_bytes=2**30)
    batches = list(val)
    assert [len(b.bad) for b in batches] == [0, 1]
    assert not val.kept
    assert [len(b.bad) for b in val] == [0, 1]


@pytest.mark.integration
def test_a_run_that_reuses_its_validation_batches_logs_the_same_losses_as_one_that_reads_them_each_time(
    trainer_job,
) -> None:
    settings = ["run.max_steps=40", "run.val_every=10", "data.synthetic.val_size=96"]
    kept = trainer_job("kept", settings)
    assert kept.wait_exit(timeout=300) == 0, kept.tail()
    read = trainer_job("read", [*settings, "data.val_cache_mib=0"])
    assert read.wait_exit(timeout=300) == 0, read.tail()

    assert "validation set kept in memory (3 batches" in kept.output.read_text()  # 48 samples a rank, 16 a batch
    assert "validation set kept in memory" not in read.output.read_text()
    val = [{k: v for k, v in r.items() if k != "time"} for r in kept.records("val")]
    assert [r["step"] for r in val] == [10, 20, 30, 40]
    assert val == [{k: v for k, v in r.items() if k != "time"} for r in read.records("val")]
    assert kept.losses() == read.losses() and len(kept.losses()) == 40
