"""rankscope's reference trainer: a CLIP-style image-text model trained with DDP, instrumented end to end.

Run it with `torchrun --nproc_per_node=2 -m trainer --config trainer/configs/demo.yaml`.
It uses the `exporter` package exactly as a user's own script would: through
its public API only. One module per concept:

- `config`: the YAML schema (one dataclass per section), validated at start.
- `data`, `tokenizer`: synthetic shapes or a manifest of your images; a word-level tokenizer.
- `model`: the dual encoder, its contrastive loss and statistics.
- `loop`: the Trainer; `checkpoint`: atomic save and resume; `faults`: fault injection.
- `stats`, `logbook`: the trainer's own metrics; progress lines and a JSONL log.
- `runtime`: process group, device, seeds and RNG state.
"""

from exporter._lazy import require

# The reference trainer is an extra: `pip install rankscope` alone brings only what the exporter needs.
require("trainer", "torchvision", "transformers", "PIL")

__all__: list[str] = []
