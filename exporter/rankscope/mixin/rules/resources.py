"""Resources: host and device memory running out."""

from __future__ import annotations

from rankscope.mixin.config import Tunables, effect
from rankscope.mixin.promql import NODE, RANK, metric_name, num
from rankscope.mixin.rules import RANK_TEXT, Alert


def records(t: Tunables) -> list[dict[str, str]]:
    return []


def alerts(t: Tunables) -> list[Alert]:
    memory, memory_said = effect(t.memory_action)
    return [
        Alert(
            "RankscopeHostMemoryHigh",
            f"max by ({NODE}) ({metric_name('host_memory_used_ratio')}) > {num(t.host_memory_ratio)}",
            t.host_memory_for,
            t.host_memory_severity,
            f"Host memory of a training node is nearly exhausted; {memory}.",
            "Node {{ $labels.node }} of run {{ $labels.run_id }} uses {{ $value | humanizePercentage }} of its "
            f"memory (threshold {t.host_memory_ratio:.0%}) for {t.host_memory_for}. The ranks on this node may be "
            f"OOM-killed; {memory_said}.",
            t.memory_action,
        ),
        Alert(
            "RankscopeDeviceMemoryHigh",
            f'max by ({RANK}) ({metric_name("device_memory_bytes")}{{kind="{t.device_memory_kind}"}})\n'
            f"/\n"
            f'(max by ({RANK}) ({metric_name("device_memory_bytes")}{{kind="total"}}) > 0)\n'
            f"> {num(t.device_memory_ratio)}",
            t.device_memory_for,
            t.device_memory_severity,
            f"A rank's accelerator memory is nearly full; {memory}.",
            f"Device memory ({t.device_memory_kind}) of {RANK_TEXT} is {{{{ $value | humanizePercentage }}}} of total "
            f"(threshold {t.device_memory_ratio:.0%}) for {t.device_memory_for}. An out-of-memory error is close; "
            f"{memory_said}.",
            t.memory_action,
        ),
    ]
