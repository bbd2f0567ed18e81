"""A CLIP-style dual encoder, built from library constructors (no pretrained weights, no download).

    image --torchvision ViT/ResNet--> features --image_proj--> embedding --+
                                                                             +-- cosine logits / temperature
    caption --transformers BERT--> [CLS] and mean tokens --fusion--> text_proj --+

The fusion gate decides, per dimension, how much of the caption embedding
comes from the [CLS] token and how much from the mean of all tokens; its
weights are what `rankscope_fusion_gate_weight` watches. The temperature is
learned (as a log scale, clamped like CLIP's at 100). The loss is the
symmetric cross-entropy over in-batch negatives (each rank's own batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import VisionTransformer
from torchvision.models.resnet import BasicBlock, ResNet
from transformers import BertConfig, BertModel

__all__ = [
    "AttentionEntropyRecord",
    "DualEncoder",
    "GatedFusion",
    "attention_entropy",
    "build_model",
    "contrastive_accuracy",
    "contrastive_loss",
]

MAX_LOGIT_SCALE = math.log(100.0)


class GatedFusion(nn.Module):
    """out = g * a + (1 - g) * b with g = sigmoid(W [a; b] + c), per dimension."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * dim, dim)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate(torch.cat([a, b], dim=-1)))
        return gate * a + (1 - gate) * b


def _image_encoder(cfg) -> tuple[nn.Module, int]:
    if cfg.image_encoder == "vit":
        vit = VisionTransformer(
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
            num_layers=cfg.image_layers,
            num_heads=cfg.image_heads,
            hidden_dim=cfg.image_hidden,
            mlp_dim=2 * cfg.image_hidden,
            dropout=cfg.dropout,
        )
        vit.heads = nn.Identity()  # the class token's features; our projection head follows
        return vit, cfg.image_hidden
    resnet = ResNet(BasicBlock, [cfg.image_layers] * 4)
    resnet.fc = nn.Identity()
    return resnet, 512 * BasicBlock.expansion


class AttentionEntropyRecord:
    """What `DualEncoder.recording_attention_entropy` collected: one entropy per text layer, as forwards ran."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.by_layer: dict[int, torch.Tensor] = {}

    def value(self) -> torch.Tensor | None:
        """Entropy per layer (a device tensor), or None unless every layer's forward reported one."""
        if len(self.by_layer) != self.layers:
            return None
        return torch.stack([self.by_layer[layer] for layer in range(self.layers)])


class DualEncoder(nn.Module):
    """Image and text towers meeting in one embedding space."""

    def __init__(self, cfg, vocab_size: int, max_length: int, pad_id: int = 0) -> None:
        super().__init__()
        self.image_encoder, image_features = _image_encoder(cfg)
        self.text_encoder = BertModel(
            BertConfig(  # type: ignore[call-arg]  # attn_implementation: a PretrainedConfig kwarg the stub omits
                vocab_size=vocab_size,
                hidden_size=cfg.text_hidden,
                num_hidden_layers=cfg.text_layers,
                num_attention_heads=cfg.text_heads,
                intermediate_size=2 * cfg.text_hidden,
                max_position_embeddings=max_length,
                hidden_dropout_prob=cfg.dropout,
                attention_probs_dropout_prob=cfg.dropout,
                pad_token_id=pad_id,
                # Eager attention returns the attention maps the entropy statistic reads.
                attn_implementation="eager",
            ),
            add_pooling_layer=False,
        )
        self.fusion = GatedFusion(cfg.text_hidden)
        self.image_proj = nn.Linear(image_features, cfg.embed_dim)
        self.text_proj = nn.Linear(cfg.text_hidden, cfg.embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / cfg.init_temperature)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image_proj(self.image_encoder(images)), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return F.normalize(self.text_proj(self.fusion(hidden[:, 0], mean)), dim=-1)

    def scale(self) -> torch.Tensor:
        """exp(logit_scale), clamped: the inverse temperature."""
        return self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()

    def forward(
        self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, features: bool = False
    ) -> Any:
        """Image-to-text logits (N x N); row i's correct column is i. With `features`: (image embeddings, text
        embeddings, inverse temperature), for a loss over more samples than this forward's (accumulation)."""
        image = self.encode_image(images)
        text = self.encode_text(input_ids, attention_mask)
        if features:
            return image, text, self.scale()
        return self.scale() * image @ text.t()

    @contextmanager
    def recording_attention_entropy(self, attention_mask: torch.Tensor) -> Iterator[AttentionEntropyRecord]:
        """Read each text layer's attention entropy from the forward run inside the block (forward hooks).

        The statistic then costs a few reductions instead of an extra text-encoder pass. When this
        forward's maps are not distributions (attention dropout while training) nothing is recorded
        and `value()` is None: measure with `text_attentions` (an eval-mode pass) instead.
        """
        layers: Any = self.text_encoder.encoder.layer  # BertLayer modules (typed as plain Modules)
        record = AttentionEntropyRecord(len(layers))
        if self.training and self.text_encoder.config.attention_probs_dropout_prob > 0:
            yield record
            return
        with torch.no_grad():
            weights, count = _query_weights(attention_mask)  # once for all layers

        def hook_for(index: int):
            def hook(module: nn.Module, args: tuple, output: object) -> None:
                # Eager self-attention returns (context, attention probabilities); keyed by layer, so a
                # recomputed forward (activation checkpointing) overwrites instead of adding.
                if isinstance(output, tuple) and len(output) > 1 and isinstance(output[1], torch.Tensor):
                    with torch.no_grad():
                        record.by_layer[index] = _layer_entropy(output[1].detach(), weights, count)

            return hook

        handles = [layer.attention.self.register_forward_hook(hook_for(i)) for i, layer in enumerate(layers)]
        try:
            yield record
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def text_attentions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Attention maps of every text layer, each (N, heads, T, T)."""
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        return tuple(out.attentions)


def contrastive_loss(logits: torch.Tensor) -> torch.Tensor:
    """Symmetric cross-entropy: image->text over rows, text->image over columns."""
    target = torch.arange(logits.shape[0], device=logits.device)
    logits = logits.float()
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


@torch.no_grad()
def contrastive_accuracy(logits: torch.Tensor) -> torch.Tensor:
    """[image->text, text->image] fraction of rows whose best match is the right one (stays on device)."""
    target = torch.arange(logits.shape[0], device=logits.device)
    best = torch.stack([logits.argmax(dim=1), logits.argmax(dim=0)])  # best text per image, best image per text
    return (best == target).float().mean(dim=1)


@torch.no_grad()
def attention_entropy(attentions: tuple[torch.Tensor, ...], attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of each layer's attention distributions over real (non-padding) query tokens."""
    weights, count = _query_weights(attention_mask)
    return torch.stack([_layer_entropy(probs, weights, count) for probs in attentions])


def _query_weights(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) float mask of real query tokens and their number (at least 1)."""
    weights = attention_mask.to(torch.float32)
    return weights, weights.sum().clamp(min=1.0)


def _layer_entropy(probs: torch.Tensor, weights: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    # entr(p) = -p log p, and 0 where p = 0 (masked keys): no clamp, no log of zero.
    per_query = torch.special.entr(probs.float()).sum(dim=-1).mean(dim=1)  # (N, T), averaged over heads
    return (per_query * weights).sum() / count


def build_model(cfg, vocab_size: int, max_length: int, pad_id: int = 0) -> DualEncoder:
    """The dual encoder of `cfg` (a rankscope_trainer.config.ModelConfig)."""
    return DualEncoder(cfg, vocab_size, max_length, pad_id)
