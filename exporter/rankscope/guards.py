"""In-process guards: non-finite steps and loss spikes.

The non-finite decision must be the same on every rank, or one rank would
skip an optimizer step the others take and the replicas would drift apart.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist

__all__ = ["LossSpikeDetector", "agree_on_skip", "nonfinite_flag", "overflow_flag"]


def nonfinite_flag(*values: torch.Tensor | float | None) -> torch.Tensor | bool:
    """True where any value is NaN or infinite: a bool when every value is a host number or a CPU scalar, else
    a tensor on the first device tensor's device (device tensors are never read: no sync)."""
    tensors: list[torch.Tensor] = []
    host_bad = False
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_cpu and value.numel() == 1 and not value.is_complex():
                # A CPU scalar (the loss, the norm on CPU) is read for nothing: no tensor ops, 20x cheaper.
                host_bad = host_bad or not math.isfinite(value.item())
            else:
                tensors.append(value.detach())
        elif isinstance(value, (int, float)):
            host_bad = host_bad or not math.isfinite(value)
    if not tensors:
        return host_bad
    if host_bad:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device)
    # A few ops per tensor, every step: this runs on the training thread.
    finite = torch.isfinite(tensors[0]).all()
    for tensor in tensors[1:]:
        finite = finite & torch.isfinite(tensor).all().to(finite.device)
    return ~finite


def overflow_flag(loss: torch.Tensor | float | None, grad_norm: torch.Tensor | float | None) -> torch.Tensor | bool:
    """True when the gradient norm is NaN/inf while the loss is finite: under a GradScaler, an
    overflow of the scaled gradients (no sync)."""
    norm_bad = nonfinite_flag(grad_norm)
    if norm_bad is False:
        return False
    loss_bad = nonfinite_flag(loss)
    if isinstance(norm_bad, bool):
        return ~loss_bad if isinstance(loss_bad, torch.Tensor) else not loss_bad
    if isinstance(loss_bad, bool):
        return norm_bad & (not loss_bad)
    return norm_bad & ~loss_bad.to(norm_bad.device)


def agree_on_skip(flag: torch.Tensor | bool) -> bool:
    """Whether to skip this update, agreed by every rank.

    With several ranks, a MAX all-reduce of the local flag (one int on the
    flag's device, so NCCL gets a CUDA tensor) makes the decision identical
    everywhere, even if only one rank saw the NaN (e.g. a local loss that is
    NaN while the reduced gradients are not yet). Every rank must call this at
    the same point of the step.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return bool(flag)
    tensor = flag.to(torch.int32) if isinstance(flag, torch.Tensor) else torch.tensor(int(flag), dtype=torch.int32)
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        tensor = tensor.cuda()
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


class LossSpikeDetector:
    """Counts loss spikes: loss > ratio x rolling mean of the last `window` finite
    losses, for `patience` consecutive steps. One episode counts once."""

    def __init__(self, window: int = 50, ratio: float = 2.0, patience: int = 1) -> None:
        self._history: deque[float] = deque(maxlen=window)
        self._ratio = ratio
        self._patience = patience
        self._streak = 0
        self._counted = False

    def update(self, loss: float) -> bool:
        """Feed one step's loss; True when this step completes a new spike episode."""
        if not math.isfinite(loss):
            return False
        full = len(self._history) == self._history.maxlen
        mean = sum(self._history) / len(self._history) if self._history else 0.0
        candidate = full and mean > 0 and loss > self._ratio * mean
        if candidate:
            self._streak += 1
            # Spiking values stay out of the baseline, so a long spike is not
            # absorbed into the mean it is compared against.
            new_episode = self._streak >= self._patience and not self._counted
            if new_episode:
                self._counted = True
            return new_episode
        self._streak = 0
        self._counted = False
        self._history.append(loss)
        return False
