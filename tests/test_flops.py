"""Model FLOPs and MFU: counted once by torch's FlopCounterMode without changing training; the peak table."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rankscope import Monitor, MonitorConfig
from rankscope.flops import peak_flops_for
from rankscope.identity import RankIdentity
from torch.utils.flop_counter import FlopCounterMode

BATCH, WIDTH = 32, 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))


def _monitor(**config) -> Monitor:
    identity = RankIdentity(run_id="t", rank=1, local_rank=1, world_size=2, node="n")
    return Monitor(
        MonitorConfig(base_port=0, probes=(), **config), identity, device="cpu", registry=CollectorRegistry()
    )


def _train(monitor: Monitor, steps: int) -> torch.nn.Module:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = torch.randn(BATCH, WIDTH, generator=generator)
        with monitor.step(samples=BATCH) as step:
            loss = (model(batch) - batch).pow(2).mean()
            loss.backward()
            step.record(loss=loss)
            optimizer.step()
            optimizer.zero_grad()
    return model


def _page_samples(monitor: Monitor) -> list[tuple[str, float]]:
    page = generate_latest(monitor.registry).decode()
    return [(sample.name, sample.value) for family in text_string_to_metric_families(page) for sample in family.samples]


def _value(monitor: Monitor, name: str) -> float | None:
    found = [value for sample, value in _page_samples(monitor) if sample == name]
    return found[0] if found else None


def test_counting_flops_on_the_first_step_leaves_training_bit_identical() -> None:
    plain = _train(_monitor(), 4)
    counted_monitor = _monitor(count_flops=True)
    counted = _train(counted_monitor, 4)
    for a, b in zip(plain.parameters(), counted.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _value(counted_monitor, "rankscope_model_flops_total") > 0


def test_the_count_is_flop_counter_modes_for_one_step_and_every_step_adds_it() -> None:
    model = _model()
    with FlopCounterMode(display=False) as mode:
        batch = torch.randn(BATCH, WIDTH)
        (model(batch) - batch).pow(2).mean().backward()
    per_step = mode.get_total_flops()
    # Two linears: a forward each, weight and input gradients of the second, the first's weight gradient
    # (its input needs none): five products of 2 * BATCH * WIDTH * 4 * WIDTH FLOPs.
    assert per_step == 5 * 2 * BATCH * WIDTH * 4 * WIDTH
    monitor = _monitor(count_flops=True)
    _train(monitor, 5)
    assert _value(monitor, "rankscope_model_flops_total") == 5 * per_step


def test_achieved_flops_per_second_agrees_with_the_count_times_steps_per_second() -> None:
    monitor = _monitor(count_flops=True)
    _train(monitor, 1)
    per_step = _value(monitor, "rankscope_model_flops_total")
    flops_before, steps_before, started = per_step, _value(monitor, "rankscope_steps_total"), time.perf_counter()
    _train(monitor, 20)
    elapsed = time.perf_counter() - started
    achieved = (_value(monitor, "rankscope_model_flops_total") - flops_before) / elapsed
    steps_per_second = (_value(monitor, "rankscope_steps_total") - steps_before) / elapsed
    assert achieved == pytest.approx(per_step * steps_per_second, rel=0.05)


def test_a_given_flops_per_step_wins_and_nothing_is_counted() -> None:
    monitor = _monitor(count_flops=True, flops_per_step=1e9)
    _train(monitor, 3)
    assert _value(monitor, "rankscope_model_flops_total") == 3e9


def test_a_configured_peak_is_exported_and_mfu_is_achieved_over_it() -> None:
    monitor = _monitor(flops_per_step=2e9, peak_flops=1e12)
    started = time.perf_counter()
    _train(monitor, 10)
    elapsed = time.perf_counter() - started
    peak = _value(monitor, "rankscope_peak_flops_per_second")
    assert peak == 1e12
    mfu = _value(monitor, "rankscope_model_flops_total") / elapsed / peak
    assert mfu == pytest.approx(10 * 2e9 / elapsed / 1e12)


def test_on_a_cpu_without_a_configured_peak_there_is_no_mfu_and_no_flops_without_a_count() -> None:
    monitor = _monitor()
    _train(monitor, 2)
    names = {name for name, _ in _page_samples(monitor)}
    assert "rankscope_peak_flops_per_second" not in names
    assert "rankscope_model_flops_total" not in names
    counted = _monitor(count_flops=True)
    _train(counted, 2)
    assert "rankscope_peak_flops_per_second" not in {name for name, _ in _page_samples(counted)}


@pytest.mark.parametrize(
    ("device", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "tf32", 494.7e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA L4", "fp16", 121e12),
        ("NVIDIA L40S", "bf16", 362.05e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on a V100: no number
        ("NVIDIA GeForce GTX 1080", "fp32", None),
    ],
)
def test_the_peak_table_by_device_name_and_dtype(device: str, dtype: str, peak: float | None) -> None:
    assert peak_flops_for(device, dtype) == peak


def test_a_bad_compute_dtype_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="metrics.compute_dtype must be one of bf16, fp16, tf32, fp32, got 'fp8'"):
        MonitorConfig(compute_dtype="fp8")
