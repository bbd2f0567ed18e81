"""rankscope_trainer.checkpoint: atomic files kept K deep, corrupt ones reported and skipped, metrics recorded."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from rankscope import Monitor
from rankscope_trainer.checkpoint import (
    CHECKPOINT_FORMAT,
    Checkpointer,
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    read_checkpoint,
    write_atomically,
)
from rankscope_trainer.runtime import Runtime

from tests.support import trainer_monitor

LABELS = {"run_id": "test", "rank": "0", "local_rank": "0", "node": "host"}


def _state(step: int) -> dict:
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "epoch": 0,
        "batch_in_epoch": step,
        "model": {"w": torch.full((3,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "rng": [],
        "tokenizer": {"kind": "word", "vocab": ["[PAD]"], "max_length": 4},
    }


@pytest.fixture(scope="module")
def runtime():
    """A real one-rank gloo process group (file store), as the trainer forms without torchrun."""
    rt = Runtime.start("cpu", timeout_seconds=60)
    yield rt
    rt.close()


@pytest.fixture
def monitor() -> Monitor:
    return trainer_monitor()


def test_a_written_checkpoint_reads_back(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path / "ck", 12)
    write_atomically(_state(12), path)
    assert path.name == "step_00000012.pt"
    loaded = read_checkpoint(path)
    assert loaded["step"] == 12 and torch.equal(loaded["model"]["w"], torch.full((3,), 12.0))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda data: data[: len(data) // 2], "is unreadable (truncated or corrupt"),
        (lambda data: b"this is not a checkpoint", "is unreadable (truncated or corrupt"),
        (lambda data: b"", "is unreadable (truncated or corrupt"),
    ],
)
def test_a_damaged_file_is_one_line_naming_it(tmp_path: Path, damage, expected: str) -> None:
    path = checkpoint_path(tmp_path, 5)
    write_atomically(_state(5), path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    assert str(path) in str(caught.value) and expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_file_that_is_not_ours_is_named(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match="not a rankscope checkpoint \\(missing format, step"):
        read_checkpoint(foreign)
    torch.save([1, 2], foreign)
    with pytest.raises(CheckpointError, match="holds list"):
        read_checkpoint(foreign)
    torch.save({**_state(1), "format": 99}, foreign)
    with pytest.raises(CheckpointError, match="has format 99"):
        read_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "missing.pt")


def _written_in_order(paths: list[Path]) -> None:
    """Give files increasing modification times in list order (file systems round them to a tick)."""
    for index, path in enumerate(paths):
        os.utime(path, ns=(1_700_000_000_000_000_000 + index * 10**9,) * 2)


def test_checkpoints_are_listed_most_recently_written_first_and_temporary_files_are_ignored(tmp_path: Path) -> None:
    paths = [checkpoint_path(tmp_path, step, "0000abcd") for step in (3, 120, 40)]
    for path in paths:
        write_atomically(_state(0), path)
    _written_in_order(paths)
    (tmp_path / ".step_00000200-0000abcd.pt.abc.tmp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000040-0000abcd.pt",
        "step_00000120-0000abcd.pt",
        "step_00000003-0000abcd.pt",
    ]
    assert list_checkpoints(tmp_path / "absent") == []


def _save(checkpoints: Checkpointer, step: int, reason: str = "interval") -> Path | None:
    return checkpoints.save(step, lambda: _state(step), reason)


def test_save_keeps_the_newest_k_of_its_lineage_and_records_the_reason_kind(tmp_path: Path, runtime, monitor) -> None:
    checkpoints = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    lineage = checkpoints.lineage
    (tmp_path / f".step_00000001-{lineage}.pt.x.tmp").write_bytes(b"left by a killed writer of this run")
    (tmp_path / ".step_00000001-ffffffff.pt.x.tmp").write_bytes(b"another run, maybe writing right now")
    for step, reason in [(10, "interval"), (20, "interval"), (25, "alert:HostMemoryHigh")]:
        assert _save(checkpoints, step, reason) == checkpoint_path(tmp_path, step, lineage)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step_00000001-ffffffff.pt.x.tmp",
        f"step_00000020-{lineage}.pt",
        f"step_00000025-{lineage}.pt",
    ]
    saved = read_checkpoint(checkpoint_path(tmp_path, 25, lineage))
    assert saved["reason"] == "alert:HostMemoryHigh" and saved["lineage"] == lineage
    assert len(saved["rng"]) == 1 and "torch" in saved["rng"][0]
    value = monitor.registry.get_sample_value
    assert value("rankscope_checkpoints_total", {**LABELS, "reason": "interval"}) == 2
    assert value("rankscope_checkpoints_total", {**LABELS, "reason": "alert"}) == 1
    assert value("rankscope_checkpoint_duration_seconds_count", LABELS) == 3
    assert value("rankscope_last_checkpoint_timestamp_seconds", LABELS) > 0
    assert value("rankscope_checkpoint_failures_total", {**LABELS, "reason": "no_space"}) == 0


def test_every_rank_holds_the_write_time_that_names_the_file_just_written(tmp_path: Path, runtime, monitor) -> None:
    """The rollback history tells a file from one another branch wrote over it by this (rankscope_trainer.history)."""
    checkpoints = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    path = _save(checkpoints, 10, "interval")
    assert checkpoints.last_saved_at is not None and read_checkpoint(path)["saved_at"] == checkpoints.last_saved_at


def test_a_second_run_in_the_same_directory_prunes_nothing_of_the_first(tmp_path: Path, runtime, monitor) -> None:
    longer = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    _save(longer, 30)
    second = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    assert second.lineage != longer.lineage
    for step in (4, 8):
        _save(second, step)
    names = sorted(p.name for p in tmp_path.iterdir())
    expected = [f"step_00000030-{longer.lineage}.pt"] + [f"step_0000000{s}-{second.lineage}.pt" for s in (4, 8)]
    assert names == sorted(expected)
    # --resume auto continues what ran there last: the second run's step 8, and its lineage.
    resumed = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    path, state = resumed.load("auto")
    assert state["step"] == 8 and resumed.lineage == second.lineage
    _save(resumed, 12)  # prunes step 4 of its own lineage only
    assert not checkpoint_path(tmp_path, 4, second.lineage).exists()
    assert checkpoint_path(tmp_path, 30, longer.lineage).exists()


def test_damaged_files_are_never_counted_as_kept_nor_removed(tmp_path: Path, runtime, monitor, caplog) -> None:
    good = _state(1)
    for step, damage in [(20, lambda d: d[: len(d) // 2]), (21, lambda d: os.urandom(len(d))), (22, lambda d: b"")]:
        path = checkpoint_path(tmp_path, step)  # an older name: no lineage
        write_atomically(good, path)
        path.write_bytes(damage(path.read_bytes()))
    checkpoints = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    with caplog.at_level(logging.WARNING, logger="rankscope_trainer"):
        assert checkpoints.load("auto") is None
    assert caplog.text.count("trying the previous one") == 3
    for step in (5, 10, 12):
        _save(checkpoints, step)
    mine = [p.name for p in list_checkpoints(tmp_path) if checkpoints.lineage in p.name]
    assert mine == [f"step_00000012-{checkpoints.lineage}.pt", f"step_00000010-{checkpoints.lineage}.pt"]
    assert {"step_00000020.pt", "step_00000021.pt", "step_00000022.pt"} <= {p.name for p in tmp_path.iterdir()}


def test_a_damaged_file_of_the_run_itself_is_not_one_of_the_kept(tmp_path: Path, runtime, monitor) -> None:
    checkpoints = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    for step in (5, 10):
        _save(checkpoints, step)
    damaged = checkpoint_path(tmp_path, 10, checkpoints.lineage)
    damaged.write_bytes(damaged.read_bytes()[:100])
    _save(checkpoints, 15)
    # Kept: 15 and 5 (complete); the truncated 10 does not count, and goes as an older file of the run.
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        f"step_00000015-{checkpoints.lineage}.pt",
        f"step_00000005-{checkpoints.lineage}.pt",
    ]


def test_a_higher_step_of_the_lineage_is_newer_and_never_pruned(tmp_path: Path, runtime, monitor) -> None:
    checkpoints = Checkpointer(tmp_path, keep=1, runtime=runtime, monitor=monitor)
    for step in (10, 20):
        _save(checkpoints, step)
    _save(checkpoints, 15)  # e.g. after going back to an earlier checkpoint
    assert checkpoint_path(tmp_path, 20, checkpoints.lineage).exists()
    assert not checkpoint_path(tmp_path, 10, checkpoints.lineage).exists()


def test_an_unwritable_directory_fails_at_start_in_one_line(tmp_path: Path, runtime, monitor) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(blocker / "ck", keep=2, runtime=runtime, monitor=monitor)
    assert str(caught.value) == f"checkpoint.dir {blocker / 'ck'} is not writable: Not a directory"


def test_a_failed_save_is_counted_logged_remembered_and_training_goes_on(
    tmp_path: Path, runtime, monitor, caplog
) -> None:
    directory = tmp_path / "ck"
    checkpoints = Checkpointer(directory, keep=2, runtime=runtime, monitor=monitor)
    shutil.rmtree(directory)
    directory.write_text("the directory was replaced by a file")  # as if the volume went away
    with caplog.at_level(logging.ERROR, logger="rankscope_trainer"):
        assert _save(checkpoints, 5, "operator:test") is None
    assert "failed" in caplog.text and "training goes on" in caplog.text
    assert len(checkpoints.failures) == 1 and "operator:test" in checkpoints.failures[0]
    value = monitor.registry.get_sample_value
    assert value("rankscope_checkpoints_total", {**LABELS, "reason": "operator"}) is None
    assert value("rankscope_checkpoint_failures_total", {**LABELS, "reason": "io_error"}) == 1


def test_a_full_disk_is_named_as_such_with_the_free_space(tiny_disk: Path, runtime, monitor) -> None:
    checkpoints = Checkpointer(tiny_disk, keep=2, runtime=runtime, monitor=monitor)
    big = {**_state(5), "model": {"w": torch.zeros(2_000_000)}}  # 8 MB of weights on a 1 MiB disk
    assert checkpoints.save(5, lambda: big, "interval") is None
    (message,) = checkpoints.failures
    assert "no space left on device (" in message and " MiB free on " in message, message
    assert "this checkpoint needs about 7.6 MiB" in message
    labels = {**LABELS, "reason": "no_space"}
    assert monitor.registry.get_sample_value("rankscope_checkpoint_failures_total", labels) == 1
    assert list(tiny_disk.iterdir()) == []  # no half-written file left behind


def test_resume_auto_skips_a_truncated_newest_checkpoint_for_the_previous_one(
    tmp_path: Path, runtime, monitor, caplog
) -> None:
    checkpoints = Checkpointer(tmp_path, keep=3, runtime=runtime, monitor=monitor)
    paths = [_save(checkpoints, step) for step in (10, 20, 30)]
    _written_in_order(paths)
    newest = paths[-1]
    newest.write_bytes(newest.read_bytes()[:100])
    os.utime(newest, ns=(1_800_000_000_000_000_000,) * 2)
    with caplog.at_level(logging.WARNING, logger="rankscope_trainer"):
        path, state = checkpoints.load("auto")
    assert path == paths[1] and state["step"] == 20
    assert f"checkpoint {newest} is unreadable (truncated or corrupt" in caplog.text
    assert "trying the previous one" in caplog.text


def test_resume_none_or_an_empty_directory_starts_fresh(tmp_path: Path, runtime, monitor) -> None:
    checkpoints = Checkpointer(tmp_path / "empty", keep=3, runtime=runtime, monitor=monitor)
    assert checkpoints.load("none") is None
    assert checkpoints.load("auto") is None


def test_an_explicit_resume_path_must_be_readable(tmp_path: Path, runtime, monitor) -> None:
    checkpoints = Checkpointer(tmp_path, keep=3, runtime=runtime, monitor=monitor)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="unreadable"):
        checkpoints.load(str(bad))
    good = checkpoint_path(tmp_path, 7)
    write_atomically(_state(7), good)
    assert checkpoints.load(str(good))[1]["step"] == 7
