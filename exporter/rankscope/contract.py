"""The metric contract: every metric rankscope exposes, declared once.

Rules, dashboards, tests and the trainer read names from here (or are checked
against this module), so a rename cannot silently break a panel or an alert.

Conventions (Prometheus): base units in the name (``_seconds``, ``_bytes``,
``_ratio`` in 0..1), counters end in ``_total``, labels are bounded. Every
series also carries the identity labels ``run_id``, ``rank``, ``local_rank``
and ``node`` (see :data:`IDENTITY_LABELS`); ``labels`` below lists only the
extras.

Which signal shows what (under DDP):

* ``step_duration_seconds`` is one whole iteration (data wait + compute +
  communication). The all-reduce waits for the slowest rank, so every rank's
  step takes the same wall time: step time shows that the *run* is slow, not
  *which rank* is.
* ``comm_duration_seconds`` is the time inside collectives (DDP's all-reduce, FSDP2's
  all-gathers and reduce-scatters). A fast rank's waiting for a slow peer is counted
  here, in the *fast* rank's comm time.
* ``compute_duration_seconds`` = step - comm - data wait, per rank. This is the
  signal that differs between ranks and reveals a straggler.
* ``data_wait_seconds`` is time blocked on the next batch; a slow loader on one
  rank shows here on that rank (and as comm wait on the others).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "IDENTITY_LABELS",
    "METRICS",
    "MetricKind",
    "MetricSpec",
    "PHASES",
    "PREFIX",
    "STEP_TIME_BUCKETS",
    "UNIT_SUFFIXES",
    "metric",
]

PREFIX = "rankscope_"

#: Labels carried by every series, in this order.
IDENTITY_LABELS: tuple[str, ...] = ("run_id", "rank", "local_rank", "node")

# fmt: off
# Buckets are few on purpose: every bucket is a series per rank, and at thousands of ranks the
# buckets are most of what Prometheus stores and the rules read (benchmarks/README.md, benchmark 4).
# Means and shares come exactly from _sum/_count; buckets give distributions and tail quantiles.
#: Step durations, 30 ms to a minute in half-decades: the run's step-time quantiles are read from them.
STEP_TIME_BUCKETS: tuple[float, ...] = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 60.0)
#: A step's per-rank split (compute, all-reduce) in decades: the straggler rules use means (_sum/_count);
#: the buckets only draw the per-rank distribution panels, so three are enough.
SPLIT_TIME_BUCKETS: tuple[float, ...] = (0.01, 0.1, 1.0)
#: Data waits are usually far below a step. 0.1 s and 0.5 s are boundaries on purpose: the data-loader
#: alert reads "p90 above its threshold" from the bucket at the threshold (exporter/rankscope/mixin/rules.py).
DATA_WAIT_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.1, 0.5, 2.5)
# Where nothing reads a distribution, a summary without quantiles serves its _sum and _count (the exact
# mean) and no buckets: 2 series per rank instead of buckets + 3 (a checkpoint's duration, for one).
# fmt: on

#: What a rank is doing (rankscope_phase's value is the index; rankscope.progress): the training thread
#: sets it, the metrics thread serves it, so a blocked rank still answers. Append only: dashboards and the
#: hang rule read the indices.
PHASES: tuple[str, ...] = (
    "idle", "step_boundary", "data_wait", "compute", "collective", "checkpoint", "validation", "paused",
)  # fmt: skip
_PHASE_HELP = ", ".join(f"{index}={name}" for index, name in enumerate(PHASES))


class MetricKind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    #: prometheus_client's Summary without quantiles: ``_sum`` and ``_count`` only.
    SUMMARY = "summary"
    INFO = "info"


@dataclass(frozen=True)
class MetricSpec:
    """One metric family as it appears in PromQL.

    ``name`` is the exposed family name: counters include ``_total``, info
    metrics ``_info``, histograms the base name (series add ``_bucket``,
    ``_sum``, ``_count``), summaries too (series add ``_sum``, ``_count``).
    """

    name: str
    kind: MetricKind
    help: str
    unit: str = ""
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    #: Who records it: ``core`` (the exporter's Monitor), ``amp`` (the Monitor,
    #: when a GradScaler is watched), ``shape`` (the Monitor, when the loop
    #: reports a step's longest sequence), ``cuda`` (the Monitor, on a CUDA
    #: device with ``step_peak_memory`` on), ``probe`` (sampled at scrape time),
    #: ``control`` (the control channel); a loop declaring its own metrics
    #: (``Monitor(extra_metrics=...)``) names itself, e.g. ``trainer``.
    source: str = "core"

    def __post_init__(self) -> None:
        problem = _convention_problem(self)
        if problem:
            raise ValueError(f"metric {self.name!r}: {problem}")

    @property
    def all_labels(self) -> tuple[str, ...]:
        return IDENTITY_LABELS + self.labels

    @property
    def series_names(self) -> tuple[str, ...]:
        """Every sample name this family produces, as PromQL sees it."""
        if self.kind is MetricKind.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.kind is MetricKind.SUMMARY:
            return (f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)

    def series(self, part: str) -> str:
        """The name of this family's ``bucket``/``sum``/``count`` series (ValueError where it has none)."""
        name = f"{self.name}_{part}"
        if name not in self.series_names:
            raise ValueError(f"{self.name} is a {self.kind.value}, it has no _{part} series")
        return name

    @property
    def client_name(self) -> str:
        """The name prometheus_client wants (it appends ``_total``/``_info``)."""
        if self.kind is MetricKind.COUNTER:
            return self.name.removesuffix("_total")
        if self.kind is MetricKind.INFO:
            return self.name.removesuffix("_info")
        return self.name


_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
#: Base units a name may end in (Prometheus naming: base units, no "percent").
UNIT_SUFFIXES: tuple[str, ...] = (
    "seconds", "bytes", "ratio", "watts", "celsius", "tokens", "pixels", "nats", "joules", "meters",
)  # fmt: skip
#: Label names that would make a series per step, per file or per message: never bounded.
_UNBOUNDED_LABELS = frozenset({"step", "path", "file", "message", "reason_text", "time", "timestamp", "id"})
_RESERVED_LABELS = frozenset({"le", "quantile", "job", "instance"})


def _convention_problem(spec: MetricSpec) -> str:
    """What breaks Prometheus's conventions in `spec`, or "" (the same checks for every metric, ours or a user's)."""
    if not _NAME.match(spec.name):
        return "a name is letters, digits, '_' and ':' and does not start with a digit"
    if not spec.help.strip():
        return "help text is required (it is the metric's documentation on every page)"
    if (spec.kind is MetricKind.COUNTER) != spec.name.endswith("_total"):
        return "counters, and only counters, end in _total"
    if spec.kind is MetricKind.INFO and not spec.name.endswith("_info"):
        return "info metrics end in _info"
    if "percent" in spec.name:
        return "use a _ratio in 0..1, not a percentage"
    if spec.unit and spec.unit not in UNIT_SUFFIXES:
        return f"unit {spec.unit!r} is not a base unit; use one of {', '.join(UNIT_SUFFIXES)}"
    if spec.unit and not spec.name.removesuffix("_total").endswith("_" + spec.unit):
        return f"the name must end in its unit, _{spec.unit}"
    for label in spec.labels:
        if not _LABEL.match(label) or label.startswith("__"):
            return f"label {label!r} is not a valid label name"
        if label in IDENTITY_LABELS or label in _RESERVED_LABELS:
            return f"label {label!r} is reserved (identity labels are added to every series)"
        if label in _UNBOUNDED_LABELS:
            return f"label {label!r} would be unbounded (one series per value): keep labels to small fixed sets"
    if len(set(spec.labels)) != len(spec.labels):
        return "a label is listed twice"
    if spec.kind is MetricKind.HISTOGRAM:
        if not spec.buckets or list(spec.buckets) != sorted(set(spec.buckets)):
            return "a histogram needs strictly increasing buckets"
    elif spec.buckets:
        return "only histograms have buckets"
    return ""


_C, _G, _H, _S, _I = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM, MetricKind.SUMMARY, MetricKind.INFO


def _m(name: str, kind: MetricKind, help: str, **kw: object) -> MetricSpec:
    return MetricSpec(PREFIX + name, kind, help, **kw)  # type: ignore[arg-type]


_SPECS: tuple[MetricSpec, ...] = (
    # --- step timing -------------------------------------------------------
    _m(
        "step_duration_seconds",
        _H,
        "Wall time of one training iteration (data wait + compute + communication).",
        unit="seconds",
        buckets=STEP_TIME_BUCKETS,
    ),
    _m(
        "data_wait_seconds",
        _H,
        "Time one training step spent blocked waiting for batches from the data loader (all of the step's "
        "fetches, whether before the step or inside it).",
        unit="seconds",
        buckets=DATA_WAIT_BUCKETS,
    ),
    _m(
        "comm_duration_seconds",
        _H,
        "Time per step inside collectives, overlaps counted once. Under DDP with attach_comm_hook: the gradient "
        "all-reduce, timed by the comm hook. Otherwise, where every process group is gloo: each collective the "
        "step issued, timed by the collective view (FSDP2's all-gathers and reduce-scatters, tensor parallel's "
        "all-reduces; pipeline send/recv are not timed). Not recorded on NCCL without the DDP hook.",
        unit="seconds",
        buckets=SPLIT_TIME_BUCKETS,
    ),
    _m(
        "compute_duration_seconds",
        _H,
        "Per-rank compute time of a step: step minus communication minus data wait. Differs between ranks; "
        "reveals stragglers.",
        unit="seconds",
        buckets=SPLIT_TIME_BUCKETS,
    ),
    # --- progress ----------------------------------------------------------
    _m("steps_total", _C, "Training steps completed by this rank."),
    _m("samples_total", _C, "Training samples processed by this rank."),
    _m("tokens_total", _C, "Text tokens processed by this rank (excluding padding)."),
    _m("global_step", _G, "The global training step this rank last completed."),
    _m("last_step_timestamp_seconds", _G, "Unix time at which this rank last completed a step.", unit="seconds"),
    _m(
        "previous_process_vanished_timestamp_seconds",
        _G,
        "Unix time at which this rank's process found that the previous process of the same rank and run (a "
        "torchrun restart ago) ended without a word: killed (SIGKILL, the OOM killer) or crashed in native code "
        "(rankscope.exits; needs the run's state directory, where its checkpoints are). Absent otherwise.",
        unit="seconds",
        source="exits",
    ),
    _m(
        "run_finished",
        _G,
        "1 once this rank has finished its run cleanly (the rank-down alert ignores ranks that said so); "
        "0 while running.",
    ),
    # --- what a step's batch costs ----------------------------------------------
    _m(
        "sequence_length_max_tokens",
        _G,
        "Longest sequence of the rank's latest step, in tokens, as the loop reports it "
        "(Monitor.step(max_seq_len=...)); absent until it does.",
        unit="tokens",
        source="shape",
    ),
    _m(
        "step_peak_device_memory_bytes",
        _G,
        "Peak device memory allocated during the rank's latest step (torch.cuda.max_memory_allocated, its peak reset "
        "as each step begins; metrics.step_peak_memory). CUDA only: absent on CPU, which has no device memory.",
        unit="bytes",
        source="cuda",
    ),
    # --- optimisation scalars ------------------------------------------------
    _m("loss", _G, "Latest loss value.", labels=("split",)),
    _m("grad_norm", _G, "Total gradient L2 norm before clipping (latest step)."),
    _m(
        "module_grad_norm",
        _G,
        "Gradient L2 norm per top-level module group (sampled on an interval; before clipping when the loop "
        "clips with Monitor.clip_grad_norm_).",
        labels=("module",),
    ),
    _m(
        "update_ratio",
        _G,
        "Norm of the parameter update divided by the parameter norm, per module group (sampled on an interval).",
        unit="ratio",
        labels=("module",),
    ),
    _m("learning_rate", _G, "Current learning rate per optimizer parameter group.", labels=("param_group",)),
    # --- guards ------------------------------------------------------------
    _m(
        "nonfinite_steps_total",
        _C,
        "Steps whose loss or gradient norm was NaN or infinite (with a GradScaler watched: whose loss was; "
        "gradient overflows are counted in loss_scale_overflows_total).",
    ),
    _m("skipped_steps_total", _C, "Optimizer updates skipped by the non-finite guard."),
    _m(
        "loss_scale",
        _G,
        "Loss scale of the loop's GradScaler (dynamic loss scaling), as of the latest resolved step.",
        source="amp",
    ),
    _m(
        "loss_scale_overflows_total",
        _C,
        "Steps whose scaled gradients overflowed while the loss was finite: the GradScaler skipped the update "
        "and lowered its scale, as dynamic loss scaling expects.",
        source="amp",
    ),
    _m(
        "loss_spikes_total",
        _C,
        "Loss spikes: loss above spike_ratio times its rolling mean for spike_patience "
        "steps (counted once per episode).",
    ),
    # --- resources (probes, sampled at scrape time) ---------------------------
    _m(
        "device_memory_bytes",
        _G,
        "Accelerator memory of this rank's device.",
        unit="bytes",
        labels=("kind",),
        source="probe",
    ),
    _m("host_memory_used_ratio", _G, "Fraction of the host's memory in use (psutil).", unit="ratio", source="probe"),
    _m(
        "host_cpu_load_ratio",
        _G,
        "The host's 1-minute load average over its CPU count (os.getloadavg): above 1, more runnable "
        "processes than CPUs, so other processes can slow the step.",
        unit="ratio",
        source="probe",
    ),
    _m("process_resident_memory_bytes", _G, "Resident set size of this rank's process.", unit="bytes", source="probe"),
    _m(
        "gpu_utilization_ratio", _G, "GPU utilisation over the last sample period (NVML).", unit="ratio", source="probe"
    ),
    _m("gpu_power_watts", _G, "GPU power draw (NVML).", unit="watts", source="probe"),
    _m("gpu_temperature_celsius", _G, "GPU temperature (NVML).", unit="celsius", source="probe"),
    # --- run identity and self-monitoring -------------------------------------
    _m(
        "run_info",
        _I,
        "Static facts about the run; value is always 1.",
        labels=("world_size", "node_rank", "torch_version", "cuda_version", "backend", "model", "config_hash"),
    ),
    _m("monitor_errors_total", _C, "Failures inside the monitor itself (training went on).", labels=("probe",)),
    # --- control loop (rankscope.control) --------------------------------------
    _m(
        "control_actions_total",
        _C,
        "Control actions by outcome, counted once per job on rank 0 (the rank that receives them); every rank "
        "applies an applied action at the same step.",
        labels=("action", "source", "result"),
        source="control",
    ),
    _m(
        "control_last_applied_timestamp_seconds",
        _G,
        "Unix time at which rank 0 last applied each control action (in this process); appears at the first.",
        unit="seconds",
        labels=("action",),
        source="control",
    ),
    _m(
        "skipped_batches_total",
        _C,
        "Batches of training data this rank skipped after a control rollback (one batch = the data of one "
        "optimizer step on this rank); appears at the first rollback.",
        source="control",
    ),
    _m(
        "micro_batch_size",
        _G,
        "Samples per micro-batch on this rank (gradient accumulation = samples per step / this), as the loop "
        "reports it; reduce_micro_batch halves it.",
        source="control",
    ),
    _m(
        "checkpoints_total",
        _C,
        "Checkpoints written, by reason (interval, alert, operator, stop, final).",
        labels=("reason",),
        source="control",
    ),
    _m(
        "checkpoint_failures_total",
        _C,
        "Checkpoints that could not be written, by reason (no_space, permission, io_error, other).",
        labels=("reason",),
        source="control",
    ),
    _m(
        "checkpoint_duration_seconds",
        _S,
        "Time to write one checkpoint (a summary: _sum / _count is the mean).",
        unit="seconds",
        source="control",
    ),
    _m(
        "last_checkpoint_timestamp_seconds",
        _G,
        "Unix time of the last completed checkpoint.",
        unit="seconds",
        source="control",
    ),
    _m("paused", _G, "1 while training is paused by a control action, else 0.", source="control"),
    # --- goodput and MFU (rankscope.goodput, rankscope.flops; docs/goodput.md) ----------------------------
    _m(
        "goodput_seconds_total",
        _C,
        "The job's wall time since its first start, across restarts, by bucket (startup, training, checkpoint, "
        "validation, paused, hang add up to it; lost is the part of training thrown away by a resume or a "
        "rollback). Rank 0 only.",
        labels=("bucket",),
        source="goodput",
    ),
    _m(
        "model_flops_total",
        _C,
        "Model FLOPs this rank computed (FLOPs per step, counted once by torch's FlopCounterMode or given, times "
        "steps): rate() is achieved FLOP/s. Absent unless FLOPs per step are known.",
        source="flops",
    ),
    _m(
        "peak_flops_per_second",
        _G,
        "The device's peak FLOP/s at the compute dtype (configured, or the table in rankscope.flops for a known "
        "CUDA device): MFU = rate(model_flops_total) / this. Absent when unknown (a CPU).",
        source="flops",
    ),
    _m(
        "restart_lost_steps_total",
        _C,
        "Training steps lost to control restarts: those completed after the newest checkpoint when the group "
        "exited, counted on rank 0 by the incarnation that trained again.",
        source="control",
    ),
    # --- collectives and progress (rankscope.collectives, rankscope.progress; docs/collectives.md) ----------
    _m(
        "collective_seconds_total",
        _C,
        "Seconds this rank spent in collectives (issue to completion), by kind and mesh dimension, every "
        "process group (torch's Flight Recorder sees them all; timed by per-group hooks on gloo, by FR's "
        "durations on NCCL).",
        labels=("kind", "dim"),
        source="collectives",
    ),
    _m(
        "collectives_total",
        _C,
        "Collectives started by this rank, by mesh dimension (from torch's Flight Recorder): a rank whose "
        "count lags its peers' has not entered the collective they wait in.",
        labels=("dim",),
        source="collectives",
    ),
    _m(
        "phase",
        _G,
        f"What this rank is doing now, as an index into rankscope.contract.PHASES: {_PHASE_HELP}. Served by the "
        "metrics thread, so a blocked training thread cannot freeze it.",
        source="progress",
    ),
    _m(
        "phase_started_timestamp_seconds",
        _G,
        "Unix time at which this rank entered its current phase (rankscope_phase).",
        unit="seconds",
        source="progress",
    ),
)

#: name -> spec, in declaration order.
METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in _SPECS}


def metric(name: str) -> MetricSpec:
    """Look up a metric by its exposed name, with or without the prefix."""
    key = name if name.startswith(PREFIX) else PREFIX + name
    try:
        return METRICS[key]
    except KeyError:
        raise KeyError(f"unknown rankscope metric {name!r}; see rankscope.contract.METRICS") from None
