"""Attention maps of the first few validation samples, saved at every validation for the run report.

Rank 0 saves, at each validation, the first `run.attention_maps` samples of its
validation shard (the same samples every time: the validation order is fixed)
into `attention/step_XXXXXXXX.npz` beside `run.log_file` (nothing is saved
without a log file). One compressed NumPy archive per validation:

| array            | shape, dtype             | what                                                     |
|------------------|--------------------------|----------------------------------------------------------|
| `step`, `time`   | (), int64 / float64      | the step validated, unix time of the save                |
| `images`         | (K, H, W, 3) uint8       | the model's input images, normalisation undone           |
| `captions`       | (K,) str                 | each caption's words joined by spaces                    |
| `tokens`         | (K, T) str               | tokens, "" where padding                                 |
| `text_attention` | (K, T, T) float16        | last text layer, averaged over heads (query x key)       |
| `image_attention`| (K, gh, gw) float16      | ViT only: last layer's class token over the patch grid   |

Bounded in number and size: at most :data:`MAX_SAMPLES` samples, images at most
:data:`MAX_IMAGE_SIDE` px, :data:`MAX_TOKENS` tokens, and the first validation's
file plus the newest ones, :data:`KEEP_FILES` in all (older ones are deleted).

The maps come from one extra forward of those few samples in eval mode without
gradients (dropout off, no random numbers drawn), so training is unchanged; a
failure is logged once and the run goes on.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.models import VisionTransformer

from rankscope_trainer.data import IMAGE_MEAN, IMAGE_STD, Batch
from rankscope_trainer.tokenizer import SPECIAL_TOKENS

__all__ = ["KEEP_FILES", "MAX_IMAGE_SIDE", "MAX_SAMPLES", "MAX_TOKENS", "attention_dir", "save_attention_maps"]

logger = logging.getLogger("rankscope_trainer")

MAX_SAMPLES = 16
MAX_IMAGE_SIDE = 224
MAX_TOKENS = 64
KEEP_FILES = 10
_FILE = re.compile(r"^step_(\d{8,})\.npz$")
_failed: set[str] = set()  # the log files whose maps failed once: warned about, then skipped


def attention_dir(log_file: str) -> Path | None:
    """Where maps of a run with this `run.log_file` go (None without a log file)."""
    return Path(log_file).parent / "attention" if log_file else None


def save_attention_maps(run: Any, step: int, model: torch.nn.Module, batch: Batch, vocab: list[str]) -> Path | None:
    """Save the attention maps of `batch`'s first `run.attention_maps` samples (rank 0 calls this).

    `run` is the trainer's RunConfig, `model` the DualEncoder (unwrapped), `vocab` the tokenizer's
    vocabulary. Returns the file written, or None (off, no log file, or a failure, logged once).
    """
    directory = attention_dir(run.log_file)
    count = min(run.attention_maps, MAX_SAMPLES, len(batch))
    if directory is None or count <= 0 or run.log_file in _failed:
        return None
    try:
        arrays = _maps(model, batch, count, vocab)
        arrays.update(step=np.int64(step), time=np.float64(time.time()))
        path = directory / f"step_{step:08d}.npz"
        _write_atomically(path, arrays)
        _prune(directory)
        return path
    except Exception as exc:  # never let a report artefact stop training
        _failed.add(run.log_file)
        logger.warning("attention maps not saved (and not tried again in this run): %s", " ".join(str(exc).split()))
        return None


@torch.no_grad()
def _maps(model: Any, batch: Batch, count: int, vocab: list[str]) -> dict[str, np.ndarray]:
    device = next(model.parameters()).device
    images = batch.images[:count].to(device)
    input_ids = batch.input_ids[:count, :MAX_TOKENS].to(device)
    mask = batch.attention_mask[:count, :MAX_TOKENS].to(device)
    was_training = model.training
    model.eval()  # no dropout, no random numbers drawn
    try:
        text = model.text_attentions(input_ids, mask)[-1].float().mean(dim=1)  # (K, T, T)
        image = _image_attention(model.image_encoder, images)
    finally:
        model.train(was_training)
    length = max(1, int(mask.sum(dim=1).max()))  # trailing padding of every sample dropped
    ids = input_ids[:, :length].cpu().tolist()
    real = mask[:, :length].cpu().bool().tolist()
    tokens = np.array([[vocab[i] if keep else "" for i, keep in zip(row, keep_row, strict=True)]
                       for row, keep_row in zip(ids, real, strict=True)])  # fmt: skip
    arrays = {
        "images": _to_uint8(images),
        "captions": np.array([" ".join(t for t in row if t and t not in SPECIAL_TOKENS) for row in tokens.tolist()]),
        "tokens": tokens,
        "text_attention": text[:, :length, :length].cpu().numpy().astype(np.float16),
    }
    if image is not None:
        arrays["image_attention"] = image.cpu().numpy().astype(np.float16)
    return arrays


def _image_attention(encoder: torch.nn.Module, images: torch.Tensor) -> torch.Tensor | None:
    """ViT: the last block's class-token attention over the patches, as a (K, gh, gw) grid.

    The block calls its attention with need_weights=False; a hook takes the block's normalised
    input and asks the same attention module for its weights (one more small call, no change to
    the forward's output)."""
    if not isinstance(encoder, VisionTransformer):
        return None
    block = encoder.encoder.layers[-1]
    captured: dict[str, torch.Tensor] = {}
    handle = block.ln_1.register_forward_hook(lambda module, args, output: captured.update(x=output))
    try:
        encoder(images)
    finally:
        handle.remove()
    x = captured["x"]
    _, weights = block.self_attention(x, x, x, need_weights=True, average_attn_weights=True)  # (K, 1+P, 1+P)
    side = encoder.image_size // encoder.patch_size
    return weights[:, 0, 1:].float().reshape(-1, side, side)


def _to_uint8(images: torch.Tensor) -> np.ndarray:
    """(K, 3, H, W) normalised floats -> (K, H', W', 3) uint8, at most MAX_IMAGE_SIDE px a side."""
    images = images.float()
    if max(images.shape[-2:]) > MAX_IMAGE_SIDE:
        scale = MAX_IMAGE_SIDE / max(images.shape[-2:])
        images = F.interpolate(images, scale_factor=scale, mode="bilinear", antialias=True)
    channels = images.shape[1]
    mean = torch.tensor(IMAGE_MEAN[:channels], device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(IMAGE_STD[:channels], device=images.device).view(1, -1, 1, 1)
    pixels = ((images * std + mean).clamp(0, 1) * 255).round().to(torch.uint8)
    if channels == 1:
        pixels = pixels.expand(-1, 3, -1, -1)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def _write_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    # A report reading a live run never sees half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # rank 0 alone writes here; the umask applies
    try:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _prune(directory: Path) -> None:
    """Keep the first validation's file and the newest ones, KEEP_FILES in all."""
    files = sorted(p for p in directory.iterdir() if _FILE.match(p.name))
    for path in files[1 : max(1, len(files) - (KEEP_FILES - 1))]:
        path.unlink(missing_ok=True)
