"""Settings of the control endpoint and of the actions it may take, checked when built."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rankscope._checks import check_range
from rankscope.config import check_host, check_port

__all__ = ["ControlConfig", "load_token"]

DEFAULT_TOKEN_ENV = "RANKSCOPE_CONTROL_TOKEN"


@dataclass
class ControlConfig:
    """How the control channel behaves. Every rank must be given the same settings."""

    enabled: bool = True
    """False: the channel does nothing (no server, no collectives, no signal handling) and the loop runs unchanged."""
    endpoint: bool = True
    """Serve the HTTP endpoint on rank 0. False: no endpoint and no token needed; the ranks still meet at
    step boundaries, so SIGTERM/SIGINT and a lost torchrun agent still stop every rank at the same step."""
    handle_signals: bool = True
    """SIGTERM and SIGINT (on any rank) mean "checkpoint, then stop" at the next step boundary on every
    rank (a second SIGINT interrupts at once). Installed when the channel is built on the main thread."""
    stop_grace_seconds: float = 10.0
    """After SIGTERM, seconds this rank waits for the stop to reach a step boundary. A rank that is hung, or
    waits on a peer that is, never gets there: it then writes its stacks and phase (to state_dir), the goodput
    ledger and one line saying why it did not checkpoint, and exits with status 143, before the launcher's
    SIGKILL (torchrun's comes 30 s after the signal). 0: wait for the boundary however long it takes. Keep it
    above the time between two control rounds (check_every_n_steps steps); a checkpoint or validation under
    way is waited for, and a loop that has left (monitor.finish(), channel.finish()) is not ended."""
    stop_when_orphaned: bool = True
    """Under torchrun, a rank whose agent process is gone checkpoints and stops instead of training on."""
    host: str = "127.0.0.1"
    """Address rank 0's control endpoint binds to. Loopback by default: the endpoint changes the run."""
    port: int = 9300
    """Port of the control endpoint (rank 0 only). 0 picks a free port (tests)."""
    token_file: str = ""
    """File holding the bearer token (surrounding whitespace ignored). Wins over token_env."""
    token_env: str = DEFAULT_TOKEN_ENV
    """Environment variable holding the bearer token, used when token_file is empty."""
    insecure: bool = False
    """Allow starting without any token (every request is then accepted). Only for trusted networks."""
    web_config_file: str = ""
    """exporter-toolkit web configuration file for the control endpoint (TLS, client certificates; the bearer
    token still guards every route but /healthz): see docs/security.md. Empty: $RANKSCOPE_CONTROL_WEB_CONFIG_FILE,
    else $RANKSCOPE_WEB_CONFIG_FILE, else plain HTTP."""
    max_body_bytes: int = 1_048_576
    """Larger request bodies are refused with 413 without being parsed."""
    max_pending: int = 64
    """Requests waiting for the next step boundary; beyond this, 503 (Alertmanager retries)."""
    recent_actions: int = 100
    """Settled actions kept for GET /v1/status."""
    check_every_n_steps: int = 1
    """Rank 0 broadcasts pending actions at every step divisible by N (all ranks agree on which)."""
    pause_heartbeat_seconds: float = 0.5
    """While paused, rank 0 re-broadcasts the state this often, so no collective waits long."""
    group_timeout_seconds: float = 0.0
    """Timeout of the control group's collectives; 0 keeps torch's default for gloo (30 minutes).
    It must exceed the longest checkpoint, which all ranks wait for before agreeing on the outcome."""
    lr_factor: float = 0.5
    """Default factor of `reduce_lr` (a request may give its own `lr_factor`)."""
    lr_restore_after_steps: int = 0
    """Default `restore_after_steps` of `reduce_lr`: the rates return to what they were this many steps after
    the reduction (0 = the reduction lasts the rest of the run). The rule pack's non-finite alert gives its own
    (`nonfinite_lr_restore_steps`)."""
    lr_floor: float = 0.0
    """`reduce_lr` never takes a learning rate below this (absolute); at the floor it is refused."""
    lr_floor_ratio: float = 1e-3
    """Nor below this fraction of the group's reference rate (its scheduler's initial rate, or the
    highest rate the optimizer has stepped with), so that no factor can bring a rate to zero."""
    lr_cooldown_steps: int = 0
    """Steps after an applied `reduce_lr` during which another is refused (0 = none)."""
    lr_cooldown_seconds: float = 60.0
    """Seconds after an applied `reduce_lr` during which another is refused (0 = none)."""
    lr_max_reductions: int = 5
    """At most this many applied `reduce_lr` per run (0 = no cap)."""
    checkpoint_cooldown_steps: int = 0
    """Steps after an applied `checkpoint` during which another is refused (0 = none)."""
    checkpoint_cooldown_seconds: float = 0.0
    """Seconds after an applied `checkpoint` during which another is refused (0 = none)."""

    rollback_margin_batches: int = 50
    """`rollback` skips the batches trained between its checkpoint and the incident, plus this many more
    (the data just after the incident is as suspect as the data before it)."""
    rollback_lookahead_batches: int = 10_000
    """After the window, a loop that can read its data ahead (the reference trainer) looks at the batches
    that follow with the restored model and skips on while they are bad (loss far above its validation
    loss), up to this many more batches (0: off): a bad stretch of data can outlast the alert and the
    rollback. About 2 log2(n) batches are read for a stretch of n, forward passes without gradients."""
    rollback_onset_window_steps: int = 32
    """A loop that keeps its step losses (the reference trainer) rolls back to the newest checkpoint written
    before the loss left its level, when that is later than the alert's lookback: the start of the excursion
    that lasts to now, where the median of this many steps' losses went over twice the highest loss of the
    first such window after the lookback (0: off, the
    newest checkpoint before the lookback). Never earlier than the lookback, never past a raised learning rate."""
    rollback_cooldown_steps: int = 0
    """Steps after an applied `rollback` during which another is refused, counted from the step it was applied
    at (0 = none; the run goes back in steps, so this holds until it trains past that step plus this many)."""
    rollback_cooldown_seconds: float = 300.0
    """Seconds after an applied `rollback` during which another is refused (0 = none)."""
    rollback_max: int = 3
    """At most this many applied `rollback` per run (0 = no cap)."""
    micro_batch_cooldown_steps: int = 0
    """Steps after an applied `reduce_micro_batch` during which another is refused (0 = none)."""
    micro_batch_cooldown_seconds: float = 60.0
    """Seconds after an applied `reduce_micro_batch` during which another is refused (0 = none)."""
    micro_batch_max_reductions: int = 3
    """At most this many applied `reduce_micro_batch` per run (0 = no cap)."""

    restart_cooldown_seconds: float = 600.0
    """Seconds after a `restart` (its exit) during which another is refused (0 = none); kept across the
    restart in state_dir."""
    restart_max: int = 3
    """At most this many applied `restart` per run (0 = no cap); torchrun's --max-restarts also bounds it."""
    state_dir: str = ""
    """Directory for what must outlive the process: a `restart` in flight (rankscope-restart.json) and the
    stacks it writes. Give the run's checkpoint directory; "" refuses `restart` (refused_unavailable)."""

    def __post_init__(self) -> None:
        check_host("control.host", self.host)
        check_port("control.port", self.port)
        minimums = {"max_body_bytes": 256, "max_pending": 1, "recent_actions": 1, "check_every_n_steps": 1,
                    "lr_cooldown_steps": 0, "lr_max_reductions": 0, "lr_restore_after_steps": 0,
                    "checkpoint_cooldown_steps": 0}  # fmt: skip
        for name, low in minimums.items():
            check_range(f"control.{name}", getattr(self, name), ge=low, integer=True)
        for name in ("rollback_margin_batches", "rollback_lookahead_batches", "rollback_onset_window_steps",
                     "rollback_cooldown_steps", "rollback_max",
                     "micro_batch_cooldown_steps", "micro_batch_max_reductions", "restart_max"):  # fmt: skip
            check_range(f"control.{name}", getattr(self, name), ge=0, integer=True)
        check_range("control.pause_heartbeat_seconds", self.pause_heartbeat_seconds, gt=0, le=10)
        check_range("control.lr_factor", self.lr_factor, gt=0, lt=1)
        check_range("control.lr_floor_ratio", self.lr_floor_ratio, gt=0, lt=1)
        for name in ("group_timeout_seconds", "lr_floor", "lr_cooldown_seconds", "checkpoint_cooldown_seconds",
                     "rollback_cooldown_seconds", "micro_batch_cooldown_seconds",
                     "restart_cooldown_seconds", "stop_grace_seconds"):  # fmt: skip
            check_range(f"control.{name}", getattr(self, name), ge=0)
        if self.token_env and not self.token_env.replace("_", "").isalnum():
            raise ValueError(f"control.token_env must be an environment variable name, got {self.token_env!r}")


def load_token(config: ControlConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token from `token_file`, else from `token_env`; None when neither gives one.

    A token file that is named but unreadable or empty is an error (a typo must
    not silently fall back to the environment, or to no token at all).
    """
    if config.token_file:
        try:
            with open(config.token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"control.token_file {config.token_file}: cannot read it ({reason})") from None
        if not token:
            raise ValueError(f"control.token_file {config.token_file} is empty")
        return _checked(token, f"control.token_file {config.token_file}")
    env = os.environ if env is None else env
    token = (env.get(config.token_env) or "").strip() if config.token_env else ""
    return _checked(token, f"environment variable {config.token_env}") if token else None


def _checked(token: str, where: str) -> str:
    # The token travels in an HTTP header: printable ASCII without spaces.
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"{where}: the token must be printable ASCII without spaces")
    return token
