"""Settings of the monitor, checked when built so a typo fails at start."""

from __future__ import annotations

import ipaddress
from dataclasses import MISSING, dataclass, fields
from typing import Any

from rankscope import hang_threshold
from rankscope._checks import check_range

__all__ = ["MonitorConfig", "config_from_mapping"]


@dataclass
class MonitorConfig:
    """How one rank's monitor behaves. Every field has a safe default."""

    enabled: bool = True
    """False turns the monitor into a do-nothing sink (the loop runs unchanged)."""
    host: str = "0.0.0.0"
    """Address the metrics endpoint binds to. Metrics are read-only, so all interfaces by default."""
    base_port: int = 9400
    """Rank with local rank r serves on base_port + r. 0 picks a free port (tests)."""
    port_fallback: int = 0
    """If the port is taken, try up to this many following ports (logged loudly). 0 fails with a clear error."""
    resolve_every_n_steps: int = 10
    """On an accelerator, device scalars (loss, norms) become numbers every N steps, in one transfer.
    CPU tensors cost nothing to read and are resolved every step."""
    module_stats_every_n_steps: int = 50
    """Per-module gradient norms and update ratios are computed on this interval (0 = never)."""
    max_module_groups: int = 4
    """Top-level module groups get their own `module` label (the first max_module_groups - 1 of them); the rest
    share module="other". Each group is two series per rank (grad norm, update ratio)."""
    skip_nonfinite: bool = False
    """Skip the optimizer update when loss or gradient norm is NaN/inf, on all ranks alike.
    Costs one host-device sync (and, with several ranks, one tiny all-reduce) per step."""
    spike_window: int = 50
    """Loss spike detection: rolling window of finite losses."""
    spike_ratio: float = 2.0
    """A loss above spike_ratio times the rolling mean is a spike candidate."""
    spike_patience: int = 1
    """Consecutive candidate steps before a spike is counted (once per episode)."""
    probes: tuple[str, ...] = ("host", "device", "nvml")
    """Resource probes sampled at scrape time."""
    step_peak_memory: bool = False
    """On CUDA, record each step's peak allocated device memory (rankscope_step_peak_device_memory_bytes): the
    allocator's peak is reset as every step begins (host-side counters, no device sync), so your own
    torch.cuda.max_memory_allocated() and device_memory_bytes{kind="peak"} then read the peak since the current
    step began. Off by default for that reason; nothing happens on CPU, which has no device memory."""
    model_name: str = ""
    """Goes into rankscope_run_info."""
    config_hash: str = ""
    """Goes into rankscope_run_info (e.g. a hash of the training config)."""
    goodput: bool = True
    """Rank 0 accounts the job's wall time by bucket (rankscope_goodput_seconds_total; docs/goodput.md)."""
    goodput_dir: str = ""
    """The run's state directory (where its checkpoints are): the goodput ledger is kept there, so the job's
    accounting continues across restarts and resumes. "" keeps it in memory (this process only)."""
    goodput_flush_seconds: float = 1.0
    """How often rank 0 writes the ledger (a background thread): a crash loses at most this much accounting."""
    hang_floor_seconds: float = hang_threshold.FLOOR_SECONDS
    """The goodput's `hang`: no step or phase ended for longer than max(this, hang_step_multiple x the recent step
    time), counted whole from that last end. The rule pack's hang alert has the same two settings with
    the same defaults (rankscope.hang_threshold): set both alike."""
    hang_step_multiple: float = hang_threshold.STEP_MULTIPLE
    count_flops: bool = False
    """Count the model FLOPs of the first step with torch's FlopCounterMode (it runs every op unchanged) and
    count that many per step in rankscope_model_flops_total. Ignored when flops_per_step is given."""
    flops_per_step: float = 0.0
    """Model FLOPs of one step on this rank, if known (0: unknown, or counted with count_flops)."""
    peak_flops: float = 0.0
    """The device's peak FLOP/s for MFU (0: from rankscope.flops.PEAK_FLOPS for a known CUDA device, else none)."""
    compute_dtype: str = "bf16"
    """The dtype the model's matrix products run in (bf16, fp16, tf32, fp32): picks the table's peak."""
    page_cache_seconds: float = 1.0
    """The rendered /metrics page is reused for this long, so the page is rendered and the probes run
    at most once per period however often it is scraped (a scrape may see values this much older; never
    older than the last state change: the run's end, an action, a pause). 0 renders on every scrape."""
    web_config_file: str = ""
    """exporter-toolkit web configuration file for /metrics (TLS, client certificates, basic auth): see
    docs/security.md. Empty: $RANKSCOPE_METRICS_WEB_CONFIG_FILE, else $RANKSCOPE_WEB_CONFIG_FILE, else plain HTTP."""

    def __post_init__(self) -> None:
        self.probes = tuple(self.probes)
        check_host("metrics.host", self.host)
        check_port("metrics.base_port", self.base_port)
        check_range("metrics.port_fallback", self.port_fallback, ge=0, integer=True)
        check_range("metrics.resolve_every_n_steps", self.resolve_every_n_steps, ge=1, integer=True)
        check_range("metrics.module_stats_every_n_steps", self.module_stats_every_n_steps, ge=0, integer=True)
        check_range("metrics.max_module_groups", self.max_module_groups, ge=1, integer=True)
        check_range("metrics.page_cache_seconds", self.page_cache_seconds, ge=0, le=3600, note=" (0: no cache)")
        for name in ("goodput_flush_seconds", "hang_floor_seconds", "hang_step_multiple"):
            check_range(f"metrics.{name}", getattr(self, name), gt=0)
        for name in ("flops_per_step", "peak_flops"):
            check_range(f"metrics.{name}", getattr(self, name), ge=0, note=" (0: unknown)")
        if self.compute_dtype not in ("bf16", "fp16", "tf32", "fp32"):
            raise ValueError(f"metrics.compute_dtype must be one of bf16, fp16, tf32, fp32, got {self.compute_dtype!r}")
        check_range("metrics.spike_window", self.spike_window, ge=2, integer=True)
        check_range("metrics.spike_patience", self.spike_patience, ge=1, integer=True)
        check_range("metrics.spike_ratio", self.spike_ratio, gt=1)
        unknown = set(self.probes) - {"host", "device", "nvml"}
        if unknown:
            raise ValueError(f"metrics.probes has unknown probe(s) {sorted(unknown)}; known: device, host, nvml")


def check_host(name: str, host: str) -> None:
    """An IP address or a host name (no blanks); the error names the setting."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not host or any(c.isspace() for c in host):
            raise ValueError(f"{name} must be an IP address or host name, got {host!r}") from None


def check_port(name: str, port: int) -> None:
    """A TCP port, 0 meaning "pick a free one"."""
    check_range(name, port, ge=0, le=65535, integer=True)


#: Settings that were replaced: a config written for an earlier release says what to write now, not just
#: "unknown".
REPLACED_SETTINGS = {
    "hang_seconds": (
        "{section}.hang_floor_seconds and {section}.hang_step_multiple (a hang is no step for longer than "
        "max(floor, multiple x the recent step time): docs/hangs.md)"
    ),
}


def config_from_mapping(cls: type, data: dict[str, Any] | None, section: str) -> Any:
    """Build a config dataclass from a mapping (e.g. a YAML section), naming any bad key.

    Unknown keys and wrong types fail with `section.key` in a one-line message.
    """
    data = dict(data or {})
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known and key in REPLACED_SETTINGS:
            now = REPLACED_SETTINGS[key].format(section=section)
            raise ValueError(f"{section}.{key} was replaced by {now}")
        if key not in known:
            raise ValueError(f"unknown setting {section}.{key}; known: {', '.join(sorted(known))}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        kwargs[key] = _coerce(f"{section}.{key}", known[key], value)
    return cls(**kwargs)


def _coerce(name: str, f: Any, value: Any) -> Any:
    default = None if f.default is MISSING else f.default
    if default is None or value is None:
        return value
    expected = type(default)
    if expected is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is tuple and isinstance(value, list):
        return tuple(value)
    if not isinstance(value, expected) or isinstance(value, bool) and expected is not bool:
        raise ValueError(f"{name} must be of type {expected.__name__}, got {type(value).__name__} {value!r}")
    return value
