"""rankscope_trainer.history: the kept line of checkpoints a rollback may load, carried across a restart.

The rollback itself, after a real restart of a 2-rank job, is tests/test_trainer_recovery.py's
`test_a_restarted_run_rolls_back_to_a_checkpoint_its_previous_process_wrote`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from rankscope_trainer.history import CheckpointHistory


def _written(directory: Path, step: int) -> Path:
    path = directory / f"step_{step:08d}-0badcafe.pt"
    path.write_bytes(b"a checkpoint")
    return path


def _line(directory: Path, steps: list[int], keep: int = 50) -> CheckpointHistory:
    history = CheckpointHistory(keep)
    for step in steps:
        history.add(step, _written(directory, step), saved_at=1000.0 + step)
    return history


def test_a_resumed_run_can_reach_the_checkpoints_its_resumed_one_passed(tmp_path: Path) -> None:
    before = _line(tmp_path, [10, 20, 30])
    resumed = CheckpointHistory(50)
    path = _written(tmp_path, 40)
    resumed.resumed(path, {"step": 40, "saved_at": 1040.0, "history": before.to_state()})
    assert resumed.paths() == {s: tmp_path / f"step_{s:08d}-0badcafe.pt" for s in (10, 20, 30, 40)}
    assert resumed.holds(20, {"saved_at": 1020.0}) and resumed.holds(40, {"saved_at": 1040.0})


def test_the_line_names_files_in_the_directory_it_is_resumed_in(tmp_path: Path) -> None:
    """A copied checkpoint directory (a replay, a move to other storage) resolves the line in its new place."""
    old, moved = tmp_path / "old", tmp_path / "new"
    old.mkdir(), moved.mkdir()
    recorded = _line(old, [10]).to_state()
    _written(moved, 10)
    resumed = CheckpointHistory(50)
    resumed.resumed(_written(moved, 20), {"step": 20, "history": recorded})
    assert resumed.paths() == {10: moved / "step_00000010-0badcafe.pt", 20: moved / "step_00000020-0badcafe.pt"}


def test_a_file_another_branch_wrote_over_is_not_the_one_the_line_passed(tmp_path: Path) -> None:
    history = _line(tmp_path, [10, 20])
    assert not history.holds(20, {"saved_at": 5000.0})  # same name, written later by another branch
    assert not history.holds(15, {"saved_at": 1015.0})  # never on the line
    assert not history.holds(20, {})  # no write time where the line recorded one


def test_a_checkpoint_of_an_older_trainer_has_no_line_and_no_write_time_to_compare(tmp_path: Path) -> None:
    resumed = CheckpointHistory(50)
    resumed.resumed(_written(tmp_path, 30), {"step": 30})
    assert resumed.steps() == [30] and resumed.holds(30, {"saved_at": 1.0})


def test_a_rollback_forgets_the_abandoned_branch_and_the_kept_line_writes_its_step_anew(tmp_path: Path) -> None:
    history = _line(tmp_path, [10, 20, 30, 40])
    history.truncate(20)
    assert history.steps() == [10, 20]
    history.add(30, _written(tmp_path, 30), saved_at=9030.0)  # the kept line's own step 30
    assert history.steps() == [10, 20, 30]
    assert history.holds(30, {"saved_at": 9030.0}) and not history.holds(30, {"saved_at": 1030.0})


def test_the_recorded_line_holds_only_checkpoints_still_on_disk(tmp_path: Path) -> None:
    history = _line(tmp_path, [10, 20, 30])
    (tmp_path / "step_00000010-0badcafe.pt").unlink()  # pruned
    assert [entry["step"] for entry in history.to_state()] == [20, 30]


@pytest.mark.parametrize(
    "recorded",
    [
        "not a list of entries",
        [{"step": 10}],
        [{"step": "10", "name": "step_00000010-0badcafe.pt"}],
        [{"step": 10, "name": "../../etc/passwd"}],
        [17],
        [{"step": 10, "name": "step_00000090-0badcafe.pt"}],  # the name is another step's file
        [{"step": 40, "name": "step_00000040-0badcafe.pt"}],  # not before the checkpoint that carries it
        [{"step": 10, "name": "step_00000010-0badcafe.pt", "saved_at": "yesterday"}],  # no overwrite check left
    ],
)
def test_a_damaged_line_is_one_line_and_the_resumed_checkpoint_stays_usable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, recorded: object
) -> None:
    resumed = CheckpointHistory(50)
    path = _written(tmp_path, 30)
    with caplog.at_level(logging.WARNING, logger="rankscope_trainer"):
        resumed.resumed(path, {"step": 30, "saved_at": 1030.0, "history": recorded})
    assert resumed.steps() == [30]
    (message,) = caplog.messages
    assert "\n" not in message and str(path) in message and "damaged history" in message


def test_the_line_holds_the_newest_checkpoints_the_checkpointer_keeps_alike_on_every_rank(tmp_path: Path) -> None:
    assert _line(tmp_path, [10, 20, 30, 40, 50], keep=3).steps() == [30, 40, 50]


def test_a_lookback_before_the_process_started_finds_the_newest_checkpoint_written_before_it(tmp_path: Path) -> None:
    """saved_at is 1000 + step here: the moment 1035 is after step 30's write and before step 40's."""
    history = _line(tmp_path, [10, 20, 30, 40, 50])
    assert history.written_before(1035.0, bound=60) == [30, 20, 10]
    assert history.written_before(1035.0, bound=25) == [20, 10]  # none at or after the incident
    assert history.written_before(1005.0, bound=60) == []  # a run younger than the lookback
