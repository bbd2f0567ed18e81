"""rankscope.report.attention: reading the attention maps the reference trainer saves.

(The trainer side is rankscope_trainer.attention_maps.)
"""

from __future__ import annotations

import numpy as np
import torch
from rankscope.report.attention import read_attention_maps
from rankscope_trainer.attention_maps import save_attention_maps
from rankscope_trainer.config import ModelConfig, RunConfig
from rankscope_trainer.data import Collate, ShapesDataset, image_transform
from rankscope_trainer.model import build_model
from rankscope_trainer.tokenizer import WordTokenizer


def test_the_maps_the_trainer_saves_read_back_oldest_first_and_a_broken_file_is_named(tmp_path) -> None:
    data = ShapesDataset(4, 48, 0, "val", image_transform(48))
    tok = WordTokenizer.build(data.captions(), 12)
    batch = Collate(tok, 48)([data[i] for i in range(4)])
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_layers=1), tok.vocab_size, tok.max_length, tok.pad_id)
    run = RunConfig(log_file=str(tmp_path / "log.jsonl"), attention_maps=3)
    for step in (40, 20):
        save_attention_maps(run, step, model, batch, tok.vocab)
    (tmp_path / "attention" / "step_00000060.npz").write_bytes(b"not an archive")

    snapshots, skipped = read_attention_maps(tmp_path / "attention")
    assert [s.step for s in snapshots] == [20, 40]
    first = snapshots[0]
    assert first.samples == 3 and first.images.shape == (3, 48, 48, 3)
    assert first.image_attention is not None and first.image_attention.shape == (3, 3, 3)
    assert first.tokens.shape == first.text_attention.shape[:2]
    assert first.captions[0] == " ".join(t for t in first.tokens[0] if t and not t.startswith("["))
    assert np.isfinite(first.text_attention).all()
    assert len(skipped) == 1 and skipped[0].startswith("step_00000060.npz: ")


def test_no_directory_means_no_maps_and_no_complaint(tmp_path) -> None:
    assert read_attention_maps(tmp_path / "missing") == ([], [])
