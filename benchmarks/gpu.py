"""Benchmark 5: the GPU facts in one command (one CUDA device, a few minutes; at most 8).

    .venv/bin/python -m benchmarks.gpu                 # prints "no CUDA device" and exits 0 where there is none
    .venv/bin/python -m benchmarks.gpu --batch 4 --seq 512 --groups 6

What it measures, on CUDA device 0:

1. **Step-time ratio.** GPT-2 small built from its `transformers` config (`GPT2Config()`: 12
   layers, 768 wide, 124 M parameters, nothing downloaded), `--batch` x `--seq` random tokens,
   bf16 autocast (float16 with a GradScaler where the GPU has no bf16), AdamW, gradient
   clipping, DDP on a one-rank NCCL group. Two copies from the same seed train side by side on
   the same batches: without monitoring, and with the rankscope monitor at `MonitorConfig()`
   defaults (its comm hook on the DDP model, its /metrics endpoint served, loss and gradient
   norm recorded as device tensors). Blocks of `--block` steps in a fresh random order per group
   (group 0 warms up); each block's time ends with `torch.cuda.synchronize()`, so it is the
   device's time too. Prints the median step and the median (min..max) of per-group ratios.
2. **The comm hook's timing with NCCL.** The monitor's `rankscope_comm_duration_seconds` (CUDA
   events on the stream, read after the monitor's batched sync) against a bare NCCL
   `all_reduce` of the same number of gradient bytes timed with CUDA events. With one rank
   NCCL's all-reduce is a local pass over the buffer: this checks the hook's plumbing and its
   cost, not a network.
3. **The NVML series on the page.** The monitored rank's /metrics page, fetched over HTTP as
   Prometheus would: `rankscope_gpu_utilization_ratio`, `rankscope_gpu_power_watts`,
   `rankscope_gpu_temperature_celsius` and `rankscope_device_memory_bytes{kind}`, with a check
   that each is there and in range.
4. **No host-device sync per step.** Runs `python -m pytest tests/test_cuda_sync.py`:
   instrumented steps under `torch.cuda.set_sync_debug_mode("error")`.

Exit status 1 if a check (3 or 4) fails. The numbers of a GPU machine belong in
benchmarks/README.md, section 5.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .timing import machine_line, paired_ratios, ratio_line

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent


def _process_group(device: torch.device) -> None:
    """A one-rank NCCL group through a file store (no port), as DDP on a GPU needs one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    handle, path = tempfile.mkstemp(prefix="rankscope-gpu-store-")
    os.close(handle)
    os.unlink(path)  # FileStore creates it
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)


class Trained:
    """One copy of the model, its optimizer and (for the monitored copy) the monitor, one step at a time."""

    def __init__(self, device: torch.device, dtype: torch.dtype, monitored: bool) -> None:
        from rankscope import Monitor, MonitorConfig, RankIdentity
        from torch.nn.parallel import DistributedDataParallel
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)  # both copies start from the same weights
        self.model = DistributedDataParallel(GPT2LMHeadModel(GPT2Config()).to(device), device_ids=[device.index])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.dtype = dtype
        self.scaler = torch.amp.GradScaler("cuda", enabled=dtype is torch.float16)
        self.monitor = None
        if monitored:
            identity = RankIdentity("gpu-bench", 0, 0, 1, os.uname().nodename)
            self.monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0), identity, device=device)
            self.monitor.start()
            self.monitor.watch(self.model, self.optimizer, scaler=self.scaler if self.scaler.is_enabled() else None)
            self.monitor.attach_comm_hook(self.model)

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def step(self, tokens: torch.Tensor) -> None:
        if self.monitor is None:
            self._update(tokens, lambda: torch.nn.utils.clip_grad_norm_(self.parameters, 1.0), None)
            return
        with self.monitor.step(samples=tokens.shape[0], tokens=tokens.numel()) as context:
            self._update(tokens, lambda: self.monitor.clip_grad_norm_(self.parameters, 1.0), context)

    def _update(self, tokens: torch.Tensor, clip: Callable[[], torch.Tensor], context: Any | None) -> None:
        with torch.autocast("cuda", dtype=self.dtype):
            loss = self.model(input_ids=tokens, labels=tokens).loss
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = clip()
        if context is not None:
            context.record(loss=loss, grad_norm=norm)  # device tensors: read in the monitor's batched transfer
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def measure_steps(copies: dict[str, Trained], batches: list[torch.Tensor], groups: int, block: int) -> dict:
    """Blocks of `block` steps of each copy in a fresh random order per group; group 0 warms up."""
    shuffler = random.Random(0)
    walls: dict[str, list[float]] = {name: [] for name in copies}
    position = 0
    for group in range(groups + 1):
        order = list(copies)
        shuffler.shuffle(order)
        for name in order:
            torch.cuda.synchronize()
            started = time.perf_counter()
            for index in range(block):
                copies[name].step(batches[(position + index) % len(batches)])
            torch.cuda.synchronize()  # the block's time is the device's too
            if group > 0:
                walls[name].append((time.perf_counter() - started) / block)
        position += block
    return walls


def _comm_per_step(monitor: Any) -> tuple[float, float]:
    """(mean seconds per step, steps) of an exporter.Monitor's all-reduce histogram, after its batched read."""
    monitor.flush()
    labels = monitor.identity.labels()
    total = monitor.registry.get_sample_value("rankscope_comm_duration_seconds_sum", labels) or 0.0
    count = monitor.registry.get_sample_value("rankscope_comm_duration_seconds_count", labels) or 0.0
    return (total / count if count else float("nan")), count


def bare_all_reduce(numel: int, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of one NCCL all_reduce of `numel` float32 values, timed with CUDA events."""
    import torch.distributed as dist

    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(buffer)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[2:])


#: The GPU series of the page, and the range each value must be in.
GPU_SERIES = {
    "rankscope_gpu_utilization_ratio": (0.0, 1.0),
    "rankscope_gpu_power_watts": (0.0, 5000.0),
    "rankscope_gpu_temperature_celsius": (1.0, 130.0),
}
DEVICE_MEMORY_KINDS = ("allocated", "reserved", "peak", "total")


def check_page(port: int) -> list[str]:
    """The NVML and device-memory series on the monitor's page: printed, and problems returned."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        page = answer.read().decode()
    found = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in GPU_SERIES:
                found[sample.name] = sample.value
            elif sample.name == "rankscope_device_memory_bytes":
                found[f"{sample.name}{{kind={sample.labels.get('kind')}}}"] = sample.value
    problems = []
    for name, (low, high) in GPU_SERIES.items():
        value = found.get(name)
        print(f"   {name:<52} {value!r}")
        if value is None or not low <= value <= high:
            problems.append(f"{name} is {value!r}, expected {low:g}..{high:g}")
    for kind in DEVICE_MEMORY_KINDS:
        name = f"rankscope_device_memory_bytes{{kind={kind}}}"
        value = found.get(name)
        print(f"   {name:<52} {value!r}" + (f" ({value / 2**30:.2f} GiB)" if value else ""))
        if value is None or value <= 0:
            problems.append(f"{name} is {value!r}, expected a positive number of bytes")
    return problems


def run_sync_check(timeout: float) -> tuple[bool, str]:
    """`python -m pytest tests/test_cuda_sync.py` in a child process: (passed, its last lines)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda_sync.py"]
    try:
        result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f}s"
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-3:])
    # A skip means no CUDA in the child: on this path there is one, so that is a failure too.
    return result.returncode == 0 and "skipped" not in tail, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (GPT-2's context is 1024)")
    parser.add_argument("--groups", type=int, default=8, help="measured groups of blocks (one more warms up)")
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--sync-timeout", type=float, default=300.0, help="seconds for tests/test_cuda_sync.py")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    if min(args.batch, args.seq, args.groups, args.block) < 1 or args.seq > 1024:
        parser.error("--batch, --groups and --block must be >= 1 and --seq between 1 and 1024")
    warnings.filterwarnings("ignore", category=UserWarning)
    device = torch.device("cuda", 0)
    print(machine_line())
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    _process_group(device)
    copies = {name: Trained(device, dtype, monitored=name != "none") for name in ("none", "rankscope default")}
    failures: list[str] = []
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        batches = [
            torch.randint(0, 50257, (args.batch, args.seq), device=device, generator=generator) for _ in range(4)
        ]
        params = sum(p.numel() for p in copies["none"].parameters)
        print(f"\n1. step time: GPT-2 small ({params / 1e6:.0f} M parameters), batch {args.batch} x {args.seq} tokens, "
              f"{str(dtype).removeprefix('torch.')} autocast, AdamW, clipping, DDP on one NCCL rank; "
              f"{args.groups} groups of {args.block}-step blocks")  # fmt: skip
        walls = measure_steps(copies, batches, args.groups, args.block)
        ratios = paired_ratios(walls["rankscope default"], walls["none"])
        for name, times in walls.items():
            print(f"   {name:<18} {statistics.median(times) * 1e3:8.2f} ms/step (median over groups)")
        print(f"   ratio rankscope default / none: {ratio_line(ratios)}")

        monitor = copies["rankscope default"].monitor
        assert monitor is not None and monitor.port is not None
        comm, steps = _comm_per_step(monitor)
        bare = bare_all_reduce(params, device)
        print("\n2. comm hook with NCCL (one rank: a local pass over the gradient buffer)")
        print(f"   rankscope_comm_duration_seconds: {comm * 1e3:.3f} ms per step (mean of {steps:.0f} steps)")
        print(f"   bare NCCL all_reduce of the same {params * 4 / 2**20:.0f} MiB (CUDA events): {bare * 1e3:.3f} ms")

        print("\n3. NVML and device-memory series on the monitored rank's /metrics page")
        failures += check_page(monitor.port)
    finally:
        for trained in copies.values():
            trained.close()
        import torch.distributed as dist

        dist.destroy_process_group()
    print("\n4. no host-device sync per instrumented step: python -m pytest tests/test_cuda_sync.py")
    passed, tail = run_sync_check(args.sync_timeout)
    print("   " + tail.replace("\n", "\n   "))
    if not passed:
        failures.append("tests/test_cuda_sync.py did not pass")
    print(f"\n{'all checks passed' if not failures else 'FAILED: ' + '; '.join(failures)}")
    print(machine_line())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
