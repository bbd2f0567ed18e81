"""Communication time from a DDP comm hook wrapped around the real all-reduce.

Under DDP the all-reduce waits for the slowest rank, so this is where a fast
rank's waiting for a straggler shows up. The hook runs DDP's own default
all-reduce (`allreduce_hook`: sum, then divide by world size), so training
numerics are unchanged; it only notes when each bucket's reduction starts and
finishes.

Host timing (gloo, CPU): the future completes on gloo's thread when the
reduction is done, so perf_counter at completion is the true end.
CUDA timing (NCCL): futures complete when the kernel is enqueued, so the hook
records CUDA events on the stream instead and they are read lazily, after the
monitor's batched sync, never in the step.
"""

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

__all__ = ["CommTimer", "interval_union"]


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals.

    Buckets may be reduced concurrently; counting overlap twice would report
    more communication time than wall time.
    """
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start  # type: ignore[operator]
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start  # type: ignore[operator]
    return total


class CommTimer:
    """Collects the all-reduce intervals of the current step.

    Written from DDP's reducer/autograd threads (and gloo's completion
    thread), read by the training thread at the step boundary: hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._host: list[tuple[float, float]] = []
        self._events: list[tuple[Any, Any]] = []
        self.attached = False

    def hook(self, process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook: `ddp_model.register_comm_hook(None, timer.hook)`.

        The annotations are real objects on purpose (no postponed evaluation in
        this module): DDP checks them against dist.GradBucket and Future[Tensor].
        """
        on_cuda = bucket.buffer().is_cuda
        if on_cuda:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        future = allreduce_hook(process_group, bucket)

        def _done(fut: torch.futures.Future) -> torch.Tensor:
            if on_cuda:
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
                with self._lock:
                    self._events.append((start_event, end_event))
            else:
                end = time.perf_counter()
                with self._lock:
                    self._host.append((start, end))
            return fut.value()

        return future.then(_done)

    def take_step(self) -> tuple[float, list[tuple[Any, Any]]]:
        """Host seconds of this step (overlap counted once) and its CUDA event pairs."""
        with self._lock:
            host, self._host = self._host, []
            events, self._events = self._events, []
        return interval_union(host), events


def events_seconds(events: list[tuple[Any, Any]]) -> float | None:
    """Seconds covered by CUDA event pairs, or None if one has not completed yet."""
    total = 0.0
    for start, end in events:
        if not end.query():
            return None
        total += start.elapsed_time(end) / 1000.0
    return total
