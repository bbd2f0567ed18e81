"""The trainer's own metrics (beyond the exporter's core), recorded through the monitor's public API.

Everything is handed over as tensors where it lives (host tensors for what
the collate function computed, device tensors for what the model computed);
the monitor turns device values into numbers in its batched transfer, so
nothing here synchronises with the device.
"""

from __future__ import annotations

from typing import Any

import torch

from .data import Batch
from .model import DualEncoder, attention_entropy

__all__ = ["record_accuracy", "record_batch_stats", "record_model_stats"]

_CHANNELS = ("r", "g", "b")
_DIRECTIONS = ("image_to_text", "text_to_image")


def record_accuracy(monitor: Any, accuracy: torch.Tensor | list[float], split: str) -> None:
    """`accuracy` = [image->text, text->image], as `contrastive_accuracy` returns it."""
    for index, direction in enumerate(_DIRECTIONS):
        monitor.set("contrastive_accuracy_ratio", accuracy[index], split=split, direction=direction)


def record_batch_stats(monitor: Any, batch: Batch, images: torch.Tensor) -> None:
    """Text lengths and padding, source image sizes, channel statistics of the (normalised) images."""
    monitor.observe("text_length_tokens", batch.lengths)
    monitor.set("text_padding_ratio", 1.0 - batch.tokens / max(1, batch.input_ids.numel()))
    monitor.observe("image_size_pixels", batch.sizes[:, 0], axis="width")
    monitor.observe("image_size_pixels", batch.sizes[:, 1], axis="height")
    with torch.no_grad():
        flat = images.detach().float().transpose(0, 1).reshape(images.shape[1], -1)
        mean, std = flat.mean(dim=1), flat.std(dim=1)
    for index, channel in enumerate(_CHANNELS[: images.shape[1]]):
        monitor.set("image_channel_mean", mean[index], channel=channel)
        monitor.set("image_channel_std", std[index], channel=channel)


def record_model_stats(monitor: Any, model: DualEncoder, batch: Batch) -> None:
    """Fusion gate weight statistics, temperature, and per-layer attention entropy on `batch` (on device)."""
    with torch.no_grad():
        weight = model.fusion.gate.weight.detach().float()
        monitor.set("fusion_gate_weight", weight.mean(), stat="mean")
        monitor.set("fusion_gate_weight", weight.std(), stat="std")
        monitor.set("fusion_gate_weight", weight.abs().max(), stat="max_abs")
        monitor.set("contrastive_temperature", 1.0 / model.scale().detach())
        # One extra text-encoder forward on the interval, in eval mode (no dropout, RNG untouched).
        was_training = model.training
        model.eval()
        try:
            attentions = model.text_attentions(batch.input_ids, batch.attention_mask)
        finally:
            model.train(was_training)
        entropy = attention_entropy(attentions, batch.attention_mask)
    for layer in range(entropy.shape[0]):
        monitor.set("attention_entropy_nats", entropy[layer], layer=str(layer))
