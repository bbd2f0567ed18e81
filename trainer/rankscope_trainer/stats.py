"""The trainer's own metrics (beyond the exporter's core), recorded through the monitor's public API.

Everything is handed over as tensors where it lives (host tensors for what
the collate function computed, device tensors for what the model computed);
the monitor turns device values into numbers in its batched transfer, so
nothing here synchronises with the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rankscope_trainer.data import Batch
from rankscope_trainer.model import DualEncoder, attention_entropy

__all__ = ["channel_mean_std", "record_accuracy", "record_batch_stats", "record_model_stats"]

_CHANNELS = ("r", "g", "b")
_DIRECTIONS = ("image_to_text", "text_to_image")
_GATE_STATS = ("mean", "std", "max_abs")


def record_accuracy(monitor: Any, accuracy: torch.Tensor | list[float], split: str) -> None:
    """`accuracy` = [image->text, text->image], as `contrastive_accuracy` returns it."""
    monitor.set_each("contrastive_accuracy_ratio", accuracy, "direction", _DIRECTIONS, split=split)


def channel_mean_std(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (sample) standard deviation over batch and pixels of an (N, C, H, W) batch.

    Sums and sums of squares per image and channel run along contiguous memory (on CPU several
    times faster than `torch.var_mean` over dims (0, 2, 3)); the N x C partial sums are combined
    in float64, so the variance formula does not lose precision to cancellation."""
    with torch.no_grad():
        flat = images.detach().reshape(images.shape[0], images.shape[1], -1).float()
        sums = flat.sum(dim=-1).double().sum(dim=0)
        squares = torch.linalg.vector_norm(flat, dim=-1).double().square().sum(dim=0)
        count = flat.shape[0] * flat.shape[2]
        mean = sums / count
        variance = (squares - count * mean.square()).clamp(min=0.0) / max(1, count - 1)
        return mean.float(), variance.sqrt().float()


def record_batch_stats(monitor: Any, batch: Batch, images: torch.Tensor) -> None:
    """Text lengths and padding, source image sizes, channel statistics of the (normalised) images."""
    monitor.observe("text_length_tokens", batch.lengths)
    monitor.set("text_padding_ratio", 1.0 - batch.tokens / max(1, batch.input_ids.numel()))
    monitor.observe("image_size_pixels", batch.sizes.reshape(-1))  # width and height alike
    mean, std = channel_mean_std(images)
    channels = _CHANNELS[: images.shape[1]]
    monitor.set_each("image_channel_mean", mean[: len(channels)], "channel", channels)
    monitor.set_each("image_channel_std", std[: len(channels)], "channel", channels)


def record_model_stats(
    monitor: Any, model: DualEncoder, batch: Batch, attention_entropy_per_layer: torch.Tensor | None = None
) -> None:
    """Fusion gate weight statistics, temperature, and per-layer attention entropy (on device).

    Pass the entropy read from the training forward (`model.recording_attention_entropy`);
    without it, this runs one extra text-encoder forward on `batch` in eval mode."""
    with torch.no_grad():
        weight = model.fusion.gate.weight.detach().float()
        std, mean = torch.std_mean(weight)
        gate = torch.stack([mean, std, torch.linalg.vector_norm(weight, ord=math.inf)])  # inf-norm = max |w|
        monitor.set_each("fusion_gate_weight", gate, "stat", _GATE_STATS)
        monitor.set("contrastive_temperature", 1.0 / model.scale().detach())
        entropy = attention_entropy_per_layer
        if entropy is None:
            entropy = _attention_entropy_by_extra_forward(model, batch)
    monitor.set_each("attention_entropy_nats", entropy, "layer", [str(layer) for layer in range(entropy.shape[0])])


def _attention_entropy_by_extra_forward(model: DualEncoder, batch: Batch) -> torch.Tensor:
    # In eval mode: no dropout, RNG untouched.
    was_training = model.training
    model.eval()
    try:
        attentions = model.text_attentions(batch.input_ids, batch.attention_mask)
    finally:
        model.train(was_training)
    return attention_entropy(attentions, batch.attention_mask)
