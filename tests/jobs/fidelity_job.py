"""Bit-identity under DDP, FSDP2 and tensor parallel: each archetype trained plainly and monitored (run by
torchrun in tests/test_fidelity.py).

`--parallel ddp` (2 ranks): gradients accumulated over several micro-batches with `no_sync` on all but the
last, the all-reduce timed by rankscope's comm hook. `--parallel fsdp2` (2 ranks): `fully_shard` per block
and on the root, clipping on, accumulation with gradient sync off but on the last micro-batch, and a
bf16 mixed-precision policy. `--parallel tp` (4 ranks): a 2-D (data 2 x tensor 2) mesh; the MLP split
column- and row-wise with `parallelize_module`, alone (its head a plain tensor beside DTensors) and
under FSDP2 over the data dimension; and HSDP: `fully_shard` over a 2-D (replicate 2 x shard 2) mesh.
Every optional probe is on at every step.

Each rank writes `<out>/rank<r>.json`: {case: [differences]} (empty lists when bit-identical, and the
monitor's own module norms are of whole parameters: their root-sum-square is the recorded total norm).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.fidelity_loops import Trace, differences, train

#: (archetype, micro-batches per optimizer step) trained under DDP.
CASES = (("accumulation_hand_written_lr", 3), ("gpt2_tied_embeddings", 2), ("three_param_groups", 2))


def _ddp(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14's broadcast_buffers notice
        return DistributedDataParallel(model)


def _fsdp2(mesh: Any = None, bf16: bool = False) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {"mesh": mesh} if mesh is not None else {}
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(model: nn.Module) -> None:
        # One FSDP unit per transformer block (GPT-2) or per trainable top-level layer, then the root.
        blocks = model.transformer.h if hasattr(model, "transformer") else list(model.children())
        for block in blocks:
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block, **options)
        fully_shard(model, **options)

    return shard


def _tensor_parallel(mesh: Any, with_fsdp: bool) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def shard(model: nn.Module) -> None:
        # The head is split too: torch's clip takes no mix of DTensor and plain gradients, nor of meshes.
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": RowwiseParallel(input_layouts=Replicate())}
        parallelize_module(model, mesh["tp"], plan)
        if with_fsdp:
            _fsdp2(mesh["dp"])(model)

    return shard


def _check(runs: list[Trace], shared: bool) -> list[str]:
    found = differences(*runs)
    monitored = runs[1]
    if monitored.monitor_errors:
        found.append(f"monitor errors {monitored.monitor_errors}")
    if shared and not monitored.shared_clip:  # bit-identical by the monitor's own path
        found.append("the clip did not share its norms")
    if not shared:
        # Sharded: module norms are of whole parameters, so they add up to the total (pre-clip) norm.
        total = math.sqrt(sum(v * v for v in monitored.module_norms.values()))
        if not monitored.module_norms or not math.isclose(total, monitored.recorded_norm or 0.0, rel_tol=1e-4):
            found.append(f"module norms {monitored.module_norms} do not make the total {monitored.recorded_norm}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--parallel", choices=("ddp", "fsdp2", "tp"), default="ddp")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    common = {"steps": args.steps, "rank": rank, "world_size": world}

    found = {}
    if args.parallel == "ddp":
        for archetype, accumulation in CASES:
            runs = [train(archetype, m, wrap=_ddp, accumulation=accumulation, **common) for m in (False, True)]
            found[archetype] = _check(runs, shared=True)
    elif args.parallel == "fsdp2":
        cases = {
            "fsdp2 mlp_frozen_two_groups": ("mlp_frozen_two_groups", 1, _fsdp2()),
            "fsdp2 gpt2_tied_embeddings": ("gpt2_tied_embeddings", 1, _fsdp2()),
            "fsdp2 accumulation_hand_written_lr x3": ("accumulation_hand_written_lr", 3, _fsdp2()),
            "fsdp2 bf16 mixed precision": ("three_param_groups", 2, _fsdp2(bf16=True)),
        }
        for name, (archetype, accumulation, shard) in cases.items():
            runs = [train(archetype, m, shard=shard, accumulation=accumulation, **common) for m in (False, True)]
            found[name] = _check(runs, shared=False)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for name, with_fsdp in (("tp alone on a 1-d submesh", False), ("tp + fsdp2 2-d mesh", True)):
            shard = _tensor_parallel(mesh, with_fsdp)
            runs = [train("tensor_parallel_mlp", m, shard=shard, **common) for m in (False, True)]
            found[name] = _check(runs, shared=False)
        # HSDP: parameters sharded over dp_shard and replicated over dp_replicate (module statistics count
        # a replica once), clipping and accumulation as under FSDP2.
        hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for archetype, accumulation in (("mlp_frozen_two_groups", 1), ("accumulation_hand_written_lr", 3)):
            runs = [train(archetype, m, shard=_fsdp2(hsdp), accumulation=accumulation, **common) for m in (False, True)]
            found[f"hsdp 2x2 mesh {archetype}"] = _check(runs, shared=False)
    (args.out / f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
    # The verdict is written. Skip the interpreter's teardown: the DeviceMeshes still hold gloo groups, whose
    # worker threads may release a tensor with a Python object after finalization began; taking the GIL then
    # aborts the process ("terminate called without an active exception", once in ~50 runs of the tp case).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
