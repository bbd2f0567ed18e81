"""Monitoring never changes training: a monitored run is bit-identical to the same run without rankscope.

Each archetype (tests/fidelity_loops.py) is trained twice from the same seed: once as plain PyTorch,
once with every optional probe on at every step and the gradients clipped through
`Monitor.clip_grad_norm_`. Losses, total gradient norms and final parameters must match bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.fidelity_loops import ARCHETYPES, differences, monitor_for, train
from tests.support import free_port, tail, torchrun


@pytest.mark.parametrize("archetype", list(ARCHETYPES))
def test_a_monitored_run_is_bit_identical_to_the_plain_run(archetype):
    plain = train(archetype, monitored=False)
    monitored = train(archetype, monitored=True)
    assert differences(plain, monitored) == []
    # ... by the monitor's own path, not by a fallback after a failure.
    assert monitored.monitor_errors == 0 and monitored.shared_clip


def test_the_tied_gpt2_clip_norm_is_torch_s_on_the_first_step():
    from tests.fidelity_loops import MAX_NORM, _gpt2_with_tied_embeddings

    torch.manual_seed(0)
    setup = _gpt2_with_tied_embeddings()
    setup.loss(setup.model, 0, 0).backward()
    grads = [p.grad.clone() for p in setup.model.parameters()]
    expected = torch.nn.utils.get_total_norm(grads)
    monitor = monitor_for()
    monitor.watch(setup.model, setup.optimizer)
    with monitor.step():
        total = monitor.clip_grad_norm_(setup.model.parameters(), MAX_NORM)
    assert total.item() == expected.item()
    monitor.close()


def test_a_shared_parameter_is_counted_once_in_every_module_statistic():
    from tests.fidelity_loops import _gpt2_with_tied_embeddings

    torch.manual_seed(0)
    setup = _gpt2_with_tied_embeddings()
    model = setup.model
    monitor = monitor_for()
    monitor.watch(model, setup.optimizer)
    with monitor.step() as step:
        loss = setup.loss(model, 0, 0)
        loss.backward()
        norm = monitor.clip_grad_norm_(model.parameters(), 1e9)  # no clipping: norms as computed
        step.record(loss=loss, grad_norm=norm)
        setup.optimizer.step()
    labels = monitor.identity.labels()
    groups = {
        sample.labels["module"]: sample.value
        for family in monitor.registry.collect()
        if family.name == "rankscope_module_grad_norm"
        for sample in family.samples
    }
    # lm_head holds only the tied embedding, which model.parameters() counts once, under transformer.
    assert list(groups) == ["transformer"]
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert groups["transformer"] == pytest.approx(expected.item(), rel=1e-5)
    assert groups["transformer"] == pytest.approx(norm.item(), rel=1e-5)
    ratio = monitor.registry.get_sample_value("rankscope_update_ratio", {**labels, "module": "transformer"})
    assert ratio is not None and ratio > 0
    monitor.close()


@pytest.mark.integration
def test_under_ddp_with_no_sync_accumulation_both_ranks_train_bit_identically(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "job.log"
    proc = torchrun(2, ["tests/jobs/fidelity_job.py", "--out", str(out)], free_port(), log=log)
    assert proc.wait(timeout=300) == 0, tail(log)
    for rank in (0, 1):
        found = json.loads((out / f"rank{rank}.json").read_text())
        assert found and all(diffs == [] for diffs in found.values()), (rank, found)


def test_a_compiled_model_trains_bit_identically_under_the_monitor_without_a_graph_break():
    # fullgraph=True: a graph break anywhere in the forward (the monitor's hooks included) raises.
    plain = train("mlp_frozen_two_groups", monitored=False, steps=6, compiled=True)
    monitored = train("mlp_frozen_two_groups", monitored=True, steps=6, compiled=True)
    assert differences(plain, monitored) == []
    assert monitored.monitor_errors == 0 and monitored.shared_clip
    assert set(monitored.module_norms) == {"2", "4"}  # the compiled wrapper's real layers, not `_orig_mod`


def test_dynamo_sees_no_graph_break_in_a_watched_model_s_forward():
    from tests.fidelity_loops import ARCHETYPES

    setup = ARCHETYPES["tensor_parallel_mlp"]()
    monitor = monitor_for()
    monitor.watch(setup.model, setup.optimizer)
    with monitor.step():
        explained = torch._dynamo.explain(setup.model)(torch.randn(4, 8))
    monitor.close()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.integration
@pytest.mark.parametrize(("parallel", "ranks"), [("fsdp2", 2), ("tp", 4)])
def test_under_fsdp2_and_tensor_parallel_every_rank_trains_bit_identically(tmp_path, parallel, ranks):
    # fsdp2: per-block fully_shard + root, clipping, accumulation with sync off, a bf16 mixed-precision
    # policy; tp: a 2-D (data x tensor) mesh, parallelize_module alone and under FSDP2, and HSDP (fully_shard
    # over a 2-D replicate x shard mesh). Module norms are checked to be of whole parameters (their
    # root-sum-square is torch's total norm).
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "job.log"
    job = ["tests/jobs/fidelity_job.py", "--out", str(out), "--parallel", parallel, "--steps", "6"]
    proc = torchrun(ranks, job, free_port(), log=log)
    assert proc.wait(timeout=600) == 0, tail(log)
    for rank in range(ranks):
        found = json.loads((out / f"rank{rank}.json").read_text())
        assert found and all(diffs == [] for diffs in found.values()), (rank, found)
