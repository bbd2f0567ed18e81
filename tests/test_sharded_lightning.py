"""Lightning's ModelParallelStrategy (FSDP2) under RankscopeCallback, 2 CPU ranks under torchrun: the recorded
gradient norm is torch's exactly, the module norms are of whole parameters, and communication time is
measured (by the collective view: there is no DDP wrapper to hook)."""

from __future__ import annotations

import json
import math

import pytest

from tests.support import free_port, free_port_block, tail, torchrun

pytestmark = pytest.mark.integration
pytest.importorskip("lightning")


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
