"""The Hugging Face Trainer asked for accelerate's FSDP (full_shard, GPT-2 blocks wrapped) on 2 CPU ranks, with
RankscopeCallback (run by torchrun in tests/test_sharded_hf.py). Each rank writes `<out>/rank<r>.json`: its
metrics registry after the run, the Trainer's own last logged grad_norm (the clip's total norm), and whether
accelerate sharded the model (`fsdp_enabled`, the wrapper's class): on CPU it does not (accelerate 1.16)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rankscope import MonitorConfig
from rankscope.integrations.hf.callback import RankscopeCallback
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    training = TrainingArguments(
        output_dir=str(args.out / "trainer"), max_steps=4, per_device_train_batch_size=4, use_cpu=True, report_to=[],
        fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]}, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no",
    )  # fmt: skip
    config = MonitorConfig(host="127.0.0.1", base_port=args.metrics_port, resolve_every_n_steps=1)
    callback = RankscopeCallback(config)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    found: dict[str, object] = {
        "trainer_grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h][-1],
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "wrapper": type(trainer.model_wrapped).__name__,
    }
    for family in callback.monitor.registry.collect():
        for sample in family.samples:
            found[sample.name + "".join(f"|{v}" for k, v in sorted(sample.labels.items()) if k == "probe")] = (
                sample.value
            )
    (args.out / f"rank{trainer.args.process_index}.json").write_text(json.dumps(found))
    # The Trainer leaves its gloo group to interpreter exit, where tearing down its threads can abort the process
    # ("terminate called without an active exception", seen once in a full test run): end it here, as a script does.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
