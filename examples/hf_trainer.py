"""Fine-tune a tiny BERT with `transformers.Trainer` and rankscope's callback; nothing is downloaded.

    .venv/bin/python -m examples.hf_trainer --output-dir /tmp/hf-run          # from the repository root
    RANKSCOPE_CONTROL_TOKEN=s3cret .venv/bin/torchrun --nproc_per_node=2 -m examples.hf_trainer \\
        --output-dir /tmp/hf-run --max-steps 100000 --control

The model is a `BertForSequenceClassification` built from a small config and
the data set is generated: token-id sequences of random length (padded, with
an attention mask), labelled 1 when most tokens come from the upper half of
the vocabulary. Every process serves /metrics on base_port + local_rank; with
`--control` the main process serves the control endpoint (bearer token from
RANKSCOPE_CONTROL_TOKEN or --control-token-file). At the end each process
writes the Trainer's log history to <output-dir>/log_history.rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from rankscope import MonitorConfig
from rankscope.control import ControlConfig, init_restartable_process_group
from rankscope.integrations.hf.callback import RankscopeCallback
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, PrinterCallback, Trainer, TrainingArguments

VOCAB_SIZE = 64
MAX_LENGTH = 32
PAD_ID = 0


class MajorityDataset(Dataset):
    """Generated sequence classification: is the majority of tokens in the upper half of the vocabulary?"""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, VOCAB_SIZE, (size, MAX_LENGTH), generator=generator)
        lengths = torch.randint(MAX_LENGTH // 4, MAX_LENGTH + 1, (size,), generator=generator)
        self.attention_mask = (torch.arange(MAX_LENGTH) < lengths[:, None]).long()
        self.input_ids = self.input_ids * self.attention_mask + PAD_ID * (1 - self.attention_mask)
        upper = ((self.input_ids >= VOCAB_SIZE // 2) & self.attention_mask.bool()).sum(dim=1)
        self.labels = (2 * upper > lengths).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


def build_model(seed: int = 0) -> BertForSequenceClassification:
    """A two-layer BERT small enough to train on a laptop CPU."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_LENGTH,
        pad_token_id=PAD_ID,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def build_trainer(
    output_dir: str,
    max_steps: int,
    *,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    lr_scheduler_type: str = "constant",
    save_steps: int = 0,
    seed: int = 0,
    ddp_timeout: int = 1800,
) -> Trainer:
    """A Trainer on CPU that logs every step and saves only when asked (save_steps=0) or every save_steps."""
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type=lr_scheduler_type,
        logging_steps=1,
        # Log NaN/inf losses as they are, so rankscope's non-finite counter sees them.
        logging_nan_inf_filter=False,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        include_num_input_tokens_seen="non_padding",
        # Every parameter takes part in the forward pass: spare DDP its extra graph traversal.
        ddp_find_unused_parameters=False,
        ddp_timeout=ddp_timeout,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
    )
    trainer = Trainer(model=build_model(seed), args=args, train_dataset=MajorityDataset(4096, seed))
    # rankscope and the log history file report progress; printing every step's logs would only add noise.
    trainer.remove_callback(PrinterCallback)
    return trainer


def init_process_group(timeout_seconds: int) -> None:
    """Under torchrun, start the (gloo) process group with `timeout_seconds`.

    On CPU, TrainingArguments does not hand ddp_timeout to the process group it creates
    (transformers 5.24), so a stuck collective would wait 30 minutes whatever ddp_timeout says.
    Accelerate uses a group that already exists. It is created so that torchrun can start it again after
    rankscope's `restart` (docs/hangs.md).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        init_restartable_process_group("gloo", timeout=timedelta(seconds=timeout_seconds))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--output-dir", required=True, help="where the Trainer writes checkpoints and logs")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lr-scheduler", default="constant", help="a transformers scheduler type, e.g. linear")
    parser.add_argument("--save-steps", type=int, default=0, help="0: save only when the control endpoint asks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp-timeout", type=int, default=1800, help="seconds before a stuck collective fails")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--base-port", type=int, default=9400, help="process with local rank r serves base+r")
    parser.add_argument("--module-stats-every", type=int, default=50, help="steps between per-module statistics")
    parser.add_argument("--control", action="store_true", help="serve the control endpoint on the main process")
    parser.add_argument("--control-host", default="127.0.0.1")
    parser.add_argument("--control-port", type=int, default=9300)
    parser.add_argument("--control-token-file", default="", help="default: RANKSCOPE_CONTROL_TOKEN")
    options = parser.parse_args(argv)

    init_process_group(options.ddp_timeout)
    trainer = build_trainer(
        options.output_dir,
        options.max_steps,
        batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        lr_scheduler_type=options.lr_scheduler,
        save_steps=options.save_steps,
        seed=options.seed,
        ddp_timeout=options.ddp_timeout,
    )
    control = (
        ControlConfig(host=options.control_host, port=options.control_port, token_file=options.control_token_file)
        if options.control
        else None
    )
    metrics = MonitorConfig(
        host=options.metrics_host,
        base_port=options.base_port,
        module_stats_every_n_steps=options.module_stats_every,
    )
    RankscopeCallback.attach(trainer, metrics, control)
    trainer.train()

    rank = int(os.environ.get("RANK", "0"))
    history = Path(options.output_dir) / f"log_history.rank{rank}.json"
    history.write_text(json.dumps(trainer.state.log_history, indent=1))


if __name__ == "__main__":
    main()
