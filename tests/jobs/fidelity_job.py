"""Bit-identity under DDP: each archetype trained plainly and monitored, on 2 ranks (run by torchrun in tests).

Gradients are accumulated over several micro-batches with `no_sync` on all but the last, the monitored
run times the all-reduce with rankscope's comm hook, and every optional probe is on at every step.
Each rank writes `<out>/rank<r>.json`: {archetype: [differences]} (empty lists when bit-identical).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.fidelity_loops import differences, train

#: (archetype, micro-batches per optimizer step) trained under DDP.
CASES = (("accumulation_hand_written_lr", 3), ("gpt2_tied_embeddings", 2), ("three_param_groups", 2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def wrap(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.14's broadcast_buffers notice
            return DistributedDataParallel(model)

    found = {}
    for archetype, accumulation in CASES:
        runs = [
            train(archetype, monitored, args.steps, wrap=wrap, rank=rank, world_size=world, accumulation=accumulation)
            for monitored in (False, True)
        ]
        found[archetype] = differences(*runs)
        if runs[1].monitor_errors or not runs[1].shared_clip:  # bit-identical by the monitor's own path
            found[archetype].append(f"monitor errors {runs[1].monitor_errors}, shared clip {runs[1].shared_clip}")
    (args.out / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
