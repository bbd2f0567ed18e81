"""Lightning's ModelParallelStrategy (FSDP2) under RankscopeCallback, 2 CPU ranks under torchrun: the recorded
gradient norm is torch's exactly, the module norms are of whole parameters, and communication time is
measured (by the collective view: there is no DDP wrapper to hook)."""

from __future__ import annotations

import json
import math

import pytest

from tests.jobs.lightning_job import LightningJob
from tests.support import free_port, free_port_block, sample_value, samples, tail, torchrun

pytestmark = pytest.mark.integration
pytest.importorskip("lightning")

BASE_LR = 0.05  # the job's Regression rate, reached after its 3 warmup steps
WARMUP = 3


def test_under_lightning_fsdp2_the_callback_records_torch_s_norm_whole_module_norms_and_comm_time(tmp_path):
    log = tmp_path / "job.log"
    job = ["tests/jobs/lightning_fsdp2_job.py", "--out", str(tmp_path), "--metrics-port", str(free_port_block(2))]
    assert torchrun(2, job, free_port(), log=log).wait(timeout=300) == 0, tail(log)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["rankscope_grad_norm"] == found["torch_norm"], found  # bit for bit, as a float64
        modules = [v for k, v in found.items() if k.startswith("rankscope_module_grad_norm|")]
        assert math.isclose(math.sqrt(sum(v * v for v in modules)), found["torch_norm"], rel_tol=1e-5), found
        assert found["rankscope_comm_duration_seconds_count"] == 6 and found["rankscope_comm_duration_seconds_sum"] > 0
        errors = {k: v for k, v in found.items() if k.startswith("rankscope_monitor_errors_total|") and v}
        assert errors == {}, errors


def test_under_lightning_fsdp2_every_action_is_carried_out_on_both_ranks_or_answered_unsupported(tmp_path):
    """tests/jobs/lightning_job.py with ModelParallelStrategy (FSDP2 over 2 ranks), steered over HTTP: reduce_lr
    halves the rate on both ranks from the next step, checkpoint makes both ranks write their shards at that
    step, rollback and reduce_micro_batch are unsupported (as under every Lightning strategy) and change
    nothing, a pause holds both ranks at one step until the resume, and stop checkpoints, then ends both."""
    job = LightningJob(tmp_path, free_port(), free_port(), pg_timeout=30.0, model_parallel=True)
    try:
        job.wait_ready()
        reduce = job.wait_settled(job.post_action("reduce_lr", lr_factor=0.5))
        save = job.wait_settled(job.post_action("checkpoint"))
        rollback = job.wait_settled(job.post_action("rollback"))
        smaller = job.wait_settled(job.post_action("reduce_micro_batch"))
        pause = job.wait_settled(job.post_action("pause"))
        resume = job.wait_settled(job.post_action("resume"))
        job.wait_for(lambda: all(job.step_lines(r)[-1]["step"] > pause["step"] for r in (0, 1)), "steps after resume")
        job.post_action("stop")
        assert job.wait_exit(timeout=120) == 0, job.diagnose()
    finally:
        job.close()

    assert (reduce["status"], save["status"]) == ("applied", "applied"), (reduce, save)
    assert (rollback["status"], smaller["status"]) == ("unsupported", "unsupported"), (rollback, smaller)
    assert (pause["status"], resume["status"]) == ("applied", "applied"), (pause, resume)
    assert pause["step"] == resume["step"]
    stopped_at = job.result(0)["global_step"]
    for rank in (0, 1):
        steps = [line["step"] for line in job.step_lines(rank)]
        assert steps == list(range(1, stopped_at + 1)), rank  # nothing rolled back, no step lost or repeated
        rates = {line["step"]: line["lr"] for line in job.step_lines(rank)}
        assert {rates[s] for s in range(WARMUP, reduce["step"] + 1)} == {BASE_LR}, rank
        assert {lr for s, lr in rates.items() if s > reduce["step"]} == {BASE_LR * 0.5}, rank
        assert save["step"] in job.saved_at(rank) and job.saved_at(rank)[-1] == stopped_at, rank
        assert job.result(rank) == {"global_step": stopped_at, "should_stop": True, "status": "finished"}, rank
        final = samples(job.final_page(rank))
        assert sample_value(final, "rankscope_checkpoints_total", reason="stop") == 1, rank
    for step in (save["step"], stopped_at):  # the strategy's distributed checkpoint: a folder of shards
        assert (tmp_path / "checkpoints" / f"rankscope-step={step}.ckpt" / ".metadata").is_file(), step
