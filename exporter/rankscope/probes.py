"""Resource probes, sampled when Prometheus scrapes (never in the training loop).

A probe that raises is counted in rankscope_monitor_errors_total{probe} and
logged once; a probe that cannot work here at all (no GPU, no NVML driver)
raises ProbeUnavailable once and is switched off. Training never notices.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import psutil
import torch
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rankscope._log import LogOnce
from rankscope.contract import METRICS, PREFIX

__all__ = [
    "DeviceMemoryProbe",
    "HostMemoryProbe",
    "NvmlProbe",
    "Probe",
    "ProbeCollector",
    "ProbeUnavailable",
    "Sample",
    "default_probes",
]


@dataclass(frozen=True)
class Sample:
    metric: str
    """Exposed metric name from the contract."""
    value: float
    labels: tuple[tuple[str, str], ...] = ()
    """Extra labels beyond the identity labels."""


class ProbeUnavailable(RuntimeError):
    """The probe cannot work on this machine; it is disabled after one report."""


class Probe:
    """Base class: `name` goes into the errors counter's `probe` label."""

    name = "probe"

    def sample(self) -> Iterable[Sample]:
        raise NotImplementedError


def host_cpu_load() -> float | None:
    """The 1-minute load average over the host's CPU count; None where the OS has no load average."""
    try:
        one_minute = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; or /proc unreadable
        return None
    return one_minute / (os.cpu_count() or 1)


class HostMemoryProbe(Probe):
    name = "host"

    def __init__(self) -> None:
        self._process = psutil.Process()

    def sample(self) -> Iterable[Sample]:
        yield Sample(PREFIX + "host_memory_used_ratio", psutil.virtual_memory().percent / 100.0)
        load = host_cpu_load()
        if load is not None:
            yield Sample(PREFIX + "host_cpu_load_ratio", load)
        yield Sample(PREFIX + "process_resident_memory_bytes", float(self._process.memory_info().rss))


class DeviceMemoryProbe(Probe):
    """Caching-allocator statistics: host-side counters, no device sync."""

    name = "device"

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def sample(self) -> Iterable[Sample]:
        if self._device.type != "cuda":
            return
        d = self._device
        metric = PREFIX + "device_memory_bytes"
        yield Sample(metric, float(torch.cuda.memory_allocated(d)), (("kind", "allocated"),))
        yield Sample(metric, float(torch.cuda.memory_reserved(d)), (("kind", "reserved"),))
        yield Sample(metric, float(torch.cuda.max_memory_allocated(d)), (("kind", "peak"),))
        yield Sample(metric, float(torch.cuda.get_device_properties(d).total_memory), (("kind", "total"),))


class NvmlProbe(Probe):
    """GPU utilisation, power and temperature through NVML.

    torch.cuda's NVML helpers map the CUDA device index to the NVML index
    (honouring CUDA_VISIBLE_DEVICES), which plain pynvml indices would not.
    """

    name = "nvml"

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._ready = False

    def _init(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ProbeUnavailable(f"pynvml is not installed ({exc}); install nvidia-ml-py") from None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise ProbeUnavailable(f"NVML is not available on this machine: {exc}") from None
        if self._device.type != "cuda" or not torch.cuda.is_available():
            raise ProbeUnavailable(f"NVML found no CUDA device for {self._device}")
        self._ready = True

    def sample(self) -> Iterable[Sample]:
        if not self._ready:
            self._init()
        d = self._device
        yield Sample(PREFIX + "gpu_utilization_ratio", torch.cuda.utilization(d) / 100.0)
        yield Sample(PREFIX + "gpu_power_watts", torch.cuda.power_draw(d) / 1000.0)
        yield Sample(PREFIX + "gpu_temperature_celsius", float(torch.cuda.temperature(d)))


def default_probes(names: Sequence[str], device: torch.device) -> list[Probe]:
    factories: dict[str, Callable[[], Probe]] = {
        "host": HostMemoryProbe,
        "device": lambda: DeviceMemoryProbe(device),
        "nvml": lambda: NvmlProbe(device),
    }
    return [factories[name]() for name in names]


class ProbeCollector(Collector):
    """A prometheus_client collector that runs the probes on each scrape.

    `on_error(probe_name)` is called for every failure (the monitor increments
    its errors counter there). A scrape may run concurrently with another
    scrape; probes are read-only, so no lock is needed.
    """

    def __init__(
        self,
        probes: Iterable[Probe],
        identity_labels: dict[str, str],
        on_error: Callable[[str], None],
    ) -> None:
        self._probes = list(probes)
        self._identity = identity_labels
        self._on_error = on_error
        self._disabled: set[str] = set()
        self._log = LogOnce()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for probe in self._probes:
            if probe.name in self._disabled:
                continue
            try:
                samples = list(probe.sample())
            except ProbeUnavailable as exc:
                self._disabled.add(probe.name)
                self._on_error(probe.name)
                self._log.warning(probe.name, "rankscope: probe %s disabled: %s", probe.name, exc)
                continue
            except Exception as exc:  # a probe must never break a scrape or training
                self._on_error(probe.name)
                self._log.warning(probe.name, "rankscope: probe %s failed (counted, logged once): %r", probe.name, exc)
                continue
            for sample in samples:
                family = families.get(sample.metric)
                if family is None:
                    spec = METRICS[sample.metric]
                    family = GaugeMetricFamily(spec.name, spec.help, labels=spec.all_labels)
                    families[sample.metric] = family
                extra = dict(sample.labels)
                family.add_metric(
                    [*self._identity.values(), *(extra[k] for k in METRICS[sample.metric].labels)], sample.value
                )
        yield from families.values()

    def describe(self) -> list[GaugeMetricFamily]:
        # Without describe(), registering would call collect() and run the probes.
        return []
