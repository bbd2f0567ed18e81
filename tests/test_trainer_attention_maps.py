"""rankscope_trainer.attention_maps: the validation samples' attention maps the run report shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rankscope_trainer import attention_maps
from rankscope_trainer.attention_maps import KEEP_FILES, attention_dir, save_attention_maps
from rankscope_trainer.config import ConfigError, ModelConfig, RunConfig
from rankscope_trainer.data import Collate, ShapesDataset, image_transform
from rankscope_trainer.model import build_model
from rankscope_trainer.tokenizer import WordTokenizer


@pytest.fixture(scope="module")
def shapes():
    data = ShapesDataset(8, 48, 0, "val", image_transform(48))
    tok = WordTokenizer.build(data.captions(), 12)
    return tok, Collate(tok, 48)([data[i] for i in range(8)])


def _model(tok: WordTokenizer, encoder: str = "vit") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(image_encoder=encoder, image_layers=1), tok.vocab_size, tok.max_length, tok.pad_id)


def test_maps_of_the_first_samples_are_saved_beside_the_run_log_with_their_tokens_and_images(tmp_path, shapes) -> None:
    tok, batch = shapes
    run = RunConfig(log_file=str(tmp_path / "log.jsonl"), attention_maps=3)
    path = save_attention_maps(run, 20, _model(tok), batch, tok.vocab)
    assert path == tmp_path / "attention" / "step_00000020.npz" == attention_dir(run.log_file) / path.name
    saved = np.load(path)
    assert int(saved["step"]) == 20
    length = int(batch.attention_mask[:3].sum(dim=1).max())
    assert saved["images"].shape == (3, 48, 48, 3) and saved["images"].dtype == np.uint8
    assert saved["tokens"].shape == (3, length)
    text = saved["text_attention"].astype(np.float32)
    assert text.shape == (3, length, length)
    # Each real query token's attention is a distribution over the real keys.
    for sample in range(3):
        real = int(batch.attention_mask[sample].sum())
        assert np.allclose(text[sample, :real].sum(axis=-1), 1.0, atol=1e-2)
        assert np.all(saved["tokens"][sample, real:] == "")
        assert saved["captions"][sample] and "[CLS]" not in saved["captions"][sample]
    grid = saved["image_attention"].astype(np.float32)
    assert grid.shape == (3, 3, 3)  # 48 px / 16 px patches; the class token's weights over them sum to < 1
    assert np.all(grid >= 0) and np.all(grid.sum(axis=(1, 2)) <= 1.0 + 1e-3)
    # The images are the inputs with the normalisation undone: not blank, not saturated.
    assert 20 < saved["images"].mean() < 250


def test_saving_maps_changes_neither_the_model_nor_the_random_stream(tmp_path, shapes) -> None:
    tok, batch = shapes
    model = _model(tok)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    save_attention_maps(RunConfig(log_file=str(tmp_path / "log.jsonl")), 1, model, batch, tok.vocab)
    assert torch.equal(torch.rand(3), expected)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_resnet_run_saves_text_maps_only(tmp_path, shapes) -> None:
    tok, batch = shapes
    path = save_attention_maps(
        RunConfig(log_file=str(tmp_path / "l.jsonl")), 5, _model(tok, "resnet"), batch, tok.vocab
    )
    assert "image_attention" not in np.load(path) and "text_attention" in np.load(path)


def test_the_first_and_the_newest_files_are_kept(tmp_path, shapes) -> None:
    tok, batch = shapes
    run = RunConfig(log_file=str(tmp_path / "log.jsonl"), attention_maps=1)
    model = _model(tok)
    steps = [10 * i for i in range(1, KEEP_FILES + 6)]
    for step in steps:
        save_attention_maps(run, step, model, batch, tok.vocab)
    kept = sorted(p.name for p in (tmp_path / "attention").iterdir())
    assert kept == [f"step_{s:08d}.npz" for s in [steps[0], *steps[-(KEEP_FILES - 1) :]]]


def test_nothing_is_saved_when_off_or_without_a_log_file(tmp_path, shapes) -> None:
    tok, batch = shapes
    model = _model(tok)
    assert save_attention_maps(RunConfig(log_file=""), 1, model, batch, tok.vocab) is None
    assert save_attention_maps(RunConfig(log_file=str(tmp_path / "log.jsonl"), attention_maps=0), 1, model, batch,
                               tok.vocab) is None  # fmt: skip
    assert not (tmp_path / "attention").exists()


def test_a_failure_is_logged_once_and_never_raised(tmp_path, shapes, caplog) -> None:
    tok, batch = shapes
    blocked = tmp_path / "attention"
    blocked.write_text("a file where the directory should be")
    run = RunConfig(log_file=str(tmp_path / "log.jsonl"))
    try:
        for step in (1, 2):
            assert save_attention_maps(run, step, _model(tok), batch, tok.vocab) is None
    finally:
        attention_maps._failed.discard(run.log_file)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "attention maps not saved" in caplog.records[0].message


def test_the_number_of_samples_is_bounded_by_the_config() -> None:
    with pytest.raises(ConfigError, match="run.attention_maps must be between 0 and 16, got 17"):
        RunConfig(attention_maps=17)
