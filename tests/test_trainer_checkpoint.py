"""trainer.checkpoint: atomic files kept K deep, corrupt ones reported and skipped, metrics recorded."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from exporter import Monitor, MonitorConfig, RankIdentity
from trainer.checkpoint import (
    CHECKPOINT_FORMAT,
    Checkpointer,
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    read_checkpoint,
    write_atomically,
)
from trainer.runtime import Runtime

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
    identity = RankIdentity("test", 0, 0, 1, "host")
    return Monitor(MonitorConfig(base_port=0, probes=()), identity, device="cpu", registry=CollectorRegistry())


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


def test_checkpoints_are_listed_newest_first_and_temporary_files_are_ignored(tmp_path: Path) -> None:
    for step in (3, 120, 40):
        write_atomically(_state(step), checkpoint_path(tmp_path, step))
    (tmp_path / ".step_00000200.pt.abc.tmp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000120.pt",
        "step_00000040.pt",
        "step_00000003.pt",
    ]
    assert list_checkpoints(tmp_path / "absent") == []


def test_save_keeps_the_newest_k_and_records_the_reason_kind(tmp_path: Path, runtime, monitor) -> None:
    checkpoints = Checkpointer(tmp_path, keep=2, runtime=runtime, monitor=monitor)
    (tmp_path / ".step_00000001.pt.x.tmp").write_bytes(b"left by a killed writer")
    for step, reason in [(10, "interval"), (20, "interval"), (25, "alert:HostMemoryHigh")]:
        assert checkpoints.save(step, lambda s=step: _state(s), reason) == checkpoint_path(tmp_path, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020.pt", "step_00000025.pt"]
    saved = read_checkpoint(checkpoint_path(tmp_path, 25))
    assert saved["reason"] == "alert:HostMemoryHigh"
    assert len(saved["rng"]) == 1 and "torch" in saved["rng"][0]
    value = monitor.registry.get_sample_value
    assert value("rankscope_checkpoints_total", {**LABELS, "reason": "interval"}) == 2
    assert value("rankscope_checkpoints_total", {**LABELS, "reason": "alert"}) == 1
    assert value("rankscope_checkpoint_duration_seconds_count", LABELS) == 3
    assert value("rankscope_last_checkpoint_timestamp_seconds", LABELS) > 0


def test_a_failed_save_is_logged_and_training_goes_on(tmp_path: Path, runtime, monitor, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    checkpoints = Checkpointer(blocker / "ck", keep=2, runtime=runtime, monitor=monitor)
    with caplog.at_level(logging.ERROR, logger="trainer"):
        assert checkpoints.save(5, lambda: _state(5), "operator:test") is None
    assert "failed" in caplog.text and "training goes on" in caplog.text
    assert monitor.registry.get_sample_value("rankscope_checkpoints_total", {**LABELS, "reason": "operator"}) is None


def test_resume_auto_skips_a_truncated_newest_checkpoint_for_the_previous_one(
    tmp_path: Path, runtime, monitor, caplog
) -> None:
    checkpoints = Checkpointer(tmp_path, keep=3, runtime=runtime, monitor=monitor)
    for step in (10, 20, 30):
        checkpoints.save(step, lambda s=step: _state(s), "interval")
    newest = checkpoint_path(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="trainer"):
        path, state = checkpoints.load("auto")
    assert path == checkpoint_path(tmp_path, 20) and state["step"] == 20
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
