"""rankscope_trainer.data: the synthetic shapes set, manifests checked up front, and resumable sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from rankscope import Monitor
from rankscope_trainer.config import DataConfig, SyntheticConfig
from rankscope_trainer.data import (
    COLOURS,
    BadSample,
    Collate,
    DataError,
    ManifestDataset,
    ResumableDistributedSampler,
    ShapesDataset,
    build_data,
    image_transform,
    read_manifest,
    settle_bad_samples,
)
from rankscope_trainer.tokenizer import WordTokenizer
from torch.utils.data import DataLoader

from tests.support import trainer_monitor

# --- synthetic shapes ---------------------------------------------------------------------------


def _shapes(split: str = "train", seed: int = 0, length: int = 64) -> ShapesDataset:
    return ShapesDataset(length, 48, seed, split, image_transform(48))


def test_a_synthetic_sample_is_the_same_in_every_process_and_run() -> None:
    first, second = _shapes()[7], _shapes()[7]
    assert first.text == second.text
    assert torch.equal(first.image, second.image)
    assert first.image.shape == (3, 48, 48)


def test_the_caption_describes_the_rendered_shape() -> None:
    data = _shapes()
    for index in range(20):
        spec = data.spec(index)
        image = data.render(spec)
        # The centre of the named grid cell has the named colour (shapes are drawn around it).
        cell = 48 / 3
        centre = (int((spec.col + 0.5) * cell), int((spec.row + 0.5) * cell))
        assert image.getpixel(centre) == COLOURS[spec.colour], spec
        assert spec.caption.startswith(f"a {spec.size} {spec.colour} {spec.shape} at the ")


def test_train_and_validation_splits_differ_and_seeds_change_the_data() -> None:
    train = [_shapes("train").spec(i).caption for i in range(32)]
    assert train != [_shapes("val").spec(i).caption for i in range(32)]
    assert train != [_shapes("train", seed=1).spec(i).caption for i in range(32)]


def test_captions_cover_every_attribute_of_the_grammar() -> None:
    words = {w for caption in _shapes(length=2000).captions() for w in caption.split()}
    assert {"small", "large", "circle", "square", "triangle", "top", "bottom", "left", "right", "centre"} <= words
    assert set(COLOURS) <= words


# --- manifests ------------------------------------------------------------------------------------


def _image(path: Path, size: tuple[int, int] = (20, 10)) -> Path:
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_a_good_jsonl_manifest_loads_with_paths_relative_to_it(tmp_path: Path) -> None:
    _image(tmp_path / "a.png")
    _image(tmp_path / "b.png", (30, 40))
    manifest = _jsonl(tmp_path / "m.jsonl", [{"image": "a.png", "text": "a red box"}, {"image": "b.png", "text": "x"}])
    result = read_manifest(manifest)
    assert [e.image for e in result.entries] == [tmp_path / "a.png", tmp_path / "b.png"]
    sample = ManifestDataset(result.entries, image_transform(16))[1]
    assert sample.size == (30, 40) and sample.image.shape == (3, 16, 16) and sample.text == "x"


def test_a_csv_manifest_loads_and_a_bad_header_is_named(tmp_path: Path) -> None:
    _image(tmp_path / "a.png")
    good = tmp_path / "m.csv"
    good.write_text('image,text\na.png,"a red box, small"\n')
    assert read_manifest(good).entries[0].text == "a red box, small"
    bad = tmp_path / "bad.csv"
    bad.write_text("path,caption\na.png,x\n")
    with pytest.raises(DataError, match=r"bad.csv: CSV header must have columns image and text, got \['path'"):
        read_manifest(bad)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "m.jsonl:2: not valid JSON"),
        ('["a.png", "text"]', "m.jsonl:2: expected an object with image and text, got list"),
        ('{"image": "a.png"}', "m.jsonl:2: 'text' must be a non-empty string, got None"),
        ('{"image": "a.png", "text": ""}', "m.jsonl:2: 'text' must be a non-empty string"),
        ('{"image": "gone.png", "text": "x"}', "m.jsonl:2: image file not found: "),
        ('{"image": "broken.png", "text": "x"}', "m.jsonl:2: cannot read image "),
    ],
)
def test_a_bad_line_stops_with_a_message_naming_the_line(tmp_path: Path, line: str, expected: str) -> None:
    _image(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png")
    manifest = _jsonl(tmp_path / "m.jsonl", [{"image": "a.png", "text": "ok"}, line])
    with pytest.raises(DataError) as caught:
        read_manifest(manifest)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_truncated_image_is_found_when_the_manifest_is_checked(tmp_path: Path) -> None:
    _image(tmp_path / "full.png", (64, 64))
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    manifest = _jsonl(tmp_path / "m.jsonl", [{"image": "cut.png", "text": "x"}])
    with pytest.raises(DataError, match="m.jsonl:1: cannot read image"):
        read_manifest(manifest)


def test_skip_mode_leaves_bad_samples_out_and_counts_them_by_reason(tmp_path: Path) -> None:
    _image(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"garbage")
    rows = [
        {"image": "a.png", "text": "ok"},
        "{oops",
        {"image": "gone.png", "text": "x"},
        {"image": "broken.png", "text": "x"},
        {"image": "a.png", "text": "again"},
    ]
    result = read_manifest(_jsonl(tmp_path / "m.jsonl", rows), on_bad_sample="skip")
    assert [e.text for e in result.entries] == ["ok", "again"]
    assert dict(result.skipped) == {"bad_line": 1, "missing_file": 1, "unreadable_image": 1}


def test_a_manifest_without_usable_samples_is_an_error(tmp_path: Path) -> None:
    manifest = _jsonl(tmp_path / "m.jsonl", [{"image": "gone.png", "text": "x"}])
    with pytest.raises(DataError, match="no usable samples"):
        read_manifest(manifest, on_bad_sample="skip")
    with pytest.raises(DataError, match="manifest not found"):
        read_manifest(tmp_path / "nope.jsonl")


def test_an_image_that_breaks_after_the_check_reaches_the_loop_as_a_bad_sample_not_a_worker_crash(
    tmp_path: Path,
) -> None:
    for name in ("a.png", "b.png"):
        _image(tmp_path / name)
    manifest = _jsonl(tmp_path / "m.jsonl", [{"image": "a.png", "text": "one"}, {"image": "b.png", "text": "two"}])
    entries = read_manifest(manifest).entries
    (tmp_path / "b.png").write_bytes(b"now broken")
    tok = WordTokenizer.build(["one two"], 8)
    loader = DataLoader(ManifestDataset(entries, image_transform(16)), batch_size=2, num_workers=1,
                        collate_fn=Collate(tok, 16))  # fmt: skip
    batch = next(iter(loader))
    assert len(batch) == 1
    assert [b.reason for b in batch.bad] == ["unreadable_image"]
    assert "m.jsonl:2: cannot read image" in batch.bad[0].message


def _monitor() -> Monitor:
    return trainer_monitor()


def test_bad_samples_in_the_loop_raise_in_error_mode_and_are_counted_in_skip_mode() -> None:
    bad = [BadSample("unreadable_image", "m.jsonl:3: cannot read image x"), BadSample("missing_file", "m:4: gone")]
    monitor = _monitor()
    with pytest.raises(DataError, match="m.jsonl:3: cannot read image x"):
        settle_bad_samples(bad, "error", monitor)
    settle_bad_samples(bad, "skip", monitor)
    settle_bad_samples(bad[:1], "skip", monitor)
    value = monitor.registry.get_sample_value
    labels = {"run_id": "test", "rank": "0", "local_rank": "0", "node": "host"}
    assert value("rankscope_data_skipped_samples_total", {**labels, "reason": "unreadable_image"}) == 2
    assert value("rankscope_data_skipped_samples_total", {**labels, "reason": "missing_file"}) == 1


# --- batching and sampling ---------------------------------------------------------------------------


def test_a_collated_batch_keeps_lengths_and_sizes_on_the_host() -> None:
    data = _shapes()
    tok = WordTokenizer.build(data.captions(), 12)
    batch = Collate(tok, 48)([data[0], data[1], BadSample("missing_file", "x:1: gone")])
    assert len(batch) == 2 and batch.images.shape == (2, 3, 48, 48)
    assert batch.sizes.tolist() == [[48, 48], [48, 48]]
    assert batch.tokens == int(batch.attention_mask.sum())
    assert len(batch.bad) == 1


def test_a_resumed_sampler_yields_exactly_the_rest_of_the_epoch() -> None:
    data = _shapes(length=100)
    full = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    full.set_position(epoch=4, start_sample=0, step_samples=8)
    resumed = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    resumed.set_position(epoch=4, start_sample=24, step_samples=8)
    assert list(resumed) == list(full)[24:]
    assert len(resumed) == len(full) - 24
    resumed.set_position(epoch=5, start_sample=0, step_samples=8)
    assert len(list(resumed)) == len(full)


def test_an_epoch_ends_after_its_last_whole_step_whatever_the_micro_batch() -> None:
    sampler = ResumableDistributedSampler(_shapes(length=100), num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler.set_position(epoch=0, start_sample=0, step_samples=8)  # 50 per rank: 6 steps of 8, 2 left over
    whole = list(sampler)
    assert len(whole) == 48
    sampler.set_position(epoch=0, start_sample=16, step_samples=8)  # micro-batch 4 x 2, from the third step
    assert list(sampler) == whole[16:]


def test_build_data_shards_the_synthetic_set_and_builds_its_vocabulary() -> None:
    cfg = DataConfig(batch_size=4, num_workers=0, synthetic=SyntheticConfig(train_size=40, val_size=8, image_size=24))
    bundle = build_data(cfg, image_size=24, seed=0, rank=0, world_size=2)
    assert bundle.steps_per_epoch(4) == 5  # 20 samples per rank, steps of 4
    assert "circle" in bundle.tokenizer.vocab
    batch = next(iter(bundle.train_loader))
    assert batch.images.shape == (4, 3, 24, 24)


def test_build_data_refuses_a_training_set_smaller_than_one_batch_per_rank() -> None:
    cfg = DataConfig(batch_size=16, num_workers=0, synthetic=SyntheticConfig(train_size=20))
    with pytest.raises(DataError, match="training set too small: 20 samples give 10 per rank"):
        build_data(cfg, image_size=48, seed=0, rank=0, world_size=2)
