"""rankscope_trainer.model: the dual encoder, its contrastive loss, accuracy and attention entropy."""

from __future__ import annotations

import math

import pytest
import torch
from rankscope_trainer.config import ModelConfig
from rankscope_trainer.data import Collate, ShapesDataset, image_transform
from rankscope_trainer.model import attention_entropy, build_model, contrastive_accuracy, contrastive_loss
from rankscope_trainer.tokenizer import WordTokenizer


@pytest.fixture(scope="module")
def shapes_batch():
    data = ShapesDataset(16, 48, 0, "train", image_transform(48))
    tok = WordTokenizer.build(data.captions(), 12)
    return tok, Collate(tok, 48)([data[i] for i in range(16)])


@pytest.mark.parametrize("encoder", ["vit", "resnet"])
def test_both_image_encoders_give_square_logits_over_the_batch(encoder: str, shapes_batch) -> None:
    tok, batch = shapes_batch
    cfg = ModelConfig(image_encoder=encoder, image_layers=1)
    model = build_model(cfg, tok.vocab_size, tok.max_length, tok.pad_id)
    logits = model(batch.images[:4], batch.input_ids[:4], batch.attention_mask[:4])
    assert logits.shape == (4, 4)
    # Cosine similarity times the initial inverse temperature bounds the logits.
    assert logits.abs().max() <= 1 / cfg.init_temperature + 1e-3


def test_the_loss_is_symmetric_and_near_log_n_for_uninformative_logits() -> None:
    logits = torch.zeros(8, 8)
    assert contrastive_loss(logits).item() == pytest.approx(math.log(8))
    skewed = torch.randn(8, 8)
    assert contrastive_loss(skewed).item() == pytest.approx(contrastive_loss(skewed.t()).item())


def test_accuracy_counts_each_direction_separately() -> None:
    logits = torch.eye(4) * 10
    assert contrastive_accuracy(logits).tolist() == [1.0, 1.0]
    logits[0] = torch.tensor([0.0, 20.0, 0.0, 0.0])  # image 0 prefers text 1; text 1's best is image 0
    assert contrastive_accuracy(logits).tolist() == [0.75, 0.75]
    logits = torch.eye(4) * 10
    logits[:, 0] = torch.tensor([20.0, 0.0, 30.0, 0.0])  # text 0 prefers image 2; images still pick their own
    assert contrastive_accuracy(logits).tolist() == [0.75, 0.75]


def test_attention_entropy_is_log_of_the_real_tokens_for_uniform_attention() -> None:
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    uniform = mask[:, None, None, :].float().expand(2, 2, 6, 6) / mask.sum(dim=1)[:, None, None, None]
    one_hot = torch.zeros(2, 2, 6, 6)
    one_hot[..., 0] = 1.0
    entropy = attention_entropy((uniform, one_hot), mask)
    # Batch mean over real query tokens: 4 queries at log 4, 2 queries at log 2.
    assert entropy[0].item() == pytest.approx((4 * math.log(4) + 2 * math.log(2)) / 6)
    assert entropy[1].item() == pytest.approx(0.0)


def test_the_text_encoder_exposes_one_attention_map_per_layer(shapes_batch) -> None:
    tok, batch = shapes_batch
    model = build_model(ModelConfig(text_layers=3), tok.vocab_size, tok.max_length, tok.pad_id)
    attentions = model.text_attentions(batch.input_ids, batch.attention_mask)
    assert len(attentions) == 3
    assert attentions[0].shape == (16, 2, tok.max_length, tok.max_length)
    # Padding keys get no attention.
    padded = batch.attention_mask == 0
    assert padded.any()
    assert (attentions[0] * padded[:, None, None, :]).abs().max() == 0


def test_the_model_can_fit_a_batch_of_shapes(shapes_batch) -> None:
    """A few AdamW steps on one batch: the loss must fall far below chance (a broken model cannot)."""
    torch.manual_seed(0)
    tok, batch = shapes_batch
    model = build_model(ModelConfig(), tok.vocab_size, tok.max_length, tok.pad_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = contrastive_loss(model(batch.images, batch.input_ids, batch.attention_mask))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(16), rel=0.2)
    assert losses[-1] < 0.5 * losses[0], losses[::5]


def test_the_fusion_gate_and_temperature_are_parameters_the_optimizer_trains(shapes_batch) -> None:
    tok, _ = shapes_batch
    model = build_model(ModelConfig(init_temperature=0.05), tok.vocab_size, tok.max_length)
    names = {name for name, _ in model.named_parameters()}
    assert {"fusion.gate.weight", "logit_scale"} <= names
    assert (1 / model.scale()).item() == pytest.approx(0.05)


def test_attention_entropy_read_from_the_training_forward_equals_a_separate_eval_pass(shapes_batch) -> None:
    tok, batch = shapes_batch
    torch.manual_seed(0)
    model = build_model(ModelConfig(text_layers=3), tok.vocab_size, tok.max_length, tok.pad_id)
    layers = [layer.attention.self for layer in model.text_encoder.encoder.layer]
    hooks_before = [len(layer._forward_hooks) for layer in layers]  # transformers may add its own
    with model.recording_attention_entropy(batch.attention_mask) as record:
        assert [len(layer._forward_hooks) for layer in layers] == [n + 1 for n in hooks_before]
        model(batch.images, batch.input_ids, batch.attention_mask).sum().backward()  # a training step's forward
    assert [len(layer._forward_hooks) for layer in layers] == hooks_before  # removed after the block
    separate = attention_entropy(model.text_attentions(batch.input_ids, batch.attention_mask), batch.attention_mask)
    assert record.value() is not None
    assert torch.allclose(record.value(), separate, atol=1e-6)


def test_with_attention_dropout_in_training_nothing_is_recorded_and_eval_mode_still_is(shapes_batch) -> None:
    tok, batch = shapes_batch
    model = build_model(ModelConfig(dropout=0.1), tok.vocab_size, tok.max_length, tok.pad_id)
    with model.recording_attention_entropy(batch.attention_mask) as record:
        model(batch.images, batch.input_ids, batch.attention_mask)
    assert record.value() is None  # dropped-out maps are not distributions: the caller measures separately
    model.eval()
    with model.recording_attention_entropy(batch.attention_mask) as record:
        model(batch.images, batch.input_ids, batch.attention_mask)
    assert record.value() is not None and record.value().shape == (2,)
