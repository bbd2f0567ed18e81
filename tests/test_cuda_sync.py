"""No host-device synchronisation added per step, proven on a GPU with torch's sync debug mode.

Under `torch.cuda.set_sync_debug_mode("error")` every synchronising CUDA call raises. Instrumented
steps run with every per-step probe on (module norms, update ratios, the non-finite flags, the loss
scale, clipping through the monitor, the control channel's step boundary) and values resolved only
at the end, as `resolve_every_n_steps` does between its batched reads: nothing may synchronise.
The loop's own synchronisation, `GradScaler.step` reading whether gradients overflowed, runs
outside the mode: it is the loop's, not rankscope's. The first step runs outside the mode too, as
the monitor checks its clip against torch's once per run (one read of a scalar).

On a machine without CUDA the test is skipped, saying so; `python -m pytest tests/test_cuda_sync.py`
on a GPU machine is the one command that proves it (the device check in benchmarks/gpu.py runs it).
"""

from __future__ import annotations

import pytest
import torch
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope.control import ControlChannel, ControlConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the sync check needs a GPU")


def _gpt2(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def test_instrumented_fp16_steps_do_not_synchronise_host_and_device():
    device = torch.device("cuda", 0)
    model, optimizer = _gpt2(device)
    scaler = torch.amp.GradScaler("cuda")
    config = MonitorConfig(base_port=0, probes=(), resolve_every_n_steps=10_000, module_stats_every_n_steps=1)
    monitor = Monitor(config, RankIdentity("sync", 0, 0, 1, "gpu"), device=device)
    monitor.watch(model, optimizer, scaler=scaler)
    channel = ControlChannel(ControlConfig(endpoint=False, handle_signals=False), monitor, optimizer=optimizer)
    tokens = torch.randint(0, 256, (8, 64), device=device)

    class Loop:
        def checkpoint(self, reason: str) -> bool:
            return True

        def request_stop(self, reason: str) -> None:
            pass

    def step() -> None:
        with monitor.step(samples=8, tokens=8 * 64) as context:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_ids=tokens, labels=tokens).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = monitor.clip_grad_norm_(model.parameters(), 1.0)
            context.record(loss=loss, grad_norm=norm)
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("default")  # GradScaler.step reads found_inf: the loop's own sync
            scaler.step(optimizer)
            torch.cuda.set_sync_debug_mode(mode)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        channel.at_step_boundary(context.index, Loop())

    step()  # the once-per-run check of the clip, and lazy CUDA initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monitor.flush()  # the batched read, outside the measured steps
    labels = monitor.identity.labels()
    assert monitor.registry.get_sample_value("rankscope_steps_total", labels) == 11
    assert monitor.registry.get_sample_value("rankscope_loss", {**labels, "split": "train"}) is not None
    assert monitor.registry.get_sample_value("rankscope_monitor_errors_total", {**labels, "probe": "module_stats"}) in (
        None,
        0.0,
    )
    channel.close()
    monitor.close()
