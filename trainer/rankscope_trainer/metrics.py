"""The reference trainer's own metrics: multimodal data and model statistics of the CLIP-style model.

They are not part of rankscope's contract (rankscope.contract), which any training loop shares; the
trainer declares them here and hands them to its Monitor (`extra_metrics`), exactly as a user's loop
declares its own. The dashboards' "Model and data" panels read them.
"""

from __future__ import annotations

from rankscope.contract import PREFIX, MetricKind, MetricSpec

__all__ = ["TRAINER_METRICS"]

# The batch statistics are summaries (_sum and _count: the exact mean), not histograms: buckets wide
# enough for any data set put a demo's 48-pixel images and 10-token captions in their first bucket, where
# a quantile is an interpolation, not a measurement, and each bucket is a series on every rank.
_C, _G, _S = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.SUMMARY


def _m(name: str, kind: MetricKind, help: str, **kw: object) -> MetricSpec:
    return MetricSpec(PREFIX + name, kind, help, **kw)  # type: ignore[arg-type]


#: Every metric the trainer records beyond the contract's.
TRAINER_METRICS: tuple[MetricSpec, ...] = (
    _m(
        "contrastive_accuracy_ratio",
        _G,
        "In-batch retrieval accuracy of the contrastive model.",
        unit="ratio",
        labels=("split", "direction"),
        source="trainer",
    ),
    _m("contrastive_temperature", _G, "Learned softmax temperature (1 / logit scale).", source="trainer"),
    _m(
        "text_length_tokens",
        _S,
        "Caption length in tokens, before padding (a summary: _sum / _count is the mean).",
        unit="tokens",
        source="trainer",
    ),
    _m(
        "text_padding_ratio", _G, "Fraction of padding tokens in the latest text batch.", unit="ratio", source="trainer"
    ),
    _m(
        "image_size_pixels",
        _S,
        "Source image side lengths (width and height alike) before resizing (a summary: _sum / _count is the mean).",
        unit="pixels",
        source="trainer",
    ),
    _m(
        "image_channel_mean",
        _G,
        "Per-channel mean of the latest (normalised) image batch.",
        labels=("channel",),
        source="trainer",
    ),
    _m(
        "image_channel_std",
        _G,
        "Per-channel standard deviation of the latest (normalised) image batch.",
        labels=("channel",),
        source="trainer",
    ),
    _m("fusion_gate_weight", _G, "Statistics of the fusion gate's weights.", labels=("stat",), source="trainer"),
    _m(
        "attention_entropy_nats",
        _G,
        "Mean attention entropy of a text-encoder layer (sampled on an interval).",
        unit="nats",
        labels=("layer",),
        source="trainer",
    ),
    _m(
        "data_skipped_samples_total",
        _C,
        "Samples skipped by the data set (missing or unreadable).",
        labels=("reason",),
        source="trainer",
    ),
)
