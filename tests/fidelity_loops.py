"""Training loops written as users write them, run twice: without rankscope and with every probe on.

Shared by tests/test_fidelity.py (one process) and tests/jobs/fidelity_job.py (2 ranks under torchrun).
Each archetype builds a model, an optimizer and its batches from a seed; `train()` runs the same loop
either plainly (torch's own clipping, no monitor at all) or monitored (module norms and update ratios at
every step, values resolved every step, the non-finite guard, `Monitor.clip_grad_norm_`, the comm hook),
and returns what a bit-identity check compares: every loss, every total gradient norm, the final
parameters.

Clipping is active in every archetype (max_norm far below the gradients' norm), so a total norm that
differs in its last bit changes the clip coefficient and with it every later step.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from rankscope import Monitor, MonitorConfig, RankIdentity
from torch import nn

MAX_NORM = 0.05


@dataclass
class Setup:
    """What one archetype trains: the model, its optimizer, and how to compute a step's loss."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    """(model being trained, step, micro-batch) -> loss."""
    scaler: Any = None
    accumulation: int = 1
    lr_at: Callable[[int], float] | None = None
    """A hand-written LR function the loop writes into every param group at the top of each step."""


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    monitor_errors: float = 0.0
    """Failures the monitor counted (rankscope_monitor_errors_total, all probes): a fallback would hide them."""
    shared_clip: bool = False
    """Whether the clip and the module norms shared their norms (the path whose exactness is at stake)."""
    module_norms: dict[str, float] = field(default_factory=dict)
    """The last step's per-module gradient norms (rankscope_module_grad_norm), by module group."""
    recorded_norm: float | None = None
    """The last step's total gradient norm as the monitor recorded it (rankscope_grad_norm)."""

    def bits(self) -> tuple[list[bytes], list[bytes]]:
        """Losses and norms as their exact float64 bit patterns (NaN compares equal to the same NaN)."""
        return [struct.pack("<d", v) for v in self.losses], [struct.pack("<d", v) for v in self.norms]


def _mlp_with_frozen_layer_and_two_groups() -> Setup:
    # The example: torch's total norm and a per-group sum of squares differ in the last bit.
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(
        [{"params": model[2].parameters(), "lr": 0.05}, {"params": model[4].parameters(), "lr": 0.02}], momentum=0.9
    )
    inputs = torch.randn(16, 16, 8)
    targets = torch.randn(16, 16, 1)

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        return (m(inputs[step % 16]) - targets[step % 16]).pow(2).mean() * 40

    return Setup(model, optimizer, loss)


def _gpt2_with_tied_embeddings() -> Setup:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2)  # dropout 0.1: uses the RNG
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as GPT-2 is by default
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    tokens = torch.randint(0, 97, (16, 4, 24))

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        batch = tokens[step % 16]
        return m(input_ids=batch, labels=batch).loss

    return Setup(model, optimizer, loss)


class _Branchy(nn.Module):
    """A branch used on even steps only: its parameters get no gradient on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.even = nn.Linear(16, 1)
        self.odd = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        hidden = torch.relu(self.trunk(x))
        return (self.even if step % 2 == 0 else self.odd)(hidden) * self.scale


def _parameters_without_gradients_on_some_steps() -> Setup:
    model = _Branchy()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    inputs = torch.randn(8, 12, 6)

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        return m(inputs[step % 8], step).pow(2).mean() * 30

    return Setup(model, optimizer, loss)


def _three_param_groups_with_their_own_lr_and_decay() -> Setup:
    model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 6, 24), nn.GELU(), nn.Linear(24, 4))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith("0.")]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "lr": 2e-3, "weight_decay": 0.1},
            {"params": no_decay, "lr": 1e-3, "weight_decay": 0.0},
            {"params": [model[0].weight], "lr": 5e-3, "weight_decay": 0.01},
        ]
    )
    tokens = torch.randint(0, 50, (8, 10, 6))
    labels = torch.randint(0, 4, (8, 10))

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        return nn.functional.cross_entropy(m(tokens[step % 8]), labels[step % 8]) * 20

    return Setup(model, optimizer, loss)


def _bf16_parameters_beside_fp32() -> Setup:
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32).to(torch.bfloat16), nn.ReLU(), nn.Linear(32, 2)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs = torch.randn(8, 16, 8)

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        hidden = m[1](m[0](inputs[step % 8]))
        hidden = m[3](m[2](hidden.to(torch.bfloat16))).float()
        return m[4](hidden).pow(2).mean() * 50

    return Setup(model, optimizer, loss)


def _grad_scaler_with_overflows() -> Setup:
    # A huge initial scale and a short growth interval: the first steps overflow and are skipped, later
    # ones grow the scale back into overflow, as dynamic loss scaling does in fp16 training.
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126, growth_interval=3)
    inputs = torch.randn(8, 16, 8)

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        return m(inputs[step % 8]).pow(2).mean() * 10

    return Setup(model, optimizer, loss, scaler=scaler)


def _gpt_style_accumulation_with_a_hand_written_lr() -> Setup:
    model = nn.Sequential(nn.Embedding(40, 16), nn.Flatten(), nn.Linear(16 * 5, 40))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.05)
    tokens = torch.randint(0, 40, (8, 3, 8, 5))
    labels = torch.randint(0, 40, (8, 3, 8))

    def lr_at(step: int) -> float:
        warmup, total = 4, 40
        if step < warmup:
            return 3e-3 * (step + 1) / warmup
        return 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        return nn.functional.cross_entropy(m(tokens[step % 8, micro]), labels[step % 8, micro]) * 10 / 3

    return Setup(model, optimizer, loss, accumulation=3, lr_at=lr_at)


def _mlp_for_tensor_parallel() -> Setup:
    # Split column- then row-wise over the tensor-parallel mesh (tests/jobs/fidelity_job.py), the head too.
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs = torch.randn(8, 16, 8)

    def loss(m: nn.Module, step: int, micro: int) -> torch.Tensor:
        return m(inputs[step % 8]).pow(2).mean() * 40

    return Setup(model, optimizer, loss)


ARCHETYPES: dict[str, Callable[[], Setup]] = {
    "mlp_frozen_two_groups": _mlp_with_frozen_layer_and_two_groups,
    "gpt2_tied_embeddings": _gpt2_with_tied_embeddings,
    "no_gradient_on_some_steps": _parameters_without_gradients_on_some_steps,
    "three_param_groups": _three_param_groups_with_their_own_lr_and_decay,
    "bf16_beside_fp32": _bf16_parameters_beside_fp32,
    "grad_scaler_overflows": _grad_scaler_with_overflows,
    "accumulation_hand_written_lr": _gpt_style_accumulation_with_a_hand_written_lr,
    "tensor_parallel_mlp": _mlp_for_tensor_parallel,
}

#: Every optional probe on, at every step.
EVERYTHING_ON = {
    "base_port": 0,
    "probes": (),
    "module_stats_every_n_steps": 1,
    "resolve_every_n_steps": 1,
    "skip_nonfinite": True,
    "step_peak_memory": True,  # nothing on CPU, which has no device memory; here for a run on CUDA
}


def monitor_for(rank: int = 0, world_size: int = 1, **config: Any) -> Monitor:
    identity = RankIdentity("fidelity", rank=rank, local_rank=rank, world_size=world_size, node="test")
    return Monitor(MonitorConfig(**{**EVERYTHING_ON, **config}), identity, device="cpu")


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module) -> Any:
    """The same optimizer over the model's parameters after sharding replaced them (fully_shard and
    parallelize_module swap each parameter for a DTensor one): same groups, same hyper-parameters."""
    now = dict(model.named_parameters(remove_duplicate=False))
    groups = [{**group, "params": [now[names[id(p)]] for p in group["params"]]} for group in optimizer.param_groups]
    return type(optimizer)(groups)  # each group carries every hyper-parameter


def train(
    archetype: str,
    monitored: bool,
    steps: int = 12,
    seed: int = 0,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    rank: int = 0,
    world_size: int = 1,
    accumulation: int | None = None,
    shard: Callable[[nn.Module], Any] | None = None,
    compiled: bool = False,
) -> Trace:
    """Train `archetype` for `steps` optimizer steps; `wrap` puts the model under DDP (the loop then
    accumulates with no_sync on every micro-batch but the last); `shard` shards it in place instead
    (FSDP2, tensor parallel: the optimizer is rebuilt over the sharded parameters, and accumulation
    turns gradient synchronisation off on every micro-batch but the last where the model allows it);
    `accumulation` overrides the archetype's number of micro-batches per step; `compiled` trains
    `torch.compile(model, fullgraph=True)` (a graph break, the monitor's or anyone's, raises)."""
    torch.manual_seed(seed)
    setup = ARCHETYPES[archetype]()
    if accumulation is not None:
        setup.accumulation = accumulation
    if shard is not None:
        names = {id(p): n for n, p in setup.model.named_parameters(remove_duplicate=False)}
        shard(setup.model)
        setup.optimizer = _rebuild_optimizer(setup.optimizer, names, setup.model)
    torch.manual_seed(seed + 1 + rank)  # the data-dependent randomness of training (dropout) per rank
    model = wrap(setup.model) if wrap is not None else setup.model
    if compiled:
        model = torch.compile(model, fullgraph=True)
    monitor = monitor_for(rank, world_size) if monitored else None
    if monitor is not None:
        monitor.watch(model, setup.optimizer, scaler=setup.scaler)
        if wrap is not None:
            monitor.attach_comm_hook(model)
    trace = Trace()
    try:
        for step in range(steps):
            if setup.lr_at is not None:
                for group in setup.optimizer.param_groups:
                    group["lr"] = setup.lr_at(step)
            with monitor.step(max_seq_len=step + 1) if monitor is not None else _plain_step() as context:
                loss = _forward_backward(setup, model, step, wrap is not None or shard is not None)
                if setup.scaler is not None:
                    setup.scaler.unscale_(setup.optimizer)
                params = model.parameters()
                if monitor is not None:
                    norm = monitor.clip_grad_norm_(params, MAX_NORM)
                    apply = context.record(loss=loss, grad_norm=norm)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
                    apply = True
                if apply:
                    if setup.scaler is not None:
                        setup.scaler.step(setup.optimizer)
                    else:
                        setup.optimizer.step()
                if setup.scaler is not None:
                    setup.scaler.update()
                setup.optimizer.zero_grad(set_to_none=True)
            trace.losses.append(float(_whole(loss.detach())))
            trace.norms.append(float(_whole(norm)))
    finally:
        if monitor is not None:
            errors = [
                sample.value
                for family in monitor.registry.collect()
                if family.name == "rankscope_monitor_errors"
                for sample in family.samples
                if sample.name == "rankscope_monitor_errors_total"
            ]
            trace.monitor_errors = sum(errors)
            trace.shared_clip = monitor._modules is not None and monitor._modules._sharing_exact
            trace.shared_clip = trace.shared_clip and monitor._modules._sharing_checked
            monitor.flush()
            trace.module_norms = {
                sample.labels["module"]: sample.value
                for family in monitor.registry.collect()
                if family.name == "rankscope_module_grad_norm"
                for sample in family.samples
            }
            trace.recorded_norm = monitor.registry.get_sample_value("rankscope_grad_norm", monitor.identity.labels())
            monitor.close()
    trace.params = [_whole(p.detach()).clone() for p in model.parameters()]
    return trace


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls this at the same point); a tensor itself."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _forward_backward(setup: Setup, model: nn.Module, step: int, distributed: bool) -> torch.Tensor:
    """All micro-batches of one step; under DDP every one but the last inside no_sync (no all-reduce), under
    FSDP2 with gradient synchronisation off (no reduce-scatter)."""
    total = None
    for micro in range(setup.accumulation):
        last = micro == setup.accumulation - 1
        set_sync = getattr(model, "set_requires_gradient_sync", None)
        if distributed and callable(set_sync):
            set_sync(last)
        sync = contextlib.nullcontext() if last or not distributed or set_sync else model.no_sync()
        with sync:
            loss = setup.loss(model, step, micro) / setup.accumulation
            (setup.scaler.scale(loss) if setup.scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


@contextlib.contextmanager
def _plain_step() -> Iterator[None]:
    yield None


def differences(plain: Trace, monitored: Trace) -> list[str]:
    """Where two traces differ, bit for bit (empty when identical)."""
    found = []
    (plain_losses, plain_norms), (mon_losses, mon_norms) = plain.bits(), monitored.bits()
    for what, a, b, values in (
        ("loss", plain_losses, mon_losses, (plain.losses, monitored.losses)),
        ("norm", plain_norms, mon_norms, (plain.norms, monitored.norms)),
    ):
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                found.append(f"{what} differs first at step {step + 1}: {values[0][step]!r} vs {values[1][step]!r}")
                break
    for index, (p, q) in enumerate(zip(plain.params, monitored.params, strict=True)):
        if not torch.equal(p, q):
            found.append(f"final parameter {index} {tuple(p.shape)} differs")
            break
    return found
