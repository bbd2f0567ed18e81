"""Resources: host and device memory running out."""

from __future__ import annotations

from rankscope.mixin.config import Tunables, effect
from rankscope.mixin.promql import (
    DEVICE_MEMORY_OVER,
    DEVICE_MEMORY_RATIO,
    HOST_MEMORY_NODE_MAX,
    NODE,
    ONE_PER_NODE,
    RANK,
    metric_name,
    num,
    present_ratio,
)
from rankscope.mixin.rules import RANK_TEXT, Alert

#: Present only while a rank is over the line (rankscope.mixin.rules: the global server reads their fresh samples).
TRANSIENT = (DEVICE_MEMORY_OVER,)


def shard_records(t: Tunables) -> list[dict[str, str]]:
    """The ranks over the device-memory line, on the sharded layout's shards: the global server reads those only."""
    return [{"record": DEVICE_MEMORY_OVER, "expr": f"{DEVICE_MEMORY_RATIO} > {num(t.device_memory_ratio)}"}]


def records(t: Tunables) -> list[dict[str, str]]:
    """Each node's highest host memory use and each rank's device memory share, where the node's series are: the
    alerts compare them with their lines."""
    device = metric_name("device_memory_bytes")
    return [
        # The host's memory in use (psutil), the same on every rank of a node: one rank per node reads it.
        {
            "record": HOST_MEMORY_NODE_MAX,
            "expr": f"max by ({NODE}) ({metric_name('host_memory_used_ratio')}{ONE_PER_NODE})",
        },
        {
            "record": DEVICE_MEMORY_RATIO,
            "expr": present_ratio(
                f'max by ({RANK}) ({device}{{kind="{t.device_memory_kind}"}})',
                f'max by ({RANK}) ({device}{{kind="total"}})',
            ),
        },
    ]


def alerts(t: Tunables) -> list[Alert]:
    memory, memory_said = effect(t.memory_action)
    return [
        Alert(
            "RankscopeHostMemoryHigh",
            f"{HOST_MEMORY_NODE_MAX} > {num(t.host_memory_ratio)}",
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
            DEVICE_MEMORY_OVER,
            t.device_memory_for,
            t.device_memory_severity,
            f"A rank's accelerator memory is nearly full; {memory}.",
            f"Device memory ({t.device_memory_kind}) of {RANK_TEXT} is {{{{ $value | humanizePercentage }}}} of total "
            f"(threshold {t.device_memory_ratio:.0%}) for {t.device_memory_for}. An out-of-memory error is close; "
            f"{memory_said}.",
            t.memory_action,
        ),
    ]
