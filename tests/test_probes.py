"""Probes run at scrape time; failures are counted once each and never raise."""

import logging

import pytest
import torch
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope.probes import DeviceMemoryProbe, NvmlProbe, Probe, ProbeUnavailable, Sample

IDENTITY = RankIdentity(run_id="p", rank=0, local_rank=0, world_size=1, node="n0")
LABELS = IDENTITY.labels()


class ExplodingProbe(Probe):
    """A fake probe standing in for any probe that raises (e.g. a flaky driver call)."""

    name = "exploding"

    def __init__(self):
        self.calls = 0

    def sample(self):
        self.calls += 1
        raise RuntimeError("driver went away")


class FakeGpuProbe(Probe):
    """A fake GPU probe: these machines have no GPU, so NVML values are faked here."""

    name = "nvml"

    def sample(self):
        yield Sample("rankscope_gpu_utilization_ratio", 0.75)
        yield Sample("rankscope_gpu_power_watts", 250.0)


def scrape(monitor):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in monitor.registry.collect()
        for s in family.samples
    }


def test_host_probe_reports_memory_ratio_and_resident_size():
    monitor = Monitor(MonitorConfig(base_port=0, probes=("host",)), IDENTITY, device="cpu")
    ratio = monitor.registry.get_sample_value("rankscope_host_memory_used_ratio", LABELS)
    assert 0 < ratio < 1
    assert monitor.registry.get_sample_value("rankscope_process_resident_memory_bytes", LABELS) > 1e6


def test_a_failing_probe_is_counted_per_scrape_logged_once_and_others_still_report(caplog):
    probe = ExplodingProbe()
    monitor = Monitor(MonitorConfig(base_port=0), IDENTITY, device="cpu", probes=[probe, FakeGpuProbe()])
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        for _ in range(3):
            scrape(monitor)
    errors = monitor.registry.get_sample_value("rankscope_monitor_errors_total", {**LABELS, "probe": "exploding"})
    assert errors == 3 and probe.calls == 3
    assert len([r for r in caplog.records if "exploding" in r.getMessage()]) == 1
    assert monitor.registry.get_sample_value("rankscope_gpu_power_watts", LABELS) == 250.0


def test_nvml_absence_is_counted_once_and_the_probe_switched_off(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; NVML absence cannot be observed")
    monitor = Monitor(MonitorConfig(base_port=0, probes=("host", "nvml")), IDENTITY, device="cpu")
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        for _ in range(4):
            scrape(monitor)
    errors = monitor.registry.get_sample_value("rankscope_monitor_errors_total", {**LABELS, "probe": "nvml"})
    assert errors == 1
    assert len([r for r in caplog.records if "nvml" in r.getMessage()]) == 1
    assert monitor.registry.get_sample_value("rankscope_gpu_utilization_ratio", LABELS) is None


def test_nvml_probe_raises_unavailable_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ProbeUnavailable):
        list(NvmlProbe(torch.device("cpu")).sample())


def test_device_memory_probe_is_silent_on_cpu():
    assert list(DeviceMemoryProbe(torch.device("cpu")).sample()) == []


def test_host_probe_reports_the_hosts_cpu_load_per_cpu(monkeypatch):
    """A step-time rise caused by other processes on the machine must be visible: the load per CPU."""
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 1.0, 0.5))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monitor = Monitor(MonitorConfig(base_port=0, probes=("host",)), IDENTITY, device="cpu")
    assert monitor.registry.get_sample_value("rankscope_host_cpu_load_ratio", LABELS) == 1.5
