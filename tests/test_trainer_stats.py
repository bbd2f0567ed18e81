"""rankscope_trainer.stats: the multimodal statistics land in the contract's metrics, on a real Monitor."""

from __future__ import annotations

import math

import pytest
import torch
from rankscope import Monitor
from rankscope_trainer.config import ModelConfig
from rankscope_trainer.data import Collate, ShapesDataset, image_transform
from rankscope_trainer.model import build_model
from rankscope_trainer.stats import channel_mean_std, record_accuracy, record_batch_stats, record_model_stats
from rankscope_trainer.tokenizer import WordTokenizer

from tests.support import trainer_monitor

LABELS = {"run_id": "test", "rank": "0", "local_rank": "0", "node": "host"}


@pytest.fixture
def monitor() -> Monitor:
    return trainer_monitor()


@pytest.fixture(scope="module")
def batch_and_model():
    data = ShapesDataset(8, 48, 0, "train", image_transform(48))
    tok = WordTokenizer.build(data.captions(), 16)
    batch = Collate(tok, 48)([data[i] for i in range(8)])
    # Seeded, so that the test order does not choose the weights; seed 3's gate mean is one whose two float32
    # summation orders failed a relative tolerance. Forked, so that no other test's random numbers change.
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return batch, build_model(ModelConfig(), tok.vocab_size, tok.max_length, tok.pad_id)


def test_batch_statistics_describe_texts_and_images(monitor, batch_and_model) -> None:
    batch, _ = batch_and_model
    record_batch_stats(monitor, batch, batch.images)
    value = monitor.registry.get_sample_value
    assert value("rankscope_text_length_tokens_count", LABELS) == 8
    assert value("rankscope_text_length_tokens_sum", LABELS) == batch.tokens
    assert value("rankscope_text_padding_ratio", LABELS) == pytest.approx(1 - batch.tokens / (8 * 16))
    assert value("rankscope_image_size_pixels_sum", LABELS) == 2 * 8 * 48  # width and height of 8 images
    red_mean = batch.images[:, 0].mean().item()
    assert value("rankscope_image_channel_mean", {**LABELS, "channel": "r"}) == pytest.approx(red_mean, rel=1e-5)
    assert value("rankscope_image_channel_std", {**LABELS, "channel": "b"}) > 0


def test_model_statistics_cover_the_gate_the_temperature_and_each_attention_layer(monitor, batch_and_model) -> None:
    batch, model = batch_and_model
    record_model_stats(monitor, model, batch)
    value = monitor.registry.get_sample_value
    weight = model.fusion.gate.weight
    # A mean near zero is a float32 sum that cancels: two summation orders differ by about
    # eps * mean|w|, so the tolerance follows the weights' size, not the mean's.
    assert value("rankscope_fusion_gate_weight", {**LABELS, "stat": "mean"}) == pytest.approx(
        weight.double().mean().item(), rel=0, abs=1e-5 * weight.abs().mean().item()
    )
    assert value("rankscope_fusion_gate_weight", {**LABELS, "stat": "max_abs"}) == pytest.approx(
        weight.abs().max().item()
    )
    assert value("rankscope_contrastive_temperature", LABELS) == pytest.approx(0.07)
    for layer in ("0", "1"):
        entropy = value("rankscope_attention_entropy_nats", {**LABELS, "layer": layer})
        # An untrained layer attends almost uniformly: close to log(tokens), never above it.
        assert 0 < entropy <= math.log(16)
    assert model.training  # the eval-mode forward put it back


def test_accuracy_is_recorded_per_split_and_direction(monitor) -> None:
    record_accuracy(monitor, [0.5, 0.25], split="val")
    value = monitor.registry.get_sample_value
    assert (
        value("rankscope_contrastive_accuracy_ratio", {**LABELS, "split": "val", "direction": "image_to_text"}) == 0.5
    )
    assert (
        value("rankscope_contrastive_accuracy_ratio", {**LABELS, "split": "val", "direction": "text_to_image"}) == 0.25
    )


def test_model_statistics_use_the_entropy_read_from_the_training_forward(monitor, batch_and_model) -> None:
    batch, model = batch_and_model
    record_model_stats(monitor, model, batch, torch.tensor([0.5, 1.5]))
    value = monitor.registry.get_sample_value
    assert value("rankscope_attention_entropy_nats", {**LABELS, "layer": "0"}) == 0.5
    assert value("rankscope_attention_entropy_nats", {**LABELS, "layer": "1"}) == 1.5


@pytest.mark.parametrize("offset, scale", [(0.0, 1.0), (3.0, 1.0), (120.0, 60.0)])  # normalised .. raw 0-255 pixels
def test_channel_statistics_match_torch_over_batch_and_pixels(offset: float, scale: float) -> None:
    torch.manual_seed(0)
    images = torch.randn(6, 3, 10, 12) * torch.tensor([1.0, 2.0, 0.5])[None, :, None, None] * scale + offset
    mean, std = channel_mean_std(images)
    reference_std, reference_mean = torch.std_mean(images.transpose(0, 1).reshape(3, -1).double(), dim=1)
    assert torch.allclose(mean.double(), reference_mean, rtol=1e-5, atol=1e-5)
    assert torch.allclose(std.double(), reference_std, rtol=1e-5)
