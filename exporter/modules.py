"""Per-module gradient norms and update ratios, on an interval.

Modules are grouped by the model's top-level children (a bounded `module`
label: at most `max_groups`, the rest share "other"). Norms use fused
multi-tensor ops (`torch._foreach_norm`) and stay on the device; the monitor
resolves them with its batched transfer.

Update ratio = ||param_after - param_before|| / ||param_before|| per group,
from optimizer step hooks (public Optimizer API): the pre-hook snapshots the
parameters on due steps only, so other steps cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleStats", "module_groups"]

Sink = Callable[[str, str, torch.Tensor], None]  # (metric suffix, group, scalar tensor)


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP and FSDP-style wrappers keep the real model in `.module`.
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def module_groups(model: nn.Module, max_groups: int) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters grouped by top-level child; bounded for label safety."""
    root = _unwrap(model)
    groups: dict[str, list[nn.Parameter]] = {}
    for name, child in root.named_children():
        params = [p for p in child.parameters() if p.requires_grad]
        if params:
            groups[name] = params
    direct = [p for p in root.parameters(recurse=False) if p.requires_grad]
    if direct:
        groups["root"] = direct
    if len(groups) > max_groups:
        names = list(groups)
        kept = {n: groups[n] for n in names[: max_groups - 1]}
        kept["other"] = [p for n in names[max_groups - 1 :] for p in groups[n]]
        groups = kept
    return groups


def _group_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


class ModuleStats:
    """Computes the interval statistics and hands tensors to `sink`."""

    def __init__(self, model: nn.Module, optimizer: Any | None, every: int, max_groups: int, sink: Sink) -> None:
        self.groups = module_groups(model, max_groups)
        self._every = every
        self._sink = sink
        self._due = False
        self._before: dict[str, list[torch.Tensor]] | None = None
        self._handles = []
        if optimizer is not None and every > 0:
            self._handles.append(optimizer.register_step_pre_hook(self._snapshot))
            self._handles.append(optimizer.register_step_post_hook(self._update_ratios))

    def begin_step(self, step: int) -> None:
        self._due = self._every > 0 and step % self._every == 0

    def record_grad_norms(self) -> None:
        """Call after backward, while the gradients are there (the step context does)."""
        if not self._due:
            return
        with torch.no_grad():
            for name, params in self.groups.items():
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    self._sink("module_grad_norm", name, _group_norm(grads))

    def _snapshot(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._due:
            with torch.no_grad():
                self._before = {name: [p.detach().clone() for p in params] for name, params in self.groups.items()}

    def _update_ratios(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        with torch.no_grad():
            for name, params in self.groups.items():
                after = [p.detach() for p in params]
                delta = torch._foreach_sub(after, before[name])
                # Tiny epsilon: a zero-initialised group must not divide by zero.
                ratio = _group_norm(delta) / (_group_norm(before[name]) + 1e-12)
                self._sink("update_ratio", name, ratio)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
