"""rankscope.control.stop_deadline: after SIGTERM, a rank that cannot reach a step boundary leaves a record and
exits 143; a rank that is working its way there, or out of its loop, is left alone.

Real processes and real signals: a one-rank script with a real Monitor and ControlChannel (no endpoint), each
case doing what a loop does when the signal comes. The 2-rank torchrun case is tests/test_sigterm_hung_rank.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support import REPO, wait_for

GRACE_SECONDS = 0.5

RANK = textwrap.dedent(
    f"""
    import logging, sys, threading, time
    from pathlib import Path
    from rankscope import Monitor, MonitorConfig, RankIdentity
    from rankscope.control import ControlChannel, ControlConfig

    logging.basicConfig(level=logging.INFO)
    case, out = sys.argv[1], Path(sys.argv[2])
    monitor = Monitor(MonitorConfig(probes=()), RankIdentity.from_env({{}}, run_id="unit"), device="cpu")
    config = ControlConfig(endpoint=False, stop_grace_seconds={GRACE_SECONDS}, state_dir=str(out))
    channel = ControlChannel(config, monitor)
    ready = out / "ready"

    class Loop:
        def checkpoint(self, reason):
            return True

        def request_stop(self, reason):
            pass

    if case == "hung":
        with monitor.step(samples=1):
            ready.touch()
            threading.Event().wait()
    elif case == "validating":  # work on the way to the boundary: six graces long
        with monitor.phase("validation"):
            ready.touch()
            time.sleep({12 * GRACE_SECONDS})
        channel.at_step_boundary(1, Loop())  # the signal is agreed here: a stop
        monitor.finish()
        channel.finish()
    elif case == "lingering":  # the loop has left and serves one last scrape
        monitor.finish()
        ready.touch()
        channel.finish(linger_seconds={12 * GRACE_SECONDS})
    print("left cleanly")
    """
)


def _signalled(case: str, tmp_path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-c", RANK, case, str(tmp_path)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_for(lambda: (tmp_path / "ready").exists() or proc.poll() is not None, 60, f"the {case} rank to start")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_hung_rank_writes_its_stacks_and_phase_says_why_and_exits_143(tmp_path):
    result = _signalled("hung", tmp_path)
    assert result.returncode == 143, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "SIGTERM: no checkpoint" in line]
    assert "rank 0: SIGTERM: no checkpoint written: rank 0 did not reach the step boundary" in line, line
    assert "it is in phase compute" in line and "exiting with status 143" in line, line
    (stacks,) = tmp_path.glob("rankscope-stacks-sigterm-*-rank0.txt")
    assert str(stacks) in line
    text = stacks.read_text()
    assert text.startswith("rank 0: SIGTERM: no checkpoint written") and "phase: compute" in text, text
    assert "rank 0: <module> in <string>" in text and "in wait" in text, text  # where the main thread blocks


@pytest.mark.parametrize("case", ["validating", "lingering"])
def test_a_rank_working_its_way_to_the_boundary_or_out_of_its_loop_is_left_alone(case, tmp_path):
    result = _signalled(case, tmp_path)
    assert result.returncode == 0 and "left cleanly" in result.stdout, result.stderr[-3000:]
    assert "SIGTERM: no checkpoint" not in result.stderr, result.stderr[-3000:]
    assert not list(tmp_path.glob("rankscope-stacks-*"))


def test_a_rank_still_moving_through_its_phases_is_not_ended_when_the_grace_runs_out() -> None:
    # A long step is not a hang: a rank whose current phase began less than the grace ago may still reach the
    # boundary (review: it used to be ended, with no checkpoint, whatever phase it was working through).
    import threading
    import time

    from rankscope.control.stop_deadline import StopDeadline

    left: list[int] = []
    deadline = StopDeadline(0, 0.2, "", phase=lambda: ("compute", time.time() - 0.01), leave=left.append)
    watcher = threading.Thread(target=deadline.on_sigterm)
    watcher.start()
    watcher.join(1.0)  # five graces: long past the deadline
    assert watcher.is_alive() and not left
    deadline.reached.set()  # the stop is agreed at the boundary
    watcher.join(5.0)
    assert not watcher.is_alive() and not left
