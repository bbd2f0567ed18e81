"""The Hugging Face Trainer asked for accelerate's FSDP on 2 CPU ranks under torchrun, with RankscopeCallback.

accelerate (1.16) turns FSDP on only for accelerators: on CPU (MULTI_CPU) it wraps the model in DDP and says
nothing, so the Trainer's FSDP path cannot be run on this machine. The test pins that fact (it fails the day
accelerate shards on CPU, which is the day this becomes the FSDP test) and checks what does run: the recorded
gradient norm is the one the Trainer clipped with, and communication time is measured with no DDP comm hook
attached (the callback is added to the Trainer without `attach`)."""

from __future__ import annotations

import json

import pytest

from tests.support import free_port, free_port_block, tail, torchrun

pytestmark = pytest.mark.integration
pytest.importorskip("accelerate")


def test_an_fsdp_request_on_cpu_trains_under_ddp_and_the_callback_records_the_trainer_s_norm_and_comm_time(tmp_path):
    log = tmp_path / "job.log"
    job = ["tests/jobs/hf_fsdp_job.py", "--out", str(tmp_path), "--metrics-port", str(free_port_block(2))]
    assert torchrun(2, job, free_port(), log=log).wait(timeout=300) == 0, tail(log)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        sharded = (found["fsdp_enabled"], found["wrapper"])
        assert sharded == (False, "DistributedDataParallel"), f"accelerate shards on CPU now: test FSDP here {sharded}"
        assert found["rankscope_grad_norm"] == pytest.approx(found["trainer_grad_norm"], rel=1e-6), found
        assert found["rankscope_comm_duration_seconds_count"] == 4 and found["rankscope_comm_duration_seconds_sum"] > 0
        errors = {k: v for k, v in found.items() if k.startswith("rankscope_monitor_errors_total|") and v}
        assert set(errors) <= {"rankscope_monitor_errors_total|nvml"}, errors  # no GPU library here
