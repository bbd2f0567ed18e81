"""Device values that become numbers later, in one batched transfer.

Reading a CUDA tensor on the host (`.item()`, `float()`) waits for the device
to finish: one stall per read. The monitor instead keeps detached tensors and
resolves them together every N steps (one stall per N steps, at a point the
loop chose). CPU tensors and numbers cost nothing to read and are resolved at
once, except while held: values recorded during a step wait for the step's end
(`release`), so a page never shows them beside the previous step's number.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["DeferredValues", "plain_tensor"]

Sink = Callable[[list[float]], None]


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value` as a plain tensor holding its whole value, without communication.

    A DTensor (FSDP2, tensor parallel: `clip_grad_norm_` returns one) whose placements are all Replicate
    holds the whole value on every rank: its local tensor. Any other placement would need a collective
    to assemble, which the monitor never starts behind the loop's back: refused in one line (the caller
    counts it), as is any other tensor subclass."""
    if type(value).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:  # plain, Parameter, a trivial subclass
        return value
    placements = getattr(value, "placements", None)
    if placements is not None and hasattr(value, "to_local"):
        if all(type(p).__name__ == "Replicate" for p in placements):
            return value.to_local()
        raise TypeError(
            f"a DTensor placed {tuple(placements)} is not whole on this rank; pass value.full_tensor() instead"
        )
    raise TypeError(f"cannot read a {type(value).__name__} (a tensor subclass the monitor does not know)")


class DeferredValues:
    """A queue of (tensor or host numbers, sink) owned by the training thread (no lock needed).

    Sinks run in the order values were added, so a sink that depends on order
    (the loss-spike detector) sees steps in sequence.
    """

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor | list[float], Sink]] = []
        self._tensors = 0  # of the items, tensors waiting for the flush (the rest are held host values)
        self.holding = False
        """While True (inside a step), host values are read at once but their sinks wait for `release`."""

    def __len__(self) -> int:
        return len(self._items)

    def add(self, value: torch.Tensor | float | int, sink: Sink) -> None:
        """Queue a tensor (any shape; the sink gets its values flattened) or a number."""
        if not isinstance(value, torch.Tensor):
            if self.holding:
                self._items.append(([float(value)], sink))
            else:
                sink([float(value)])
            return
        if type(value) is not torch.Tensor:
            value = plain_tensor(value)
        # Few calls on this path: it runs several times per step on the training thread.
        if value.is_cpu and not self._tensors:
            dim = value.dim()  # its value now; a scalar (the loss, a norm) without a reshape, a tensor op
            values = [value.item()] if dim == 0 else value.tolist() if dim == 1 else value.reshape(-1).tolist()
            if self.holding:
                self._items.append((values, sink))
            else:
                sink(values)
        else:
            # Keeps order with already-queued device values: a CPU value behind a
            # queued CUDA value waits for the same flush.
            self._items.append((value.detach(), sink))
            self._tensors += 1

    def release(self) -> None:
        """Stop holding and hand the host values held to their sinks, in order; tensors stay queued for the
        flush (no device transfer here)."""
        self.holding = False
        if not self._tensors:  # only host values (every CPU step): all of them, without sorting them out
            ready, self._items = self._items, []
        else:
            ready = [(value, sink) for value, sink in self._items if not isinstance(value, torch.Tensor)]
            if ready:
                self._items = [(value, sink) for value, sink in self._items if isinstance(value, torch.Tensor)]
        for values, sink in ready:
            sink(values)  # type: ignore[arg-type]

    def flush(self) -> None:
        """Resolve everything queued: one device-to-host copy per device."""
        if not self._items:
            return
        items, self._items = self._items, []
        self._tensors = 0
        by_device: dict[torch.device, list[int]] = {}
        resolved: list[list[float]] = [[] for _ in items]
        for index, (value, _) in enumerate(items):
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append(index)
            else:
                resolved[index] = value
        for indices in by_device.values():
            flat = [items[i][0].reshape(-1).to(torch.float64) for i in indices]  # type: ignore[union-attr]
            values = torch.cat(flat).tolist()
            offset = 0
            for i, part in zip(indices, flat, strict=True):
                resolved[i] = values[offset : offset + part.numel()]
                offset += part.numel()
        for (_, sink), values in zip(items, resolved, strict=True):
            sink(values)
