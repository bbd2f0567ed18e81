"""Lightning's own launcher: run with plain `python tests/jobs/lightning_launcher_job.py --out DIR`; the
Trainer (strategy="ddp", devices=2) starts rank 1 itself, which sets LOCAL_RANK and WORLD_SIZE but not RANK.

Each rank writes DIR/rank<global_rank>.metrics.txt (its last metrics page) and
DIR/rank<global_rank>.identity.json (the monitor's identity) when fit() returns. The processes' stderr
holds rankscope's log lines with their rank prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--control", action="store_true", help="ask for the control endpoint (rank 0)")
    args = parser.parse_args(argv)

    import lightning.pytorch as pl
    import torch
    from prometheus_client import generate_latest
    from rankscope import MonitorConfig
    from rankscope.control import ControlConfig
    from rankscope.integrations.lightning.callback import RankscopeCallback

    from examples.lightning_example import Regression, make_loader

    torch.set_num_threads(1)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    control = ControlConfig(port=0) if args.control else None
    callback = RankscopeCallback(MonitorConfig(host="127.0.0.1", base_port=0, probes=()), control)
    trainer = pl.Trainer(
        default_root_dir=str(args.out),
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Regression(), make_loader(256, 8))
    rank = trainer.global_rank
    (args.out / f"rank{rank}.metrics.txt").write_bytes(generate_latest(callback.monitor.registry))
    identity = dataclasses.asdict(callback.monitor.identity)
    (args.out / f"rank{rank}.identity.json").write_text(json.dumps(identity))
    callback.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo's teardown at interpreter exit can crash
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
