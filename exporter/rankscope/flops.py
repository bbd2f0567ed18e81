"""Model FLOPs per step and the device's peak FLOP/s, for achieved FLOP/s and MFU (docs/goodput.md).

FLOPs per step come from the user (`flops_per_step`) or are counted once, on the first step, by torch's
own `torch.utils.flop_counter.FlopCounterMode` (`count_flops=True`): a dispatch mode that counts the
matrix products, convolutions and attention the step runs, and runs them unchanged. The peak comes from
`peak_flops` or, on a CUDA device, from PEAK_FLOPS below keyed by the device name and the compute dtype.
On a CPU or an unknown device there is no peak, so no MFU: never an invented number.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["COMPUTE_DTYPES", "PEAK_FLOPS", "FlopCounter", "peak_flops_for"]

COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32")

# fmt: off
#: Dense peak FLOP/s (no structured sparsity) from the vendors' datasheets, per device and compute dtype.
#: Keys are matched as substrings of the device name (torch.cuda.get_device_name, the name NVML reports),
#: in this order: the more specific name first ("H100 PCIe" before "H100", "L40S" before "L4").
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
)
# fmt: on


def peak_flops_for(device_name: str, dtype: str) -> float | None:
    """The table's peak for a device name and compute dtype, or None when the table does not know it."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"metrics.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {dtype!r}")
    for key, peaks in PEAK_FLOPS:
        if key in device_name:
            return peaks.get(dtype)
    return None


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """The table's peak for `device` (CUDA only; a CPU has no entry)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for(torch.cuda.get_device_name(device), dtype)


class FlopCounter:
    """FLOPs per step: given, or counted on the first step and then fixed."""

    def __init__(self, flops_per_step: float, count: bool) -> None:
        self.per_step = float(flops_per_step)
        self._pending = count and not flops_per_step  # a given number wins: nothing to count
        self._mode: Any = None

    @property
    def measuring(self) -> bool:
        return self._pending

    def begin(self) -> None:
        """Enter torch's FlopCounterMode for this step (it counts and runs every op unchanged)."""
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def end(self) -> None:
        """Leave the mode; the step's count becomes the FLOPs of every step."""
        mode, self._mode = self._mode, None
        self._pending = False
        if mode is not None:
            mode.__exit__(None, None, None)
            self.per_step = float(mode.get_total_flops())
