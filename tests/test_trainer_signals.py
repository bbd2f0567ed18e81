"""Nothing lost on a bad day: real signals to a real torchrun job of the reference trainer (2 CPU ranks).

- SIGTERM to torchrun (what `docker compose stop`, Kubernetes and SLURM send): every rank stops at the
  same step after one checkpoint at that step, and no rank has to be killed (DataLoader workers too);
- SIGTERM to one rank only: the other stops with it, at the same step;
- torchrun's agent killed with SIGKILL: the orphaned ranks checkpoint once and leave;
- rank 0 killed (the OOM killer's way) with DataLoader workers alive, under --max-restarts=1: the
  restarted rank 0 gets its ports back and the job completes.
"""

from __future__ import annotations

import contextlib
import signal
import time

import psutil
import pytest

pytestmark = pytest.mark.integration

#: Long enough that only a signal ends these runs.
ENDLESS = ["run.max_steps=100000", "checkpoint.every_steps=0", "data.num_workers=1", "run.log_every=1"]


def _wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return alive


def _stopped_cleanly(job, reason: str) -> int:
    """The step every rank stopped at; asserts one checkpoint there, written for the stop."""
    finished = job.records("finished")
    assert [f["stopped"] for f in finished] == [reason], job.tail()
    step = finished[0]["step"]
    at_step = [r for r in job.records("checkpoint") if r["step"] == step]
    assert [r["reason"] for r in at_step] == [f"stop:{reason}"], job.tail()
    assert job.records("checkpoint")[-1] == at_step[0]  # nothing written after it
    return step


def test_sigterm_to_torchrun_checkpoints_once_at_one_step_and_no_rank_is_killed(trainer_job) -> None:
    job = trainer_job("sigterm", ENDLESS)
    job.wait_for(lambda: job.global_step(0) >= 5 and job.global_step(1) >= 5, "both ranks past step 5")
    ranks = job.rank_processes()
    workers = [child for rank in ranks.values() for child in rank.children(recursive=True)]
    assert len(ranks) == 2 and workers, "expected 2 ranks with DataLoader workers"
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    job.wait_exit(timeout=60)
    # torchrun waits up to its 30 s shutdown timeout before it kills; the ranks left long before.
    assert time.monotonic() - sent < 30, job.tail()
    assert _wait_gone([*ranks.values(), *workers], timeout=10) == []
    step = _stopped_cleanly(job, "signal:SIGTERM")
    output = job.output.read_text()
    assert "SIGKILL" not in output and "exitcode: -" not in output, job.tail()
    assert "DataLoader worker" not in output, job.tail()  # no worker died of the signal
    assert step >= 5


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(trainer_job) -> None:
    job = trainer_job("sigterm_rank1", ENDLESS)
    job.wait_for(lambda: job.global_step(1) >= 5, "rank 1 past step 5")
    job.rank_processes()[1].send_signal(signal.SIGTERM)
    assert job.wait_exit(timeout=60) == 0, job.tail()  # every rank exited 0, so torchrun does too
    _stopped_cleanly(job, "signal:SIGTERM")


def test_ranks_whose_torchrun_agent_died_checkpoint_once_and_leave(trainer_job) -> None:
    job = trainer_job("orphaned", ENDLESS)
    job.wait_for(lambda: job.global_step(0) >= 5, "rank 0 past step 5")
    ranks = list(job.rank_processes().values())
    assert len(ranks) == 2
    job.proc.send_signal(signal.SIGKILL)  # the agent only; the ranks live in sessions of their own
    job.proc.wait(timeout=30)
    alive = _wait_gone(ranks, timeout=90)
    assert alive == [], f"ranks {[p.pid for p in alive]} trained on without their agent\n{job.tail()}"
    _stopped_cleanly(job, "signal:agent-gone")


def test_the_rank_that_loses_its_peer_says_so_in_one_line(trainer_job) -> None:
    # Rank 1 killed outright (no restarts): rank 0's next collective fails. Its last word is one line that
    # names what happened and where the first error is, not gloo's traceback.
    job = trainer_job("peer_lost", ENDLESS)
    job.wait_for(lambda: job.global_step(1) >= 5, "rank 1 past step 5")
    job.rank_processes()[1].send_signal(signal.SIGKILL)
    assert job.wait_exit(timeout=120) != 0
    output = job.output.read_text()
    lines = [line for line in output.splitlines() if "trainer: rank 0 stopped: lost contact with another rank" in line]
    assert len(lines) == 1, job.tail()
    assert lines[0].rstrip().endswith("the first error is in that rank's output"), lines[0]
    assert "[rank0]: Traceback" not in output and "[rank0]:Traceback" not in output, job.tail()
    # It left by itself: DataLoader workers that ignore SIGTERM did not hold its exit until torchrun's SIGKILL.
    assert "forcefully exiting via 9" not in output, job.tail()


def test_the_line_survives_the_launchers_sigterm_landing_while_the_rank_unwinds(trainer_job) -> None:
    # torchrun SIGTERMs the survivors as soon as it sees rank 1 gone, at any moment of rank 0's unwinding,
    # including after its stop handlers are put back. SIGTERMs every few milliseconds cover every moment: the
    # line must already be out when the default handler ends the rank.
    job = trainer_job("peer_lost_sigterm", ENDLESS)
    job.wait_for(lambda: job.global_step(1) >= 5, "rank 1 past step 5")
    ranks = job.rank_processes()
    ranks[1].send_signal(signal.SIGKILL)
    while job.proc.poll() is None and ranks[0].is_running():
        with contextlib.suppress(psutil.NoSuchProcess):
            ranks[0].send_signal(signal.SIGTERM)
        time.sleep(0.005)
    assert job.wait_exit(timeout=120) != 0
    output = job.output.read_text()
    lines = [line for line in output.splitlines() if "trainer: rank 0 stopped: lost contact with another rank" in line]
    assert len(lines) == 1, job.tail()


def test_a_killed_rank_0_with_data_workers_is_restarted_and_the_job_completes(trainer_job) -> None:
    job = trainer_job(
        "rank0_killed",
        ["run.max_steps=40", "checkpoint.every_steps=10", "data.num_workers=2", "run.log_every=1"],
        resume="auto",
        max_restarts=1,
    )
    job.wait_for(lambda: any(r["step"] >= 10 for r in job.records("checkpoint")), "the step-10 checkpoint")
    rank0 = job.rank_processes()[0]
    workers = rank0.children(recursive=True)
    assert workers, "rank 0 should have DataLoader workers"
    # What made restarts fail: forked workers held rank 0's listening sockets (metrics, control) and,
    # orphaned, kept them for seconds after rank 0 died. They must hold none.
    ours = {job.metrics_base_port, job.metrics_base_port + 1}  # gloo's own listening sockets are not ours
    listening = [
        (w.pid, c.laddr.port)
        for w in workers
        for c in w.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ours
    ]
    assert listening == [], listening
    rank0.send_signal(signal.SIGKILL)  # rank 0 alone; its workers notice their parent is gone later
    assert job.wait_exit(timeout=300) == 0, job.tail()
    resumes = job.records("resume")
    assert resumes and resumes[0]["step"] >= 10, job.tail()
    assert job.records("finished")[-1]["step"] == 40
    assert "already in use" not in job.output.read_text()


def test_sigterm_with_a_hung_rank_leaves_each_ranks_stacks_and_reason_before_torchrun_kills(trainer_job) -> None:
    # Rank 1 blocks for ever waiting for its next batch; rank 0 waits for it in DDP's all-reduce, in C++. No step
    # boundary comes, so no checkpoint: within control.stop_grace_seconds each rank says why in one line and
    # leaves its stacks beside the checkpoints, before torchrun's SIGKILL (30 s after the signal).
    hang_at = 8
    job = trainer_job(
        "sigterm_hung",
        [*ENDLESS, f"faults.hang.at_step={hang_at}", "faults.hang.rank=1", "faults.hang.kind=data",
         "control.stop_grace_seconds=3"],
    )  # fmt: skip
    job.wait_for(lambda: "rank 1 hangs at step" in job.output.read_text(), "rank 1 to hang")
    ranks = job.rank_processes()
    workers = [child for rank in ranks.values() for child in rank.children(recursive=True)]
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    job.wait_exit(timeout=60)
    assert time.monotonic() - sent < 30, job.tail()
    assert _wait_gone([*ranks.values(), *workers], timeout=10) == []  # DataLoader workers too
    output = job.output.read_text()
    assert "forcefully exiting" not in output and "SIGKILL" not in output, job.tail()
    lines = [line for line in output.splitlines() if "SIGTERM: no checkpoint written" in line]
    assert len(lines) == 2, job.tail()
    (hung,) = [line for line in lines if "rankscope: rank 1:" in line]
    assert "rank 1 did not reach the step boundary" in hung and "phase data_wait" in hung, hung
    (waiting,) = [line for line in lines if "rankscope: rank 0:" in line]
    assert "a peer did not reach the step boundary" in waiting and "all_reduce (data)" in waiting, waiting
    for rank in (0, 1):
        (stacks,) = job.checkpoint_dir.glob(f"rankscope-stacks-sigterm-*-rank{rank}.txt")
        assert str(stacks) in (hung if rank else waiting)
    assert "_hang_in_data_loader in faults.py" in next(job.checkpoint_dir.glob("*-rank1.txt")).read_text()
    assert not [r for r in job.records("checkpoint") if r["reason"].startswith("stop:")]
