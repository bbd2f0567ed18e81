"""The Hugging Face Trainer under accelerate's FSDP, 2 CPU ranks under torchrun, with RankscopeCallback: the
recorded gradient norm is the one the Trainer clipped with, and communication time is measured (by the
collective view: FSDP has no DDP comm hook). Rollback under FSDP is refused with a reason (docs/integrations.md)."""

from __future__ import annotations

import json

import pytest

from tests.support import free_port, free_port_block, tail, torchrun

pytestmark = pytest.mark.integration
pytest.importorskip("accelerate")


def test_under_accelerate_fsdp_the_callback_records_the_trainer_s_norm_and_comm_time(tmp_path):
    log = tmp_path / "job.log"
    job = ["tests/jobs/hf_fsdp_job.py", "--out", str(tmp_path), "--metrics-port", str(free_port_block(2))]
    assert torchrun(2, job, free_port(), log=log).wait(timeout=300) == 0, tail(log)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["rankscope_grad_norm"] == pytest.approx(found["trainer_grad_norm"], rel=1e-6), found
        assert found["rankscope_comm_duration_seconds_count"] == 4 and found["rankscope_comm_duration_seconds_sum"] > 0
        errors = {k: v for k, v in found.items() if k.startswith("rankscope_monitor_errors_total|") and v}
        assert set(errors) <= {"rankscope_monitor_errors_total|nvml"}, errors  # no GPU library here
