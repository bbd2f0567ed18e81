"""Each step's peak device memory: the CUDA caching allocator's peak, reset as every step begins.

``torch.cuda.reset_peak_memory_stats`` and ``torch.cuda.max_memory_allocated`` read and reset the
allocator's own bookkeeping on the host: no kernel, no stream wait, no host-device sync. A CPU
device has no device memory: nothing is measured there and no series is exposed (a 0 would claim
a measurement that was not made; the host's memory is the probes' ``process_resident_memory_bytes``).
"""

from __future__ import annotations

import torch

__all__ = ["StepPeakMemory"]


class StepPeakMemory:
    """`begin()` as a step starts, `end()` as it completes: the bytes allocated at the step's peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = device.type == "cuda"
        """False on CPU (and any other device without a caching-allocator peak): begin and end do nothing."""

    def begin(self) -> None:
        if self.active:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self) -> float | None:
        """The step's peak in bytes, or None where there is no device memory to measure."""
        if not self.active:
            return None
        return float(torch.cuda.max_memory_allocated(self.device))
