"""Issue 22's FSDP2 loop under the monitor, in one process (a gloo group of one rank: FSDP2's parameters,
gradients and clip norms are DTensors exactly as on many ranks). Each test failed on the code before it:

- `step.record()` with the DTensor `clip_grad_norm_` returns crashed the step (`.tolist()` on a DTensor);
- the module statistics failed on DTensor gradients after clipping, and the fallback clipped again
  (the returned norm was post-clip, training changed);
- `attach_comm_hook` on a model that is not DDP raised AttributeError into the loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fidelity_loops import monitor_for

fsdp = pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp2_mlp(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    for layer in (model[0], model[2]):
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _errors(monitor, probe: str) -> float:
    value = monitor.registry.get_sample_value(
        "rankscope_monitor_errors_total", {**monitor.identity.labels(), "probe": probe}
    )
    return value or 0.0


def _train(monitored: bool, steps: int = 3, **config) -> tuple[list[float], list[float], list[torch.Tensor], object]:
    model, optimizer = _fsdp2_mlp()
    inputs = torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(1))
    monitor = monitor_for(**config) if monitored else None
    if monitor is not None:
        monitor.watch(model, optimizer)
    losses, norms = [], []
    for step in range(steps):
        loss = model(inputs[step]).pow(2).mean() * 100
        loss.backward()
        if monitor is not None:
            with monitor.step() as context:
                norm = monitor.clip_grad_norm_(model.parameters(), 0.05)
                assert context.record(loss=loss, grad_norm=norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm.full_tensor().item())
    params = [p.detach().full_tensor().clone() for p in model.parameters()]
    if monitor is not None:
        monitor.flush()
    return losses, norms, params, monitor


def test_recording_the_dtensor_norm_of_an_fsdp2_clip_does_not_crash_the_step(one_rank_group):
    # skip_nonfinite off: the non-finite flag goes through the batched transfer, where .tolist() crashed.
    losses, norms, _, monitor = _train(True, skip_nonfinite=False)
    labels = monitor.identity.labels()
    assert monitor.registry.get_sample_value("rankscope_grad_norm", labels) == norms[-1]
    assert monitor.registry.get_sample_value("rankscope_loss", {**labels, "split": "train"}) == losses[-1]
    assert _errors(monitor, "record") == 0
    monitor.close()


def test_an_fsdp2_clip_returns_torch_s_norm_clips_once_and_measures_whole_modules(one_rank_group):
    plain = _train(False)
    monitored = _train(True)
    assert monitored[0] == plain[0]  # losses
    assert monitored[1] == plain[1]  # torch's pre-clip norms, not the post-clip 0.05
    assert all(torch.equal(a, b) for a, b in zip(plain[2], monitored[2], strict=True))
    monitor = monitored[3]
    assert _errors(monitor, "module_stats") == 0
    labels = monitor.identity.labels()
    norms = {
        s.labels["module"]: s.value
        for f in monitor.registry.collect()
        if f.name == "rankscope_module_grad_norm"
        for s in f.samples
    }
    assert set(norms) == {"0", "2"}
    assert sum(v * v for v in norms.values()) ** 0.5 == pytest.approx(plain[1][-1], rel=1e-5)
    assert monitor.registry.get_sample_value("rankscope_update_ratio", {**labels, "module": "0"}) > 0
    monitor.close()


def test_a_probe_that_meets_a_tensor_it_cannot_measure_switches_off_counted_and_never_clips_twice(
    one_rank_group, monkeypatch
):
    from rankscope import modules

    def unknown(*args, **kwargs):
        raise TypeError("a tensor type the statistics do not know")

    monkeypatch.setattr(modules, "_combine_squares", unknown)
    plain = _train(False)
    losses, norms, params, monitor = _train(True)
    assert (losses, norms) == (plain[0], plain[1])
    assert all(torch.equal(a, b) for a, b in zip(plain[2], params, strict=True))
    assert _errors(monitor, "module_stats") == 1  # once: then the statistics are off
    monitor.close()


def test_attach_comm_hook_on_a_model_that_is_not_ddp_is_a_counted_no_op(one_rank_group, caplog):
    model, _ = _fsdp2_mlp()
    monitor = monitor_for()
    with caplog.at_level("WARNING", logger="rankscope"):
        monitor.attach_comm_hook(model)
    assert _errors(monitor, "comm_hook") == 1
    assert "is not DistributedDataParallel" in caplog.text
    monitor.close()


def test_a_dtensor_that_is_not_whole_on_this_rank_is_refused_in_one_line(one_rank_group):
    from rankscope.deferred import plain_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (1,))
    assert plain_tensor(DTensor.from_local(torch.tensor(2.0), mesh, [Replicate()])).item() == 2.0
    with pytest.raises(TypeError, match="not whole on this rank"):
        plain_tensor(DTensor.from_local(torch.tensor(2.0), mesh, [Partial()]))
