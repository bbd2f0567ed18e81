"""Pipeline parallelism (`torch.distributed.pipelining`, 2 stages, GPipe, gloo): the monitor changes nothing,
records the loss where it exists (the last stage), and its collective view sees the stages' send/recv.

The job (tests/jobs/pipeline_job.py) trains the same 2-stage model plainly and monitored on each rank.
"""

from __future__ import annotations

import json

import pytest

from tests.jobs.pipeline_job import MICROBATCHES
from tests.support import free_port, tail, torchrun

STEPS = 6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's result of one 2-rank pipeline job."""
    tmp = tmp_path_factory.mktemp("pipeline")
    out = tmp / "out"
    out.mkdir()
    log = tmp / "job.log"
    proc = torchrun(2, ["tests/jobs/pipeline_job.py", "--out", str(out), "--steps", str(STEPS)], free_port(), log=log)
    assert proc.wait(timeout=600) == 0, tail(log)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.integration
def test_each_pipeline_stage_trains_bit_identically_under_the_monitor(ranks):
    # Losses (last stage), the stage's clip norms and its final parameters, bit for bit; no probe failed.
    for rank, result in enumerate(ranks):
        assert result["differences"] == [], (rank, result["differences"])
        assert result["monitor_errors"] == 0 and result["shared_clip"], (rank, result)  # the monitor's own path
        assert len(result["norms"]) == STEPS


@pytest.mark.integration
def test_the_loss_is_recorded_on_the_last_stage_only(ranks):
    first, last = ranks
    assert first["losses"] == [] and first["loss"] == {}  # stage 0 has no loss: no loss series at all
    assert len(last["losses"]) == STEPS and last["loss"] == {"train": last["losses"][-1]}
    # Each stage records its own clip norm (the stage's, not the whole model's).
    assert first["grad_norm"] == first["norms"][-1] and last["grad_norm"] == last["norms"][-1]


@pytest.mark.integration
def test_the_collective_view_counts_each_stage_s_send_and_recv_under_the_pipeline_dim(ranks):
    # Per step and micro-batch each stage sends or receives one activation forward and one gradient backward.
    # On gloo these are seen only by the view's process-group hook (torch's Flight Recorder does not record
    # gloo's send/recv), which counts them; the mesh named "pp" labels them pipeline.
    for rank, result in enumerate(ranks):
        counts = result["collectives_total"]
        assert set(counts) == {"pipeline"}, (rank, counts)
        assert counts["pipeline"] >= 2 * MICROBATCHES * STEPS, (rank, counts)
        # gloo's send/recv works have no future: the view cannot time them (docs/sharded.md, Known gaps), so
        # no send_recv seconds are claimed; what it times (the guard's all-reduce) is on the same group.
        seconds = result["collective_seconds_total"]
        assert "send_recv/pipeline" not in seconds, (rank, seconds)
        assert seconds.get("all_reduce/pipeline", 0) > 0, (rank, seconds)
