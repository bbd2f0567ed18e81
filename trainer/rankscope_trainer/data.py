"""Image-caption data: a built-in learnable shapes set, or your own manifest.

Synthetic (`data.source: synthetic`): images of one shape each, rendered on
the fly and deterministically from (seed, split, index), with a caption
that describes it: "a small red circle at the top left". Colour, size, shape
and position all matter, so contrastive accuracy rises as the model learns
them, in a few hundred CPU steps.

Manifest (`data.source: manifest`): JSONL lines `{"image": path, "text":
caption}` or a CSV with columns `image,text`; relative paths resolve against
`data.image_root` (default: the manifest's directory). The whole manifest is
checked when the data set is built (every line parsed, every file found and,
with `data.verify_images`, decoded), so a problem is reported as
`manifest.jsonl:7: image file not found: cat.png` before training starts.
With `data.on_bad_sample: skip` such samples are left out instead and counted
in `rankscope_data_skipped_samples_total{reason}` (reasons: bad_line,
missing_file, unreadable_image). An image that breaks after the check is
handled the same way, by the training process, never as a crash inside a
DataLoader worker: workers return a `BadSample` and the loop decides.
"""

from __future__ import annotations

import csv
import json
import logging
import multiprocessing
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw
from rankscope.control import WorkerInit
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import transforms

from rankscope_trainer.tokenizer import WordTokenizer
from rankscope_trainer.val_cache import CachedBatches

__all__ = [
    "Batch",
    "BadSample",
    "Collate",
    "DataBundle",
    "DataError",
    "ManifestDataset",
    "ManifestEntry",
    "ResumableDistributedSampler",
    "Sample",
    "ShapesDataset",
    "build_data",
    "image_transform",
    "read_manifest",
    "settle_bad_samples",
    "worker_context",
]

logger = logging.getLogger("rankscope_trainer")


def worker_context() -> multiprocessing.context.BaseContext:
    """How the training loader starts its workers: from a fork server, never by forking the rank.

    A rank runs threads (the metrics server, the control endpoint, the goodput ledger, gloo's). A worker
    forked from it inherits every lock one of them holds at that instant, held for ever: a module another
    thread is importing, a stream it is writing. That worker never returns a batch, and the job hangs
    before its first step (seen in a 2-rank run; tests/test_trainer_data_workers.py reproduces it).
    The fork server is a fresh interpreter that imports this module (torch with it) once, or, in the reference
    trainer, a fork of the rank taken before its first thread (`rankscope_trainer.fork_server`: no import at
    all); each worker is then forked from it in milliseconds (`spawn` would import torch again in every
    worker). The server is started (unless it runs already) and waited for here, as the data are built:
    those seconds are the run's start-up, not its first batch's wait for data. The loader's `WorkerInit` ends
    the workers with their rank. The data are the same: the sampler runs in the rank and each worker's seed
    comes from the loader's generator, whatever starts the worker.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    ready = context.Process(target=_nothing, name="rankscope-forkserver-ready")
    ready.start()  # returns once the server, its preload imported, has forked it
    ready.join()
    return context


def _nothing() -> None:
    """The process that shows the fork server ready."""


# ImageNet statistics: the usual choice for encoders trained from scratch on natural-ish images.
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)


class DataError(ValueError):
    """A manifest or sample problem, in one line that names the file and line."""


@dataclass(frozen=True)
class Sample:
    image: torch.Tensor
    """Normalised CHW float tensor."""
    text: str
    size: tuple[int, int]
    """(width, height) of the source image before resizing."""


@dataclass(frozen=True)
class BadSample:
    """Returned (not raised) by a data set for a sample it cannot load."""

    reason: str
    """bad_line, missing_file or unreadable_image (the metric's `reason` label)."""
    message: str
    """One line naming the manifest line and the problem."""


def image_transform(size: int) -> transforms.Compose:
    """Resize to size x size, to tensor, normalise (the same for both data sources)."""
    return transforms.Compose(
        [transforms.Resize((size, size)), transforms.ToTensor(), transforms.Normalize(IMAGE_MEAN, IMAGE_STD)]
    )


# --- synthetic shapes ------------------------------------------------------------------

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (235, 215, 40),
    "purple": (160, 60, 200),
    "white": (240, 240, 240),
}
SHAPES = ("circle", "square", "triangle")
SIZES = ("small", "large")
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "centre", "right")


def _position_name(row: int, col: int) -> str:
    if row == 1 and col == 1:
        return "centre"
    if row == 1:
        return COLUMNS[col]
    if col == 1:
        return ROWS[row]
    return f"{ROWS[row]} {COLUMNS[col]}"


@dataclass(frozen=True)
class ShapeSpec:
    shape: str
    colour: str
    size: str
    row: int
    col: int
    jitter: tuple[float, float]
    background: int

    @property
    def caption(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} at the {_position_name(self.row, self.col)}"


class ShapesDataset(Dataset):
    """Rendered shapes with describing captions; sample i is the same in every process and run."""

    def __init__(self, length: int, image_size: int, seed: int, split: str, transform: Any) -> None:
        self.length = length
        self.image_size = image_size
        self.seed = seed
        self.split = split
        self.transform = transform

    def __len__(self) -> int:
        return self.length

    def spec(self, index: int) -> ShapeSpec:
        # A string seed is hashed with SHA-512 by `random`: stable across processes (unlike hash()).
        rng = random.Random(f"shapes:{self.seed}:{self.split}:{index}")
        return ShapeSpec(
            shape=rng.choice(SHAPES),
            colour=rng.choice(list(COLOURS)),
            size=rng.choice(SIZES),
            row=rng.randrange(3),
            col=rng.randrange(3),
            jitter=(rng.uniform(-1, 1), rng.uniform(-1, 1)),
            background=rng.randrange(0, 50),
        )

    def captions(self) -> Iterator[str]:
        """Every caption, without rendering (to build the vocabulary)."""
        return (self.spec(i).caption for i in range(self.length))

    def render(self, spec: ShapeSpec) -> Image.Image:
        side = self.image_size
        cell = side / 3
        image = Image.new("RGB", (side, side), (spec.background,) * 3)
        draw = ImageDraw.Draw(image)
        radius = cell * (0.2 if spec.size == "small" else 0.4)
        cx = (spec.col + 0.5) * cell + spec.jitter[0] * cell * 0.08
        cy = (spec.row + 0.5) * cell + spec.jitter[1] * cell * 0.08
        colour = COLOURS[spec.colour]
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        if spec.shape == "circle":
            draw.ellipse(box, fill=colour)
        elif spec.shape == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(cx, cy - radius), (cx + radius, cy + radius), (cx - radius, cy + radius)], fill=colour)
        return image

    def __getitem__(self, index: int) -> Sample:
        spec = self.spec(index)
        return Sample(self.transform(self.render(spec)), spec.caption, (self.image_size, self.image_size))


# --- manifests -------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestEntry:
    image: Path
    text: str
    where: str
    """`manifest.jsonl:7`, for messages."""


@dataclass
class ManifestResult:
    entries: list[ManifestEntry]
    skipped: Counter = field(default_factory=Counter)
    """reason -> samples left out (on_bad_sample: skip)."""


def _manifest_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row or a BadSample) for JSONL or CSV manifests."""
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            if "image" not in columns or "text" not in columns:
                raise DataError(f"{path}: CSV header must have columns image and text, got {columns}")
            for row in reader:
                yield reader.line_num, row
        return
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, BadSample("bad_line", f"{path}:{number}: not valid JSON ({exc.msg})")


def _check_row(row: Any, where: str) -> BadSample | None:
    if not isinstance(row, dict):
        return BadSample("bad_line", f"{where}: expected an object with image and text, got {type(row).__name__}")
    for key in ("image", "text"):
        value = row.get(key)
        if not isinstance(value, str) or not value.strip():
            return BadSample("bad_line", f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return None


def _load_image(path: Path, where: str) -> Image.Image | BadSample:
    try:
        with Image.open(path) as image:
            image.load()  # decodes the whole file: a truncated image fails here, not later
            return image.convert("RGB")
    except FileNotFoundError:
        return BadSample("missing_file", f"{where}: image file not found: {path}")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        return BadSample("unreadable_image", f"{where}: cannot read image {path}: {exc}")


def read_manifest(path: str | Path, image_root: str = "", on_bad_sample: str = "error", verify_images: bool = True):
    """Parse and check a manifest. Raises DataError on the first problem, or (skip) leaves it out and counts it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"manifest not found: {path}")
    root = Path(image_root) if image_root else path.parent
    result = ManifestResult(entries=[])
    try:
        for number, row in _manifest_rows(path):
            where = f"{path}:{number}"
            problem = row if isinstance(row, BadSample) else _check_row(row, where)
            entry = None
            if problem is None:
                image = Path(row["image"])
                entry = ManifestEntry(image if image.is_absolute() else root / image, row["text"], where)
                if not entry.image.is_file():
                    problem = BadSample("missing_file", f"{where}: image file not found: {entry.image}")
                elif verify_images:
                    loaded = _load_image(entry.image, where)
                    problem = loaded if isinstance(loaded, BadSample) else None
            if problem is None:
                result.entries.append(entry)  # type: ignore[arg-type]
            elif on_bad_sample == "skip":
                result.skipped[problem.reason] += 1
            else:
                raise DataError(problem.message)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not a text file ({exc.reason})") from None
    if not result.entries:
        raise DataError(f"{path}: no usable samples")
    return result


class ManifestDataset(Dataset):
    """Samples of a checked manifest; a file that breaks later becomes a BadSample, not an exception."""

    def __init__(self, entries: list[ManifestEntry], transform: Any) -> None:
        self.entries = entries
        self.transform = transform

    def __len__(self) -> int:
        return len(self.entries)

    def captions(self) -> Iterator[str]:
        return (entry.text for entry in self.entries)

    def __getitem__(self, index: int) -> Sample | BadSample:
        entry = self.entries[index]
        image = _load_image(entry.image, entry.where)
        if isinstance(image, BadSample):
            return image
        return Sample(self.transform(image), entry.text, image.size)


def settle_bad_samples(bad: list[BadSample], on_bad_sample: str, monitor: Any) -> None:
    """In the training process: raise the first problem (`error`), or count and log them (`skip`)."""
    if not bad:
        return
    if on_bad_sample == "error":
        raise DataError(bad[0].message)
    for sample in bad:
        monitor.inc("data_skipped_samples_total", 1, reason=sample.reason)
    logger.warning("skipped %d unreadable sample(s), e.g. %s", len(bad), bad[0].message)


# --- batching --------------------------------------------------------------------------


@dataclass
class Batch:
    """A collated batch. `lengths` and `sizes` stay on the host: counters read them without a device sync."""

    images: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    """Tokens per caption (with [CLS]/[SEP], without padding)."""
    sizes: torch.Tensor
    """(N, 2) source image width and height."""
    bad: list[BadSample] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device) -> Batch:
        non_blocking = device.type == "cuda"
        return Batch(
            self.images.to(device, non_blocking=non_blocking),
            self.input_ids.to(device, non_blocking=non_blocking),
            self.attention_mask.to(device, non_blocking=non_blocking),
            self.lengths,
            self.sizes,
            self.bad,
        )


class Collate:
    """Stacks good samples, tokenises captions, passes bad samples along (picklable for workers)."""

    def __init__(self, tokenizer: WordTokenizer, image_size: int) -> None:
        self.tokenizer = tokenizer
        self.image_size = image_size

    def __call__(self, items: list[Sample | BadSample]) -> Batch:
        good = [item for item in items if isinstance(item, Sample)]
        bad = [item for item in items if isinstance(item, BadSample)]
        ids, mask, lengths = self.tokenizer.batch([s.text for s in good])
        images = torch.stack([s.image for s in good]) if good else torch.empty(0, 3, self.image_size, self.image_size)
        sizes = torch.tensor([s.size for s in good], dtype=torch.long).reshape(-1, 2)
        return Batch(images, ids, mask, lengths, sizes, bad)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, for exact resume.

    The order of epoch e is a function of (seed, e) only, so skipping the
    first `start_sample` indices of this rank's share gives the same samples
    an uninterrupted run would have seen next. An epoch ends after its last
    whole step (`step_samples` = micro-batch x accumulation per rank), so a
    step never straddles two epochs, whatever its micro-batch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0
        self.usable = self.num_samples

    def set_position(self, epoch: int, start_sample: int, step_samples: int) -> None:
        self.set_epoch(epoch)
        self.skip = start_sample
        self.usable = steps_per_epoch(self.num_samples, step_samples) * step_samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip : self.usable])

    def __len__(self) -> int:
        return max(0, self.usable - self.skip)


def steps_per_epoch(samples_per_rank: int, step_samples: int) -> int:
    """Whole optimizer steps in one epoch of a rank's share (the rest of the epoch is dropped)."""
    return samples_per_rank // step_samples


@dataclass
class DataBundle:
    train_loader: DataLoader
    val_loader: Iterable[Batch]
    """The validation batches: a DataLoader's, kept in memory after the first pass where they fit
    (`rankscope_trainer.val_cache`)."""
    sampler: ResumableDistributedSampler
    tokenizer: WordTokenizer
    skipped: Counter
    """Samples the manifest check left out (on_bad_sample: skip), by reason."""
    train_loader_for: Callable[[int], DataLoader]
    """A training loader of another micro-batch size over the same data and sampler."""

    def steps_per_epoch(self, step_samples: int) -> int:
        return steps_per_epoch(self.sampler.num_samples, step_samples)

    def set_micro_batch(self, size: int) -> None:
        """Deliver micro-batches of `size` from the next iteration on (reduce_micro_batch)."""
        self.train_loader = self.train_loader_for(size)


def _datasets(cfg: Any, image_size: int, seed: int) -> tuple[Dataset, Dataset, Counter]:
    transform = image_transform(image_size)
    if cfg.source == "synthetic":
        syn = cfg.synthetic
        train = ShapesDataset(syn.train_size, syn.image_size, seed, "train", transform)
        val = ShapesDataset(syn.val_size, syn.image_size, seed, "val", transform)
        return train, val, Counter()
    args = (cfg.image_root, cfg.on_bad_sample, cfg.verify_images)
    train_manifest = read_manifest(cfg.manifest, *args)
    val_manifest = read_manifest(cfg.val_manifest, *args)
    skipped = train_manifest.skipped + val_manifest.skipped
    return ManifestDataset(train_manifest.entries, transform), ManifestDataset(val_manifest.entries, transform), skipped


def build_data(
    cfg: Any,
    image_size: int,
    seed: int,
    rank: int,
    world_size: int,
    tokenizer: WordTokenizer | None = None,
    pin_memory: bool = False,
) -> DataBundle:
    """Data sets, tokenizer (built from the training captions unless given, e.g. from a checkpoint) and loaders."""
    train, val, skipped = _datasets(cfg, image_size, seed)
    if tokenizer is None:
        tokenizer = WordTokenizer.build(train.captions(), cfg.max_text_length)  # type: ignore[attr-defined]
    sampler = ResumableDistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    step_samples = cfg.batch_size * cfg.accumulation_steps
    if sampler.num_samples < step_samples:
        raise DataError(
            f"training set too small: {len(train)} samples give {sampler.num_samples} per rank, "  # type: ignore[arg-type]
            f"fewer than data.batch_size x data.accumulation_steps = {step_samples}"
        )
    collate = Collate(tokenizer, image_size)

    def train_loader_for(micro_batch: int) -> DataLoader:
        workers = cfg.num_workers
        return DataLoader(
            train,
            batch_size=micro_batch,
            sampler=sampler,
            num_workers=workers,
            collate_fn=collate,
            drop_last=True,  # equal batches on every rank and every step
            persistent_workers=workers > 0,
            pin_memory=pin_memory,
            multiprocessing_context=worker_context() if workers > 0 else None,
            # torchrun sends SIGTERM to the rank's whole process group: the rank checkpoints and stops
            # its workers itself, so they must not die of it first (and take the rank down with them);
            # and they end with the rank, however it ended.
            worker_init_fn=WorkerInit(),
            # Own generator: creating an iterator then never draws from the global RNG, so resuming
            # mid-epoch leaves the RNG exactly where the uninterrupted run had it.
            generator=torch.Generator().manual_seed(seed),
        )

    val_sampler: DistributedSampler = DistributedSampler(val, num_replicas=world_size, rank=rank, shuffle=False)
    val_loader = DataLoader(
        val,
        batch_size=cfg.val_batch_size,
        sampler=val_sampler,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),  # validation leaves the global RNG alone too
    )
    val_batches = CachedBatches(val_loader, cfg.val_cache_mib * 2**20, announce=rank == 0)
    return DataBundle(train_loader_for(cfg.batch_size), val_batches, sampler, tokenizer, skipped, train_loader_for)
