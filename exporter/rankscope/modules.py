"""Per-module gradient norms and update ratios, on an interval.

Modules are grouped by the model's top-level children (a bounded `module`
label: at most `max_groups`, the rest share "other"). Every statistic is one
vector with a value per group, computed with a handful of fused ops whatever
the number of parameters, and stays on the device; the monitor resolves it
with its batched transfer.

Update ratio = ||param_after - param_before|| / ||param_before|| per group,
from optimizer step hooks (public Optimizer API): on due steps only, the
pre-hook copies the parameters into one flat float32 buffer per device (laid
out group by group, so a group is a slice) and the post-hook subtracts the
new values in place. Other steps cost nothing; between due steps only a CPU
buffer is kept (see _FlatSnapshot).

Sharded parameters (DTensor: FSDP2, HSDP, tensor parallel) are measured whole: each rank takes the
squares of its local shards (a replicated placement weighted by 1/replicas, so a replica counts once),
and on due steps only the per-group squares are summed over the mesh in one all-reduce per statistic
(on the default group when every mesh spans the job; else one per mesh dimension). The reduction stays
on the device, so it adds no host synchronisation. Parameters are keyed by mesh equality (two equal
meshes are one), never by id().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

__all__ = ["ModuleStats", "module_groups"]

try:  # torch.distributed.tensor exists on every build we support; a build without it has no DTensor
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

Sink = Callable[[str, list[str], torch.Tensor], None]  # (metric suffix, group names, one value per group)


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP and FSDP-style wrappers keep the real model in `.module`, torch.compile's in `._orig_mod`, their
    # only child; a model of the user's that merely has a child called `module` beside others is not one.
    for attribute in ("module", "_orig_mod"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module) and [child for _, child in model.named_children()] == [inner]:
            return _unwrap(inner)
    return model


def module_groups(model: nn.Module, max_groups: int) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters grouped by top-level child; bounded for label safety.

    A parameter shared by several modules (tied input and output embeddings) belongs to the group of
    the first module that holds it, as `model.parameters()` counts it: once."""
    root = _unwrap(model)
    groups: dict[str, list[nn.Parameter]] = {name: [] for name, _ in root.named_children()}
    groups["root"] = []
    # named_parameters() yields each parameter once, under the first name that reaches it.
    for name, param in root.named_parameters():
        if param.requires_grad:
            head, dot, _ = name.partition(".")
            groups[head if dot and head in groups else "root"].append(param)
    groups = {name: params for name, params in groups.items() if params}
    if len(groups) > max_groups:
        names = list(groups)
        kept = {n: groups[n] for n in names[: max_groups - 1]}
        kept["other"] = [p for n in names[max_groups - 1 :] for p in groups[n]]
        groups = kept
    return groups


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor itself)."""
    return tensor.to_local() if DTensor is not None and isinstance(tensor, DTensor) else tensor


def _layout_of(param: torch.Tensor) -> tuple[Any, tuple[Any, ...]] | None:
    """(mesh, placements) of a DTensor parameter, None for a plain one; a placement that is neither
    sharded nor replicated has no whole-parameter norm from its local part: refused, in one line."""
    if DTensor is None or not isinstance(param, DTensor):
        return None
    for placement in param.placements:
        # _StridedShard (FSDP2 over a tensor-parallel dimension) splits the tensor too, but is no Shard.
        if not (placement.is_shard() or placement.is_replicate() or hasattr(placement, "split_factor")):
            raise TypeError(f"module statistics: a parameter placed {placement!r} (only shards/replicas are measured)")
    return param.device_mesh, tuple(param.placements)


@dataclass
class _DeviceShard:
    """The parameters that live on one device (under one mesh and placement, for DTensors), in group order,
    with where each group's slice starts and ends. Sizes and buffers are of the local parts."""

    device: torch.device
    layout: tuple[Any, tuple[Any, ...]] | None = None  # (mesh, placements) of sharded parameters
    params: list[nn.Parameter] = field(default_factory=list)
    group_of: list[int] = field(default_factory=list)  # group index of each parameter
    bounds: list[tuple[int, int, int]] = field(default_factory=list)  # (group index, first element, end)
    bound_groups: torch.Tensor | None = None  # the group index of each entry of `bounds`, on the device
    _index_cache: dict[tuple[bool, ...] | None, torch.Tensor] = field(default_factory=dict)
    _snapshot: _FlatSnapshot | None = None

    def group_index(self, present: tuple[bool, ...] | None) -> torch.Tensor:
        """Group index of each present parameter (None: all are), as a device tensor built once per pattern."""
        found = self._index_cache.get(present)
        if found is None:
            chosen = [
                g for g, there in zip(self.group_of, present or (True,) * len(self.group_of), strict=True) if there
            ]
            found = self._index_cache[present] = torch.tensor(chosen, dtype=torch.long, device=self.device)
        return found

    def snapshot(self) -> _FlatSnapshot:
        if self._snapshot is None:
            self._snapshot = _FlatSnapshot(self)
        return self._snapshot

    def locals(self) -> list[torch.Tensor]:
        """The parameters' local parts (themselves when plain)."""
        if self.layout is None:
            return list(self.params)  # a Parameter list, as tensors (due steps only: the copy is cheap)
        return [_local(p) for p in self.params]

    @property
    def weight(self) -> float:
        """How much one rank's squares count: 1 / the number of ranks holding the same part."""
        if self.layout is None:
            return 1.0
        mesh, placements = self.layout
        replicas = 1
        for dim, placement in enumerate(placements):
            if placement.is_replicate():
                replicas *= mesh.size(dim)
        return 1.0 / replicas


class _FlatSnapshot:
    """One float32 buffer holding a copy of a shard's parameters, with a view shaped like each of them.

    The views are built once (building 100s of views costs more than the copy itself). On an
    accelerator the memory behind them is allocated only while a snapshot is held (`take` ..
    `release`), as device memory is what training runs short of; on CPU it stays allocated, since
    host memory is plentiful and a fresh allocation would page-fault on every due step.
    """

    def __init__(self, shard: _DeviceShard) -> None:
        self.flat = torch.empty(shard.bounds[-1][2], dtype=torch.float32, device=shard.device)
        self._bytes = self.flat.untyped_storage().nbytes()
        offsets = [0]
        local = shard.locals()
        for param in local:
            offsets.append(offsets[-1] + param.numel())
        self.views = [
            self.flat.narrow(0, offset, param.numel()).view(param.shape)
            for offset, param in zip(offsets, local, strict=False)
        ]
        self.group_slices = [self.flat[start:end] for _, start, end in shard.bounds]
        self._keep = shard.device.type == "cpu"
        self.release()

    def take(self, params: list[torch.Tensor]) -> None:
        if not self._keep:
            self.flat.untyped_storage().resize_(self._bytes)
        torch._foreach_copy_(self.views, params)

    def subtract(self, params: list[torch.Tensor]) -> None:
        torch._foreach_sub_(self.views, params)  # the buffer now holds before - after

    def release(self) -> None:
        if not self._keep:
            self.flat.untyped_storage().resize_(0)


def _shards(groups: dict[str, list[nn.Parameter]]) -> list[_DeviceShard]:
    by_device: dict[tuple[torch.device, Any], _DeviceShard] = {}
    for index, params in enumerate(groups.values()):
        for param in params:
            layout = _layout_of(param)
            shard = by_device.setdefault((param.device, layout), _DeviceShard(param.device, layout))
            shard.params.append(param)
            shard.group_of.append(index)
    for shard in by_device.values():
        start = 0
        for index in sorted(set(shard.group_of)):
            members = [p for p, g in zip(shard.params, shard.group_of, strict=True) if g == index]
            end = start + sum(_local(p).numel() for p in members)
            shard.bounds.append((index, start, end))
            start = end
        shard.bound_groups = torch.tensor([b[0] for b in shard.bounds], dtype=torch.long, device=shard.device)
        # Group order within the shard, so each group is one slice of the flat snapshot.
        order = sorted(range(len(shard.params)), key=lambda i: shard.group_of[i])
        shard.params = [shard.params[i] for i in order]
        shard.group_of = [shard.group_of[i] for i in order]
    return list(by_device.values())


def _combine_squares(shards: list[_DeviceShard], squares: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-group squared 2-norms of whole parameters from each shard's local per-group squares (None: the
    shard had nothing this step). Sharded parts are summed over their mesh: every shard's squares in one
    all-reduce on the default group when each mesh spans the job, else one per mesh dimension."""
    present = [(shard, sq) for shard, sq in zip(shards, squares, strict=True) if sq is not None]
    if not present:
        return None
    plain = [sq for shard, sq in present if shard.layout is None]
    sharded = [(shard, sq * shard.weight if shard.weight != 1.0 else sq) for shard, sq in present if shard.layout]
    if sharded:
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for shard, sq in sharded:
            by_mesh.setdefault(shard.layout[0], []).append(sq)  # type: ignore[index]
        world = torch.distributed.get_world_size()
        if all(mesh.size() == world for mesh in by_mesh):
            summed = torch.stack([sq for parts in by_mesh.values() for sq in parts])
            torch.distributed.all_reduce(summed)
            plain.extend(summed.unbind(0))
        else:
            for mesh, parts in by_mesh.items():
                summed = torch.stack(parts)
                for dim in range(mesh.ndim):
                    torch.distributed.all_reduce(summed, group=mesh.get_group(dim))
                plain.extend(summed.unbind(0))
    first = plain[0].device
    return torch.stack([sq.to(first) for sq in plain]).sum(dim=0)


def _torch_gradient_norms(
    grads: list[torch.Tensor], foreach: bool | None
) -> tuple[list[tuple[list[int], list[torch.Tensor]]], torch.Tensor]:
    """The gradients' 2-norms and their total norm, computed exactly as torch's `get_total_norm`
    computes them (torch/nn/utils/clip_grad.py): grouped by device and dtype, one `_foreach_norm` per
    group, then the norm of the stacked norms in group order. The same ops in the same order give the
    same bits; `ModuleStats` checks that once against torch itself.

    Returns, per device/dtype group, the gradients' positions in `grads` and their norms; and the total."""
    # The grouping torch's own uses (its private helpers are typed for lists of optional tensors).
    grouped = _group_tensors_by_device_and_dtype([cast("list[torch.Tensor | None]", grads)], with_indices=True)
    groups = []
    stacked: list[torch.Tensor] = []
    for (device, _), ([optional_grads], positions) in grouped.items():
        device_grads = cast("list[torch.Tensor]", optional_grads)
        if (foreach is None and _has_foreach_support(device_grads, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            norms = list(torch._foreach_norm(device_grads, 2.0))
        else:
            norms = [torch.linalg.vector_norm(g, 2.0) for g in device_grads]
        stacked.extend(norms)
        groups.append((positions, norms))
    first = grads[0].device
    if len(groups) > 1 or stacked[0].device != first:  # .to() of a tensor already there returns it unchanged
        stacked = [norm.to(first) for norm in stacked]
    total = torch.linalg.vector_norm(torch.stack(stacked), 2.0)
    return groups, total


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two scalar tensors (NaN equals the same NaN; one host sync)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(1).view(torch.uint8), b.reshape(1).view(torch.uint8)))


class ModuleStats:
    """Computes the interval statistics and hands one tensor per metric to `sink`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any | None,
        every: int,
        max_groups: int,
        sink: Sink,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.groups = module_groups(model, max_groups)
        self._names = list(self.groups)
        self._shards = _shards(self.groups)
        self._watched_ids = {id(p) for shard in self._shards for p in shard.params}
        # Sharded gradients: torch's clip reduces over the mesh itself, so the norms are not shared with it.
        self._sharded = any(shard.layout is not None for shard in self._shards)
        self._group_of = {id(p): index for index, params in enumerate(self.groups.values()) for p in params}
        self._sharing_checked = False
        self._sharing_exact = True
        self._index_of: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._every = every
        self._sink = sink
        self._due = False
        self._grad_norms_recorded = False
        self._befores: list[torch.Tensor] | None = None  # per shard: group norms of the parameters before the step
        self._on_error = on_error
        self._handles = []
        if optimizer is not None and every > 0:
            self._handles.append(optimizer.register_step_pre_hook(self._guarded(self._snapshot)))
            self._handles.append(optimizer.register_step_post_hook(self._guarded(self._update_ratios)))

    def _guarded(self, hook: Callable[[Any, Any, Any], None]) -> Callable[[Any, Any, Any], None]:
        # These run inside the user's optimizer.step(): a failure here is reported, never raised into it.
        def run(optimizer: Any, args: Any, kwargs: Any) -> None:
            try:
                hook(optimizer, args, kwargs)
            except Exception as exc:
                self._drop_snapshots()
                if self._on_error is None:
                    raise
                self._on_error(exc)

        return run

    def disable(self) -> None:
        """Switch the statistics off for good (after a failure): every hook and call is a no-op from here on.
        The hooks stay registered (removing one from inside the optimizer's step would break its loop)."""
        self._every = 0
        self._due = False
        self._drop_snapshots()

    def begin_step(self, step: int) -> None:
        self._due = self._every > 0 and step % self._every == 0
        self._grad_norms_recorded = False

    def record_grad_norms(self) -> None:
        """Call after backward, while the gradients are there (the step context does)."""
        if not self._due or self._grad_norms_recorded:
            return
        with torch.no_grad():
            squares = self._grad_norm_squares()
            if squares is not None:
                self._sink("module_grad_norm", self._names, squares.sqrt())
        self._grad_norms_recorded = True

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, foreach: bool | None = None
    ) -> torch.Tensor | None:
        """Clip as `torch.nn.utils.clip_grad_norm_(parameters, max_norm, 2.0, False, foreach)` does, bit for
        bit, keeping the per-gradient norms it computes for this step's module grad norms.

        Returns the total norm (before clipping), or None when sharing does not apply (the module norms
        are not due, `parameters` are not exactly the watched ones, or this torch computes its total norm
        differently from `_torch_gradient_norms`): then clip with torch as usual."""
        if not self._due or self._grad_norms_recorded or not self._shards or not self._sharing_exact or self._sharded:
            return None
        # Loops over parameters are the cost here (this runs every due step): the common case, the
        # watched parameters themselves, is settled by a C-level set comparison.
        if set(map(id, parameters)) != self._watched_ids and not self._same_with_gradients(parameters):
            return None
        with torch.no_grad():
            with_grads = [p for p in parameters if p.grad is not None]
            if not with_grads:
                return None
            grads = [p.grad for p in with_grads if p.grad is not None]
            groups, total = _torch_gradient_norms(grads, foreach)
            if not self._sharing_checked:
                # Once per run: the total must be torch's own, bit for bit, or sharing is off for good.
                self._sharing_checked = True
                reference = torch.nn.utils.get_total_norm(grads, 2.0, False, foreach)
                if not _same_bits(total, reference):
                    self._sharing_exact = False
                    return None
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total, foreach)
            self._grad_norms_recorded = True
            # The gradients are clipped: from here on a failure is reported, and the caller gets torch's
            # total all the same (a fallback that clipped again would change training).
            try:
                self._sink("module_grad_norm", self._names, self._group_squares(with_grads, groups).sqrt())
            except Exception as exc:
                if self._on_error is None:
                    raise
                self._on_error(exc)
        return total

    def _group_squares(
        self, params: list[torch.Tensor], groups: list[tuple[list[int], list[torch.Tensor]]]
    ) -> torch.Tensor:
        """Squared 2-norm per module group from the per-parameter norms (one stack per device/dtype
        group: call count is the cost here); a parameter listed twice counts once."""
        first = groups[0][1][0].device
        slot = len(self._names)  # repeats go to a slot that is dropped
        per_group = torch.zeros(slot + 1, device=first)
        for (_, norms), index in zip(groups, self._group_index_of(params, groups, first), strict=True):
            per_group.index_add_(0, index, torch.stack(norms).to(first, torch.float32).square())
        return per_group[:slot]

    def _group_index_of(
        self, params: list[torch.Tensor], groups: list[tuple[list[int], list[torch.Tensor]]], device: torch.device
    ) -> list[torch.Tensor]:
        """For each device/dtype group, the module group of each of its parameters, as device tensors built
        once per parameter list (a host-to-device copy every due step would be a synchronisation)."""
        key = tuple(map(id, params))
        found = self._index_of.get(key)
        if found is None:
            slot, seen, of_position = len(self._names), set(), []
            for param_id in key:
                of_position.append(slot if param_id in seen else self._group_of[param_id])
                seen.add(param_id)
            found = self._index_of[key] = [
                torch.tensor([of_position[p] for p in positions], dtype=torch.long, device=device)
                for positions, _ in groups
            ]
        return found

    def _same_with_gradients(self, parameters: list[torch.Tensor]) -> bool:
        """Whether `parameters` and the watched ones have the same gradients (both sides skip the None ones)."""
        theirs = {id(p) for p in parameters if p.grad is not None}
        return theirs == {id(p) for shard in self._shards for p in shard.params if p.grad is not None}

    def _grad_norm_squares(self) -> torch.Tensor | None:
        """Squared gradient 2-norm per group (float32, on the first shard's device; None without gradients)."""
        per_shard: list[torch.Tensor | None] = []
        for shard in self._shards:
            grads = [_local(p.grad) for p in shard.params if p.grad is not None]
            if not grads:
                per_shard.append(None if shard.layout is None else torch.zeros(len(self._names), device=shard.device))
                continue  # a sharded shard still joins its mesh's reduction: every rank must
            present = None if len(grads) == len(shard.params) else tuple(p.grad is not None for p in shard.params)
            norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
            per_group = torch.zeros(len(self._names), device=shard.device)
            per_group.index_add_(0, shard.group_index(present), norms.square())
            per_shard.append(per_group)
        return _combine_squares(self._shards, per_shard)

    def _snapshot(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._due:
            return
        with torch.no_grad():
            self._befores = []
            for shard in self._shards:
                shard.snapshot().take(shard.locals())
                self._befores.append(self._group_norms(shard).square())

    def _update_ratios(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        befores, self._befores = self._befores, None
        if not befores:
            return
        with torch.no_grad():
            deltas: list[torch.Tensor | None] = []
            for shard in self._shards:
                shard.snapshot().subtract(shard.locals())
                deltas.append(self._group_norms(shard).square())
                shard.snapshot().release()
            # The change and the parameters before it in one reduction: [delta², before²] per shard.
            both = _combine_squares(
                self._shards,
                [torch.cat([d, b]) for d, b in zip(deltas, befores, strict=True)],  # type: ignore[list-item]
            )
            if both is None:
                return
            groups = len(self._names)
            delta, before = both[:groups].sqrt(), both[groups:].sqrt()
            # Tiny epsilon: a zero-initialised group must not divide by zero.
            self._sink("update_ratio", self._names, delta / (before + 1e-12))

    def _group_norms(self, shard: _DeviceShard) -> torch.Tensor:
        """Each group's norm over its slice of the shard's buffer (zero for groups with no parameter there)."""
        norms = torch.stack(torch._foreach_norm(shard.snapshot().group_slices))
        if len(shard.bounds) == len(self._names):
            return norms
        assert shard.bound_groups is not None  # set with the bounds (above)
        return torch.zeros(len(self._names), device=shard.device).index_copy_(0, shard.bound_groups, norms)

    def _drop_snapshots(self) -> None:
        if self._befores is not None:
            for shard in self._shards:
                shard.snapshot().release()
        self._befores = None

    def close(self) -> None:
        self._drop_snapshots()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
