"""The trainer's one YAML schema: a dataclass per section, checked at start.

    cfg = load_config(
        "trainer/rankscope_trainer/configs/demo.yaml", overrides=["optim.lr=3e-4", "faults.straggler.rank=1"]
    )

Sections: `run`, `metrics` (the exporter's MonitorConfig), `control` (the
exporter's ControlConfig), `checkpoint`, `data`, `model`, `optim`, `faults`.
An unknown key, a duplicate key, a wrong type or an out-of-range value is a
one-line `ConfigError` naming the setting (`optim.lr must be > 0, got -1.0`).
Every field has a default, so a YAML file lists only what it changes.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from rankscope import MonitorConfig, RankIdentity, config_from_mapping
from rankscope._checks import check_range
from rankscope.control import ControlConfig

from rankscope_trainer.faults import FaultsConfig

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SyntheticConfig",
    "TrainConfig",
    "add_overrides_option",
    "build_section",
    "load_config",
]


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` as a string; people write learning rates that way, so read it as a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _no_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    # YAML lets a later key silently replace an earlier one; in a config that hides a typo'd override.
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                f"(first at line {seen[key]}); each setting may appear once"
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicate_keys)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class ConfigError(ValueError):
    """A setting is missing, unknown, of the wrong type or out of range (one line, names the key)."""


def check(condition: bool, message: str) -> None:
    """Raise a ConfigError with `message` unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


#: A range check whose error is a ConfigError (the one range-check style: rankscope._checks).
in_range = functools.partial(check_range, error=ConfigError)


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    check(value in choices, f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class RunConfig:
    """What to run and how to report progress."""

    run_id: str = ""
    """Identity label of the run; "" takes RANKSCOPE_RUN_ID, then torchrun's TORCHELASTIC_RUN_ID."""
    seed: int = 0
    """Seeds model init, data order and every RNG; the same seed gives the same loss curve."""
    max_steps: int = 300
    """Optimizer steps to train (epochs follow from the data set size)."""
    log_every: int = 10
    """Rank 0 prints a progress line (and flushes `log_file`) every N steps."""
    val_every: int = 50
    """Validation every N steps and at the end (0 = only at the end)."""
    stats_every: int = 10
    """Multimodal data and model statistics (lengths, image stats, gate, attention entropy) every N steps."""
    device: str = "auto"
    """auto (CUDA if available, else CPU), cpu or cuda. The backend follows: nccl on CUDA, gloo on CPU."""
    amp: str = "off"
    """Mixed precision on CUDA: off, fp16 (with a gradient scaler) or bf16. Ignored (with a warning) on CPU."""
    threads: int = 0
    """torch intra-op threads per rank; 0 keeps torch's default (torchrun sets OMP_NUM_THREADS=1)."""
    dist_timeout_seconds: int = 600
    """Timeout of collectives; a rank that waits longer for its peers fails instead of hanging."""
    log_file: str = ""
    """JSONL file rank 0 appends per-step records to (loss, accuracy, lr, val, events); "" = none."""
    linger_seconds: float = 0.0
    """Keep serving /metrics this long after the last step, so Prometheus scrapes the final values."""
    attention_maps: int = 4
    """At each validation rank 0 saves the attention maps of this many validation samples (at most 16) into
    `attention/` beside `log_file`, for the run report (0 = none; see trainer/rankscope_trainer/attention_maps.py)."""

    def __post_init__(self) -> None:
        in_range("run.max_steps", self.max_steps, ge=1)
        in_range("run.log_every", self.log_every, ge=1)
        in_range("run.val_every", self.val_every, ge=0)
        in_range("run.stats_every", self.stats_every, ge=0)
        in_range("run.threads", self.threads, ge=0)
        in_range("run.dist_timeout_seconds", self.dist_timeout_seconds, ge=1)
        in_range("run.linger_seconds", self.linger_seconds, ge=0)
        in_range("run.attention_maps", self.attention_maps, ge=0, le=16)
        _one_of("run.device", self.device, ("auto", "cpu", "cuda"))
        _one_of("run.amp", self.amp, ("off", "fp16", "bf16"))
        if self.run_id:
            try:  # the exporter's own rule for the label value
                RankIdentity(self.run_id, rank=0, local_rank=0, world_size=1, node="check")
            except ValueError as exc:
                raise ConfigError(f"run.{exc}") from None


@dataclass
class MetricsConfig(MonitorConfig):
    """The exporter's MonitorConfig, plus where the trainer advertises its targets."""

    file_sd_path: str = ""
    """Rank 0 writes a Prometheus file_sd JSON listing every rank's metrics target here ("" = none)."""
    advertise_host: str = ""
    """Host name Prometheus should scrape this rank at ("" = the bind address, or the host name)."""


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written (rank 0 writes; every rank takes part)."""

    dir: str = "checkpoints"
    """Directory of `step_XXXXXXXX-LINEAGE.pt` files (a run prunes only its own lineage); must be shared by
    all nodes of a multi-node run."""
    every_steps: int = 100
    """Write a checkpoint every N steps (0 = only at the end and on request)."""
    keep: int = 3
    """Keep the newest K checkpoints, delete older ones."""
    save_final: bool = True
    """Write a checkpoint when the run finishes."""

    def __post_init__(self) -> None:
        check(bool(self.dir), "checkpoint.dir must not be empty")
        in_range("checkpoint.every_steps", self.every_steps, ge=0)
        in_range("checkpoint.keep", self.keep, ge=1)


@dataclass
class SyntheticConfig:
    """The built-in data set: rendered shapes with captions that describe them."""

    train_size: int = 4096
    """Training samples (rendered on the fly, deterministically from the seed and index)."""
    val_size: int = 256
    """Validation samples (a disjoint stream of the same generator)."""
    image_size: int = 48
    """Side of the rendered images in pixels (the model resizes to model.image_size)."""

    def __post_init__(self) -> None:
        in_range("data.synthetic.train_size", self.train_size, ge=1)
        in_range("data.synthetic.val_size", self.val_size, ge=1)
        in_range("data.synthetic.image_size", self.image_size, ge=12)


@dataclass
class DataConfig:
    """Where samples come from and how they are batched."""

    source: str = "synthetic"
    """synthetic (built in, learnable) or manifest (your images and captions)."""
    manifest: str = ""
    """Training manifest: JSONL lines {"image": path, "text": caption}, or a CSV with columns image,text."""
    val_manifest: str = ""
    """Validation manifest, same format (required when source is manifest)."""
    image_root: str = ""
    """Relative image paths resolve against this directory ("" = the manifest's directory)."""
    on_bad_sample: str = "error"
    """error: a bad line, missing file or unreadable image stops the run with a message naming the line.
    skip: the sample is left out and counted in rankscope_data_skipped_samples_total{reason}."""
    verify_images: bool = True
    """Open every manifest image at start (so a broken file is found before training, not in a worker)."""
    batch_size: int = 32
    """Samples per rank per micro-batch (the contrastive loss uses the other samples of the micro-batch as
    negatives). With accumulation_steps 1, the samples per rank per step."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step (gradients accumulated, DDP all-reduces once per step). The control
    action reduce_micro_batch halves batch_size and doubles this; a checkpoint keeps the pair."""
    val_batch_size: int = 32
    """Samples per rank per validation batch (in-batch accuracy depends on it)."""
    val_cache_mib: int = 256
    """Host memory per rank for the validation set's batches: when a rank's share fits, the first validation
    keeps them and later ones reuse them instead of reading and decoding every image again (the same
    samples, the same losses). 0 = read them at every validation."""
    num_workers: int = 1
    """DataLoader worker processes per rank (0 = load in the training process)."""
    max_text_length: int = 16
    """Tokens per caption including [CLS] and [SEP]; longer captions are truncated."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def __post_init__(self) -> None:
        _one_of("data.source", self.source, ("synthetic", "manifest"))
        _one_of("data.on_bad_sample", self.on_bad_sample, ("error", "skip"))
        if self.source == "manifest":
            check(bool(self.manifest), "data.manifest must be set when data.source is manifest")
            check(bool(self.val_manifest), "data.val_manifest must be set when data.source is manifest")
        in_range("data.batch_size", self.batch_size, ge=2, note=" (in-batch negatives)")
        in_range("data.val_batch_size", self.val_batch_size, ge=2)
        in_range("data.val_cache_mib", self.val_cache_mib, ge=0)
        in_range("data.accumulation_steps", self.accumulation_steps, ge=1)
        in_range("data.num_workers", self.num_workers, ge=0)
        in_range("data.max_text_length", self.max_text_length, ge=3)


@dataclass
class ModelConfig:
    """The CLIP-style dual encoder (built from constructors; nothing is downloaded)."""

    image_encoder: str = "vit"
    """vit (torchvision VisionTransformer) or resnet (torchvision ResNet with BasicBlocks)."""
    image_size: int = 48
    """Images are resized to this side before the encoder."""
    patch_size: int = 16
    """ViT patch side; must divide image_size."""
    image_hidden: int = 64
    """ViT width."""
    image_layers: int = 2
    """ViT encoder layers, or BasicBlocks per ResNet stage."""
    image_heads: int = 2
    """ViT attention heads."""
    text_hidden: int = 64
    """BERT width."""
    text_layers: int = 2
    """BERT layers."""
    text_heads: int = 2
    """BERT attention heads."""
    embed_dim: int = 64
    """Joint embedding space of the projection heads."""
    dropout: float = 0.0
    """Dropout in both encoders."""
    init_temperature: float = 0.07
    """Initial softmax temperature of the contrastive loss (learned)."""

    def __post_init__(self) -> None:
        _one_of("model.image_encoder", self.image_encoder, ("vit", "resnet"))
        for name in ("image_size", "patch_size", "image_hidden", "image_layers", "image_heads"):
            in_range(f"model.{name}", getattr(self, name), ge=1)
        for name in ("text_hidden", "text_layers", "text_heads", "embed_dim"):
            in_range(f"model.{name}", getattr(self, name), ge=1)
        if self.image_encoder == "vit":
            check(
                self.image_size % self.patch_size == 0,
                f"model.patch_size ({self.patch_size}) must divide model.image_size ({self.image_size})",
            )
            check(
                self.image_hidden % self.image_heads == 0,
                f"model.image_heads ({self.image_heads}) must divide model.image_hidden ({self.image_hidden})",
            )
        check(
            self.text_hidden % self.text_heads == 0,
            f"model.text_heads ({self.text_heads}) must divide model.text_hidden ({self.text_hidden})",
        )
        in_range("model.dropout", self.dropout, ge=0, lt=1)
        in_range("model.init_temperature", self.init_temperature, gt=0)


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay, and gradient clipping."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases, norms and the temperature)."""
    warmup_steps: int = 20
    """Linear warmup from 0 to `lr`."""
    decay_steps: int = 0
    """Length of the cosine schedule; 0 = run.max_steps. Set it to keep the schedule fixed when max_steps changes."""
    min_lr_ratio: float = 0.1
    """The cosine ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    """Clip the total gradient norm to this (0 = no clipping; the norm is still measured)."""

    def __post_init__(self) -> None:
        in_range("optim.lr", self.lr, gt=0)
        in_range("optim.weight_decay", self.weight_decay, ge=0)
        in_range("optim.warmup_steps", self.warmup_steps, ge=0)
        in_range("optim.decay_steps", self.decay_steps, ge=0)
        in_range("optim.min_lr_ratio", self.min_lr_ratio, ge=0, le=1)
        in_range("optim.grad_clip", self.grad_clip, ge=0)


@dataclass
class TrainConfig:
    """The whole configuration of one training run."""

    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    control: ControlConfig = field(default_factory=lambda: ControlConfig(endpoint=False))
    """The control channel (rankscope.control.ControlConfig). Without a `control` section the ranks still
    meet at every step boundary (SIGTERM and SIGINT checkpoint and stop every rank at the same step) but
    rank 0 serves no HTTP endpoint; a `control` section, e.g. `control: {port: 9300}`, serves it with
    ControlConfig's defaults (a bearer token required)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what goes into a checkpoint and into the hash)."""
        return asdict(self)

    def hash(self) -> str:
        """Short, stable hash of the whole config (for rankscope_run_info)."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_section(cls: type, data: Any, section: str) -> Any:
    """Build config dataclass `cls` from a mapping; nested dataclass fields recurse.

    Errors name the full key (`faults.straggler.rank`); the checks themselves are
    the exporter's `config_from_mapping` (unknown keys, types) plus each class's
    `__post_init__` (ranges).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{section} must be a mapping of settings, got {type(data).__name__} {data!r}")
    data = dict(data)
    for f in fields(cls):
        nested = f.default_factory if callable(f.default_factory) else None
        if f.name in data and is_dataclass(nested):
            data[f.name] = build_section(nested, data[f.name], f"{section}.{f.name}")
    try:
        return config_from_mapping(cls, data, section)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "metrics": MetricsConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "faults": FaultsConfig,
}


def parse_config(raw: Any, source: str = "config") -> TrainConfig:
    """Validate a parsed YAML document (a mapping of sections)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    known = [*_SECTIONS, "control"]
    for key in raw:
        if key not in known:
            raise ConfigError(f"unknown section {key!r}; known: {', '.join(sorted(known))}")
    sections = {name: build_section(cls, raw.get(name), name) for name, cls in _SECTIONS.items()}
    if "control" in raw:  # a control section serves the endpoint, with ControlConfig's defaults
        sections["control"] = build_section(ControlConfig, raw["control"], "control")
    return TrainConfig(**sections)


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one `--set a.b.c=value` (value parsed as YAML: 3 -> int, true -> bool, [1, 2] -> list)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set expects section.key=value, got {override!r}")
    try:
        value = _parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {text!r} is not valid YAML ({_first_line(exc)})") from None
    except ConfigError as exc:
        raise ConfigError(f"--set {key}: {exc}") from None
    *parents, leaf = key.split(".")
    node = raw
    for depth, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parents[: depth + 1])
            raise ConfigError(f"--set {key}: {where} is a single value, not a section")
        node = child
    node[leaf] = value


def add_overrides_option(parser: argparse.ArgumentParser) -> None:
    """The `--set KEY=VALUE` option (repeatable) of every command that starts the trainer; -> `args.overrides`."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one trainer setting, e.g. --set optim.lr=3e-4 (repeatable; value read as YAML)",
    )


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML file (None = all defaults), apply `--set` overrides, validate."""
    raw: Any = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {path} is not a YAML text file (not UTF-8 at byte {exc.start})") from None
        try:
            raw = _parse_yaml(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({_first_line(exc)})") from None
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for override in overrides:
        apply_override(raw, override)
    return parse_config(raw, source)


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
