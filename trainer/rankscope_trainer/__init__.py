"""rankscope's reference trainer: a CLIP-style image-text model trained with DDP, instrumented end to end.

Run it with `torchrun --nproc_per_node=2 -m rankscope_trainer --config trainer/rankscope_trainer/configs/demo.yaml`.
It uses the `exporter` package exactly as a user's own script would: through
its public API only. One module per concept:

- `config`: the YAML schema (one dataclass per section), validated at start.
- `data`, `tokenizer`: synthetic shapes or a manifest of your images; a word-level tokenizer.
- `model`: the dual encoder, its contrastive loss and statistics.
- `loop`: the Trainer; `checkpoint`: atomic save and resume; `faults`: fault injection.
- `metrics`, `stats`, `logbook`: the trainer's own metrics (declared beyond the exporter's contract)
  and their recording; progress lines and a JSONL log.
- `jobs`, `servers`, `processes`, `stack`, `vmstack`, `narrator`: running it and the monitoring
  servers on this machine (the demo, the tests and the benchmarks share them).
- `runtime`: process group, device, seeds and RNG state.
"""

__all__: list[str] = []
