"""The two small collectives of the control channel, on its own gloo group.

Why gloo and CPU tensors: the control group never touches the accelerator, so
a step boundary costs no device synchronisation even when training uses NCCL,
and a paused job keeps no NCCL collective in flight for the watchdog to kill.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_on_worst", "broadcast_json", "exchange"]


def broadcast_json(value: Any, group: Any, rank: int) -> Any:
    """Rank 0's `value` (JSON-able; None sends nothing), returned on every rank of `group`.

    Two broadcasts: the length (one int64), then the UTF-8 bytes; an empty
    payload (the common case: nothing pending) costs just the first. JSON, not
    pickle, so nothing received can execute code.
    """
    data = json.dumps(value, separators=(",", ":")).encode("utf-8") if rank == 0 and value is not None else b""
    header = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    size = int(header.item())
    if size == 0:
        return None
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 else torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    # Rank 0 decodes its own bytes too, so every rank holds an identical value.
    return json.loads((data if rank == 0 else bytes(buffer.tolist())).decode("utf-8"))


def exchange(value: Any, flags: list[int], group: Any, rank: int) -> tuple[Any, list[int]]:
    """Rank 0's JSON `value` (None: nothing) on every rank, and every rank's `flags` OR-ed together.

    One all-reduce (MAX) of [payload length (rank 0's; 0 elsewhere), *flags] tells every rank the
    length and whether any rank raised a flag (a signal received on rank 1 alone stops rank 0 too);
    the payload itself is broadcast only when there is one. The common case, nothing pending and no
    flag, costs that one small all-reduce, as a broadcast of the length alone did.
    """
    data = json.dumps(value, separators=(",", ":")).encode("utf-8") if rank == 0 and value is not None else b""
    header = torch.tensor([len(data), *flags], dtype=torch.int64)
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    size, *agreed = (int(v) for v in header.tolist())
    if size == 0:
        return None, agreed
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 else torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    return json.loads((data if rank == 0 else bytes(buffer.tolist())).decode("utf-8")), agreed


def agree_on_worst(codes: list[int], group: Any) -> list[int]:
    """Element-wise maximum of every rank's `codes` (one int64 all-reduce), so every rank
    learns whether any rank failed."""
    tensor = torch.tensor(codes, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(code) for code in tensor.tolist()]
