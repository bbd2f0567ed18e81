import torch
from torch import nn

from exporter.modules import module_groups


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
