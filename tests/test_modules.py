import pytest
import torch
from rankscope.modules import ModuleStats, module_groups
from torch import nn


def test_groups_are_the_top_level_children_with_trainable_parameters():
    model = nn.Sequential()
    model.add_module("vision", nn.Linear(2, 2))
    model.add_module("act", nn.ReLU())
    model.add_module("text", nn.Linear(2, 2))
    assert list(module_groups(model, 8)) == ["vision", "text"]


def test_frozen_modules_are_left_out_and_direct_parameters_are_root():
    model = nn.Module()
    model.frozen = nn.Linear(2, 2).requires_grad_(False)
    model.scale = nn.Parameter(torch.ones(()))
    assert list(module_groups(model, 8)) == ["root"]


def test_many_children_are_bounded_with_an_other_group():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    groups = module_groups(model, 4)
    assert list(groups) == ["0", "1", "2", "other"]
    assert len(groups["other"]) == 7 * 2


def test_ddp_style_wrappers_are_unwrapped():
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    inner = nn.Sequential()
    inner.add_module("encoder", nn.Linear(2, 2))
    assert list(module_groups(Wrapper(inner), 8)) == ["encoder"]


def test_a_model_with_a_child_called_module_beside_others_is_not_a_wrapper():
    model = nn.Module()
    model.module = nn.Linear(2, 2)
    model.head = nn.Linear(2, 2)
    assert list(module_groups(model, 8)) == ["module", "head"]


def _model_with_mixed_parameters():
    torch.manual_seed(0)
    model = nn.Module()
    model.vision = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    model.text = nn.Linear(4, 3)
    model.unused = nn.Linear(4, 3)  # no gradient ever reaches it
    model.low = nn.Linear(4, 3).to(torch.bfloat16)
    model.scale = nn.Parameter(torch.tensor(2.0))
    return model


def _loss(model, batch):
    out = model.vision(batch) + model.text(batch) + model.low(batch.to(torch.bfloat16)).float()
    return (out * model.scale).pow(2).mean()


def _naive_norm(tensors):
    return torch.sqrt(sum(t.double().pow(2).sum() for t in tensors)).item()


def test_grad_norms_and_update_ratios_match_a_per_parameter_computation():
    model = _model_with_mixed_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    found = {}
    stats = ModuleStats(model, optimizer, 1, 8, lambda metric, groups, values: found.update(
        {(metric, g): v for g, v in zip(groups, values.tolist(), strict=True)}))  # fmt: skip
    groups = stats.groups
    assert list(groups) == ["vision", "text", "unused", "low", "root"]

    stats.begin_step(1)
    _loss(model, torch.randn(16, 4)).backward()
    stats.record_grad_norms()
    before = {name: [p.detach().float().clone() for p in params] for name, params in groups.items()}
    optimizer.step()

    for name, params in groups.items():
        grads = [p.grad for p in params if p.grad is not None]
        expected = _naive_norm(grads) if grads else 0.0
        assert found[("module_grad_norm", name)] == pytest.approx(expected, rel=1e-5, abs=1e-7)
        delta = [p.detach().float() - b for p, b in zip(params, before[name], strict=True)]
        ratio = _naive_norm(delta) / _naive_norm(before[name])
        assert found[("update_ratio", name)] == pytest.approx(ratio, rel=1e-4), name
    assert found[("module_grad_norm", "unused")] == 0.0
    assert found[("update_ratio", "unused")] == 0.0  # the optimizer skips parameters without a gradient


def test_the_other_group_sums_what_the_bound_merged():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    found = {}
    stats = ModuleStats(model, None, 1, 3, lambda metric, groups, values: found.update(
        dict(zip(groups, values.tolist(), strict=True))))  # fmt: skip
    stats.begin_step(1)
    model(torch.randn(3, 2)).sum().backward()
    stats.record_grad_norms()
    merged = [p.grad for layer in list(model)[2:] for p in layer.parameters()]
    assert list(found) == ["0", "1", "other"]
    assert found["other"] == pytest.approx(_naive_norm(merged), rel=1e-5)


def test_steps_that_are_not_due_compute_and_hold_nothing():
    model = _model_with_mixed_parameters()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    stats = ModuleStats(model, optimizer, 5, 8, lambda *args: calls.append(args))
    stats.begin_step(4)
    _loss(model, torch.randn(4, 4)).backward()
    stats.record_grad_norms()
    optimizer.step()
    assert calls == [] and stats._befores is None


def test_a_failure_inside_the_optimizer_hooks_is_reported_not_raised_into_the_step():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []

    def broken_sink(metric, groups, values):
        raise RuntimeError("sink broke")

    stats = ModuleStats(nn.Sequential(model), optimizer, 1, 8, broken_sink, on_error=errors.append)
    stats.begin_step(1)
    model(torch.randn(3, 2)).sum().backward()
    weight = model.weight.detach().clone()
    optimizer.step()  # the post-hook's sink raises; the step itself must complete
    assert not torch.equal(weight, model.weight)
    assert [str(e) for e in errors] == ["sink broke"]


def test_norms_of_the_shares_on_several_devices_combine_as_one_norm():
    from rankscope.modules import _combine_squares, _DeviceShard

    shards = [_DeviceShard(torch.device("cpu")), _DeviceShard(torch.device("cpu"))]
    combined = _combine_squares(shards, [torch.tensor([9.0, 0.0, 1.0]), torch.tensor([16.0, 4.0, 0.0])])
    assert combined.sqrt().tolist() == [5.0, 2.0, 1.0]


def test_off_the_cpu_the_snapshot_memory_is_held_only_between_the_optimizer_hooks():
    # The meta device stands in for an accelerator here: same code path, storage sizes without data.
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to("meta")
    stats = ModuleStats(model, None, 1, 8, lambda *args: None)
    shard = stats._shards[0]
    snapshot = shard.snapshot()
    assert snapshot.flat.untyped_storage().nbytes() == 0
    snapshot.take(shard.params)
    assert snapshot.flat.untyped_storage().nbytes() == 4 * (3 * 4 + 4 + 4 * 2 + 2)
    snapshot.release()
    assert snapshot.flat.untyped_storage().nbytes() == 0
