"""SIGTERM to a job with a hung rank (issue 33): what a preempted hung job leaves behind, before SIGKILL.

A real torchrun job (tests/jobs/control_job.py, 2 gloo ranks) whose rank 1 blocks for ever inside a step;
rank 0 then waits in the step boundary's all-reduce, in C++, where no Python signal handler runs. SIGTERM goes
to torchrun's agent, as a scheduler preempting the job sends it; the agent forwards it to the ranks and
kills them 30 s later. No step boundary is reached, so no checkpoint can be agreed; within
control.stop_grace_seconds every rank writes its stacks and phase beside the checkpoints, rank 0 writes
the goodput ledger, every rank logs one line saying why it did not checkpoint and exits with 143.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.jobs.control_job import ControlJob
from tests.support import free_port, tail

pytestmark = pytest.mark.integration

GRACE_SECONDS = 3.0
HANG_AT = 15
#: torchrun's --shutdown-timeout default: it kills the ranks this long after forwarding the signal.
TORCHRUN_KILLS_AFTER = 30.0


def test_sigterm_with_a_hung_rank_leaves_stacks_phase_ledger_and_one_line_per_rank_before_sigkill(tmp_path):
    state, ledger = tmp_path / "checkpoints", tmp_path / "goodput"
    control = {"state_dir": str(state), "stop_grace_seconds": GRACE_SECONDS}
    extra = ["--hang-rank", "1", "--hang-at", str(HANG_AT), "--goodput-dir", str(ledger)]
    job = ControlJob(tmp_path, free_port(), free_port(), control, pg_timeout=600, extra=extra)
    try:
        job.wait_for(lambda: (tmp_path / "rank1.hung").exists(), "rank 1 to hang", timeout=180)
        sent = time.time()
        job.proc.send_signal(signal.SIGTERM)
        job.wait_exit(timeout=TORCHRUN_KILLS_AFTER + 30)
        took = time.time() - sent
    finally:
        job.close()
    log = job.log.read_text()
    assert "SIGKILL" not in log, f"torchrun had to kill a rank\n{tail(job.log)}"
    assert took < TORCHRUN_KILLS_AFTER, f"the ranks left {took:.0f}s after the signal\n{tail(job.log)}"

    # One line per rank: why it did not checkpoint, naming the phase, where the stacks are, the exit status.
    lines = {rank: [line for line in log.splitlines() if f"rankscope: rank {rank}: SIGTERM" in line] for rank in (0, 1)}
    assert all(len(found) == 1 for found in lines.values()), lines
    assert "rank 1 did not reach the step boundary" in lines[1][0] and "phase compute" in lines[1][0], lines[1]
    assert "a peer did not reach the step boundary" in lines[0][0] and "all_reduce" in lines[0][0], lines[0]
    for rank, (line,) in lines.items():
        assert "no checkpoint" in line and "exiting with status 143" in line, line
        written = re.search(r"stacks in (\S+\.txt)", line)
        assert written is not None, line
        text = (state / written.group(1).rsplit("/", 1)[-1]).read_text()
        assert f"rank {rank}" in text, text
        raw = json.loads((state / written.group(1).rsplit("/", 1)[-1].replace(".txt", ".json")).read_text())
        # Rank 1 blocks after its backward: rank 0 finished the step and waits in the control round's all-reduce.
        assert raw[str(rank)]["phase"] == ("compute" if rank == 1 else "step_boundary"), raw[str(rank)]["phase"]
    stacks_of_1 = next(state.glob("rankscope-stacks-sigterm-*-rank1.txt")).read_text()
    assert "_hang in control_job.py" in stacks_of_1, stacks_of_1

    # Rank 0's goodput ledger was written at the exit (the periodic flush is an hour away in this job).
    assert (ledger / "rankscope-goodput.json").exists(), "the goodput ledger was not written"
    updated_at = json.loads((ledger / "rankscope-goodput.json").read_text())["updated_at"]
    assert updated_at >= sent + GRACE_SECONDS - 1, (updated_at, sent)
