"""rankscope.exits: a rank's next process says when its previous one ended without a word (real processes,
real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from rankscope import Monitor, MonitorConfig
from rankscope.exits import ExitNote
from rankscope.identity import RankIdentity

# A child process: begins rank 1's note of run "r", says "ready", then ends as told.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from rankscope.exits import ExitNote
    note = ExitNote(sys.argv[1], 1, "r").begin()
    print("ready", flush=True)
    how = sys.argv[2]
    if how == "raise":
        raise RuntimeError("the loop failed")
    if how == "exit":
        sys.exit(0)
    if how == "os_exit":
        os._exit(3)
    time.sleep(600)  # "wait": until killed
    """
)


def _child(directory: Path, how: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), how], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_process_that_python_sees_end_is_not_called_vanished(tmp_path: Path, how: str) -> None:
    child = _child(tmp_path, how)
    child.wait(60)
    assert ExitNote(tmp_path, 1, "r").begin().vanished is None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_process_killed_by_a_signal_it_did_not_handle_is_named_by_the_next_process_of_its_rank(
    tmp_path: Path, sig: signal.Signals
) -> None:
    child = _child(tmp_path, "wait")
    os.kill(child.pid, sig)
    child.wait(60)
    note = ExitNote(tmp_path, 1, "r").begin()
    assert note.vanished is not None and note.vanished["pid"] == child.pid
    assert note.found_at is not None
    # Other ranks, and another run in the same directory, are not accused.
    assert ExitNote(tmp_path, 0, "r").begin().vanished is None
    child = _child(tmp_path, "wait")
    os.kill(child.pid, signal.SIGKILL)
    child.wait(60)
    assert ExitNote(tmp_path, 1, "another-run").begin().vanished is None


def test_os_exit_is_an_ending_without_a_word_unless_the_path_said_so_first(tmp_path: Path) -> None:
    child = _child(tmp_path, "os_exit")
    child.wait(60)
    assert ExitNote(tmp_path, 1, "r").begin().vanished is not None  # os._exit runs no atexit hook
    note = ExitNote(tmp_path, 1, "r").begin()  # this process, then it says how it ends before leaving
    note.end("restart")
    note.end("closed")  # the first word stays
    assert '"ended": "restart"' in note.path.read_text()
    # A fresh process of the rank finds the ending: nothing vanished.
    child = subprocess.run([sys.executable, "-c", "import sys; from rankscope.exits import ExitNote; "
                            "print(ExitNote(sys.argv[1], 1, 'r').begin().vanished)", str(tmp_path)],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert child.stdout.strip() == "None"


def test_the_monitor_shows_the_vanished_previous_process_and_says_how_its_own_ends(tmp_path: Path) -> None:
    child = _child(tmp_path, "wait")
    os.kill(child.pid, signal.SIGKILL)
    child.wait(60)
    identity = RankIdentity.from_env({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, run_id="r")
    monitor = Monitor(MonitorConfig(probes=(), goodput_dir=str(tmp_path)), identity, device="cpu")
    page = generate_latest(monitor.registry).decode()
    assert "rankscope_previous_process_vanished_timestamp_seconds{" in page and 'rank="1"' in page
    monitor.finish()
    monitor.close()
    assert '"ended": "finished"' in (tmp_path / "rankscope-exits" / "rank-1.json").read_text()
    # Its successor finds a clean end: no series.
    successor = Monitor(MonitorConfig(probes=(), goodput_dir=str(tmp_path)), identity, device="cpu")
    assert "rankscope_previous_process_vanished_timestamp_seconds{" not in generate_latest(successor.registry).decode()
    successor.close()
