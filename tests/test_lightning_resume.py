"""`newest_checkpoint`: what a restarted Lightning run resumes from (docs/hangs.md)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

from rankscope.integrations.lightning import newest_checkpoint  # noqa: E402


def _touch(path, mtime: float) -> None:
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))


def test_the_newest_ckpt_wins_rankscopes_and_model_checkpoints_alike(tmp_path):
    _touch(tmp_path / "epoch=0-step=40.ckpt", 100.0)
    _touch(tmp_path / "rankscope-step=50.ckpt", 200.0)
    _touch(tmp_path / "last.ckpt", 150.0)
    _touch(tmp_path / "rankscope-stacks-restart-1.txt", 300.0)  # not a checkpoint
    assert newest_checkpoint(tmp_path) == str(tmp_path / "rankscope-step=50.ckpt")


def test_a_distributed_checkpoint_is_dated_by_its_metadata_and_an_unfinished_one_is_passed_over(tmp_path):
    _touch(tmp_path / "rankscope-step=10.ckpt", 100.0)
    finished = tmp_path / "rankscope-step=20.ckpt"
    finished.mkdir()
    _touch(finished / ".metadata", 200.0)
    unfinished = tmp_path / "rankscope-step=30.ckpt"
    unfinished.mkdir()
    _touch(unfinished / "__0_0.distcp", 300.0)  # shards written, no .metadata yet
    assert newest_checkpoint(tmp_path) == str(finished)


def test_no_directory_or_no_checkpoint_is_none(tmp_path):
    assert newest_checkpoint(tmp_path / "missing") is None
    assert newest_checkpoint(tmp_path) is None
