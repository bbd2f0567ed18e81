"""Attention maps the reference trainer saved at validation time (trainer/rankscope_trainer/attention_maps.py).

One `step_XXXXXXXX.npz` per validation in an `attention/` directory beside the
run log: `step`, `time`, `images` (K, H, W, 3) uint8, `captions` (K,), `tokens`
(K, T), `text_attention` (K, T, T) and, for a ViT, `image_attention` (K, gh, gw).
Files that do not read as that are skipped and named, so one bad file does not
cost the report.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["AttentionSnapshot", "read_attention_maps"]

_FILE = re.compile(r"^step_(\d+)\.npz$")


@dataclass
class AttentionSnapshot:
    """The maps of one validation."""

    step: int
    time: float
    images: np.ndarray
    captions: list[str]
    tokens: np.ndarray
    text_attention: np.ndarray
    image_attention: np.ndarray | None

    @property
    def samples(self) -> int:
        return int(self.text_attention.shape[0])


def _read(path: Path) -> AttentionSnapshot:
    with np.load(path, allow_pickle=False) as data:
        text = data["text_attention"].astype(np.float32)
        images = data["images"]
        tokens = data["tokens"]
        count = text.shape[0]
        if text.ndim != 3 or text.shape[1] != text.shape[2] or images.shape[0] != count or images.ndim != 4:
            raise ValueError(f"shapes do not match: text_attention {text.shape}, images {images.shape}")
        if tokens.shape != text.shape[:2]:
            raise ValueError(f"tokens {tokens.shape} do not match text_attention {text.shape}")
        image = data["image_attention"].astype(np.float32) if "image_attention" in data else None
        if image is not None and (image.ndim != 3 or image.shape[0] != count):
            raise ValueError(f"image_attention {image.shape} does not match {count} samples")
        return AttentionSnapshot(
            step=int(data["step"]),
            time=float(data["time"]),
            images=images,
            captions=[str(c) for c in data["captions"]],
            tokens=tokens,
            text_attention=text,
            image_attention=image,
        )


def read_attention_maps(directory: str | Path) -> tuple[list[AttentionSnapshot], list[str]]:
    """Every readable snapshot in `directory`, oldest step first, and a line per file skipped.

    A missing directory gives no snapshots and no complaint (the run saved none).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return [], []
    snapshots, skipped = [], []
    for path in sorted(p for p in directory.iterdir() if _FILE.match(p.name)):
        try:
            snapshots.append(_read(path))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            skipped.append(f"{path.name}: {' '.join(str(exc).split())[:160]}")
    return sorted(snapshots, key=lambda s: s.step), skipped
