"""The control channel: requests arrive on rank 0, every rank acts at the same step.

    channel = ControlChannel(config, monitor, optimizer=opt, scheduler=sched)  # all ranks
    for step in range(start, max_steps):
        train_step(...)
        channel.at_step_boundary(step + 1, handler)  # all ranks, every step
        if handler.stop_requested:
            break
    channel.close()

How the ranks stay in lockstep:

- Only rank 0 serves HTTP. A request is checked, queued and answered at once
  (202 with an id); nothing happens to the run on the HTTP thread.
- At every step divisible by `check_every_n_steps` (all ranks pass the same
  step, so all agree on which steps these are), rank 0 takes what is pending,
  refuses what a cooldown or cap forbids, and broadcasts the rest. Every rank
  applies the same list in the same order at the same step, then one small
  all-reduce tells rank 0 whether any rank failed. Every collective here is
  issued by every rank, so none can hang waiting for a rank that skipped it.
- Both collectives run on a dedicated gloo group with CPU tensors: no device
  synchronisation, even under NCCL.
- While paused, every rank loops at the boundary. Rank 0 re-broadcasts (an
  empty list, or whatever arrived) every `pause_heartbeat_seconds`, so no
  collective ever waits longer than that, however long the pause lasts, and
  the process group's timeout never trips.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from prometheus_client import CollectorRegistry

from ..contract import PREFIX
from ..identity import RankIdentity
from ..instruments import Instruments
from .app import AppDeps, create_app
from .collective import agree_on_worst, broadcast_json
from .config import ControlConfig, load_token
from .limits import ActionLimits
from .lr import can_reduce, current_learning_rates, scale_learning_rates
from .server import ControlServer, serve_control
from .state import ActionQueue, ActionRecord, RunSnapshot

__all__ = ["ControlChannel", "ControlHandler", "ControlStartError"]

logger = logging.getLogger("rankscope")

# Outcome codes agreed by MAX over ranks: the worst outcome on any rank wins.
_APPLIED, _NOOP, _FAILED = 0, 1, 2
_RESULT = {_APPLIED: "applied", _NOOP: "noop", _FAILED: "failed"}


class ControlHandler(Protocol):
    """What the training loop provides to carry out actions it alone knows how to do."""

    def checkpoint(self, reason: str) -> None:
        """Write a checkpoint now, recording `reason` ("alert:<alertname>", "operator:<reason>")."""

    def request_stop(self, reason: str) -> None:
        """Make the loop checkpoint and exit cleanly (status 0) after this step."""


class ControlStartError(RuntimeError):
    """The control endpoint could not start; raised on every rank alike."""


class ControlChannel:
    """Rank 0's control endpoint plus the step-boundary agreement of all ranks.

    Collective: every rank constructs it (after init_process_group, in the same
    order relative to other new_group calls) and calls `at_step_boundary` at
    every step with the same step number.
    """

    def __init__(
        self,
        config: ControlConfig | None,
        monitor: Any = None,
        optimizer: Any | None = None,
        scheduler: Any | None = None,
    ) -> None:
        self.config = config or ControlConfig()
        self._optimizer = optimizer
        self._scheduler = scheduler
        identity = getattr(monitor, "identity", None) or RankIdentity.from_env()
        # A NullMonitor has no registry: record into a private one nobody scrapes.
        self._instruments = getattr(monitor, "instruments", None) or Instruments(CollectorRegistry(), identity)
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self._distributed else identity.rank
        self.world_size = dist.get_world_size() if self._distributed else 1
        self.queue = ActionQueue(self.config.max_pending, self.config.recent_actions)
        self.snapshot = RunSnapshot()
        self._limits = ActionLimits.from_config(self.config)
        self._group: Any = None
        self._server: ControlServer | None = None
        self._paused = False
        self._stop_requested = False
        if not self.config.enabled:
            return
        self._instruments.child(PREFIX + "paused").set(0)
        if self._distributed:
            self._group = self._new_group()
        error = self._start_server(identity.run_id) if self.rank == 0 else ""
        self._agree_on_start(error)

    # --- public ------------------------------------------------------------------

    @property
    def url(self) -> str | None:
        """Base URL of the endpoint (rank 0 only; None elsewhere or when disabled)."""
        return self._server.url if self._server else None

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def at_step_boundary(self, step: int, handler: ControlHandler) -> list[str]:
        """Apply pending actions on every rank at `step`; returns the actions applied here.

        Every rank must call it after every step with the same `step`. Blocks
        while the run is paused.
        """
        if not self.config.enabled:
            return []
        if self.rank == 0:
            self.snapshot.update(step=step, learning_rates=current_learning_rates(self._optimizer))
        if step % self.config.check_every_n_steps:
            return []
        applied = self._exchange(step, handler)
        if self._paused:
            applied += self._hold(step, handler)
        return applied

    def close(self) -> None:
        """Stop serving (rank 0). Local: issues no collective. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.config.enabled:
            self._instruments.child(PREFIX + "paused").set(0)

    # --- start-up -------------------------------------------------------------------

    def _new_group(self) -> Any:
        # Created with the default (long) timeout so that slow start-up cannot trip it, then
        # shortened if configured; older torch without set_timeout takes it at creation.
        seconds = self.config.group_timeout_seconds
        if not seconds:
            return dist.new_group(backend="gloo")
        timeout = timedelta(seconds=seconds)
        if not hasattr(dist, "set_timeout"):
            return dist.new_group(backend="gloo", timeout=timeout)
        group = dist.new_group(backend="gloo")
        dist.set_timeout(timeout, group=group)
        return group

    def _start_server(self, run_id: str) -> str:
        """Start rank 0's endpoint; the error message, or "" on success."""
        try:
            token = load_token(self.config)
            if token is None and not self.config.insecure:
                return (
                    f"the control endpoint needs a bearer token: set control.token_file or the "
                    f"{self.config.token_env or 'RANKSCOPE_CONTROL_TOKEN'} environment variable "
                    "(or control.insecure: true on a trusted network)"
                )
            if token is None:
                logger.warning("rankscope: control endpoint started WITHOUT a token (control.insecure: true)")
            deps = AppDeps(
                self.queue,
                self.snapshot,
                token,
                run_id=run_id,
                world_size=self.world_size,
                max_body_bytes=self.config.max_body_bytes,
                count=self._count,
            )
            self._server = serve_control(create_app(deps), self.config.host, self.config.port)
        except (ValueError, OSError, RuntimeError) as exc:
            return str(exc)
        logger.info("rankscope: control endpoint at %s", self._server.url)
        return ""

    def _agree_on_start(self, error: str) -> None:
        # Rank 0 tells every rank whether it started, so a failure raises everywhere
        # instead of leaving the other ranks waiting in the first boundary broadcast.
        if self._distributed:
            error = broadcast_json(error or None, self._group, self.rank) or ""
        if error:
            raise ControlStartError(error if self.rank == 0 else f"control endpoint failed on rank 0: {error}")

    # --- the step boundary ------------------------------------------------------------

    def _exchange(self, step: int, handler: ControlHandler) -> list[str]:
        """One round: rank 0 decides, all ranks receive and apply, all agree on the outcome."""
        records = self._decide(step) if self.rank == 0 else []
        orders = [self._order(record) for record in records]
        if self._distributed:
            orders = broadcast_json(orders or None, self._group, self.rank) or []
        if not orders:
            return []
        outcomes = [self._apply(order, step, handler) for order in orders]
        codes = [code for code, _ in outcomes]
        agreed = agree_on_worst(codes, self._group) if self._distributed else codes
        if self.rank == 0:
            # Rank 0 broadcast `records` in this order, so index i of every list is the same action.
            for record, (code, detail), worst in zip(records, outcomes, agreed, strict=True):
                if worst == _FAILED and code != _FAILED:
                    detail = "failed on another rank; see that rank's log"
                self._settle(record, _RESULT[worst], step, detail)
        return [order["action"] for order, worst in zip(orders, agreed, strict=True) if worst == _APPLIED]

    def _decide(self, step: int) -> list[ActionRecord]:
        """Rank 0: what to broadcast; refusals are settled here and never reach other ranks."""
        chosen = []
        for record in self.queue.take():
            refusal = self._limits.check(record.action, step)
            if refusal is None and record.action == "reduce_lr":
                if self._optimizer is None:
                    refusal = ("failed", "no optimizer was given to the ControlChannel")
                elif not can_reduce(self._optimizer, self.config.lr_floor):
                    refusal = ("refused_floor", f"every learning rate is at the floor {self.config.lr_floor:g}")
            if refusal is not None:
                self._settle(record, refusal[0], step, refusal[1])
                continue
            # Counted now, so a second request in the same batch already sees the cooldown.
            self._limits.record(record.action, step)
            chosen.append(record)
        return chosen

    def _order(self, record: ActionRecord) -> dict[str, Any]:
        """What the other ranks need to apply `record` (the wire format of one action)."""
        return {
            "action": record.action,
            "reason": record.reason,
            "lr_factor": record.params.get("lr_factor", self.config.lr_factor),
        }

    def _apply(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        """Carry out one order on this rank; (outcome code, one-line detail)."""
        action, reason = order["action"], order["reason"]
        try:
            if action == "checkpoint":
                handler.checkpoint(reason)
            elif action == "reduce_lr":
                rates = scale_learning_rates(
                    self._optimizer, self._scheduler, float(order["lr_factor"]), self.config.lr_floor
                )
                if self.rank == 0:
                    self.snapshot.update(learning_rates=rates)
            elif action == "pause":
                if self._paused:
                    return _NOOP, "already paused"
                self._set_paused(True)
            elif action == "resume":
                if not self._paused:
                    return _NOOP, "not paused"
                self._set_paused(False)
            elif action == "stop":
                self._stop_requested = True
                self._set_paused(False)
                if self.rank == 0:
                    self.snapshot.update(stop_requested=True)
                handler.request_stop(reason)
        except Exception as exc:  # an action must not kill training; the outcome says it failed
            logger.exception("rankscope: rank %d failed to apply %s at step %d", self.rank, action, step)
            return _FAILED, f"rank {self.rank}: {type(exc).__name__}: {exc}"[:200]
        logger.info("rankscope: rank %d applied %s at step %d (%s)", self.rank, action, step, reason)
        return _APPLIED, ""

    def _hold(self, step: int, handler: ControlHandler) -> list[str]:
        """Loop at the boundary until resumed (or stopped)."""
        started = time.monotonic()
        applied: list[str] = []
        while self._paused:
            if self.rank == 0:
                # Wakes at once when a request arrives; otherwise a heartbeat round.
                self.queue.wait_for_pending(self.config.pause_heartbeat_seconds)
            applied += self._exchange(step, handler)
        logger.info("rankscope: rank %d resumed at step %d after %.1fs", self.rank, step, time.monotonic() - started)
        return applied

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        self._instruments.child(PREFIX + "paused").set(1 if paused else 0)
        if self.rank == 0:
            self.snapshot.update(paused=paused, paused_since=time.time() if paused else None)

    def _settle(self, record: ActionRecord, result: str, step: int, detail: str = "") -> None:
        settled = self.queue.settle(record, result, step, detail)
        self._count(settled.action, settled.source, result)
        if result != "applied":
            logger.warning(
                "rankscope: control %s %s (%s): %s %s", settled.id, settled.action, settled.reason, result, detail
            )

    def _count(self, action: str, source: str, result: str) -> None:
        # Rank 0 only: the channel's decisions happen there, so a sum over ranks counts each once.
        self._instruments.child(PREFIX + "control_actions_total", action=action, source=source, result=result).inc()
