"""Entry point of the reference trainer.

    torchrun --nproc_per_node=N -m rankscope_trainer \
        --config trainer/rankscope_trainer/configs/demo.yaml [--set k=v ...] [--resume auto]

Also runs without torchrun (`python -m rankscope_trainer ...`) as a single rank.
Without the trainer extra's packages (`pip install 'rankscope[trainer]'`) it ends
at once with status 2 and one line naming the missing package and the extra.
Bad input (config, manifest, checkpoint) and a start-up that cannot work (no
control token, metrics port taken, checkpoint.dir not writable) end the process
with status 2 and one line on stderr that names the problem. A rank that stops
because another rank failed says so in one line (status 1) instead of a
collective's traceback, so the first error stays readable. A run in which a
checkpoint could not be written ends with status 3 after training (the
checkpoints that were written are kept). SIGTERM/SIGINT: checkpoint, then
status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

try:  # first, before torch: without the trainer extra, one line naming the package and the extra
    from rankscope_trainer import _extra  # noqa: F401
except ImportError as exc:
    print(f"trainer: error: {exc}", file=sys.stderr)
    sys.exit(2)

from rankscope import MetricsPortInUse
from rankscope.control import ControlStartError

from rankscope_trainer.checkpoint import CheckpointError
from rankscope_trainer.config import ConfigError, add_overrides_option, load_config
from rankscope_trainer.data import DataError
from rankscope_trainer.fork_server import start_fork_server
from rankscope_trainer.lost_peer import lost_peer, report_lost_peer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rankscope_trainer", description="rankscope's reference trainer.")
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    add_overrides_option(parser)
    parser.add_argument(
        "--resume",
        default="none",
        metavar="auto|none|PATH",
        help="auto: newest readable checkpoint in checkpoint.dir (or start fresh); none; or a file",
    )
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
    trainer = None
    try:
        config = load_config(args.config, args.overrides)
        from rankscope_trainer.loop import Trainer  # after the config check, so a typo fails before transformers loads

        if config.data.num_workers > 0:  # now: every module imported, no thread started yet
            start_fork_server()
        trainer = Trainer(config, resume=args.resume)
        trainer.fit()
    except (ConfigError, DataError, CheckpointError, ControlStartError, MetricsPortInUse) as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if not lost_peer(exc):
            raise
        if trainer is None:  # fit() says it itself, before its clean-up
            report_lost_peer(rank, exc)
        return 1
    failures = trainer.checkpoints.failures
    if failures:
        print(f"trainer: error: {len(failures)} checkpoint(s) could not be written; last: {failures[-1]}",
              file=sys.stderr)  # fmt: skip
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
