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
- The first collective of a round is an all-reduce that also carries each
  rank's stop flags (SIGTERM/SIGINT received, torchrun agent gone; see
  `stops`): a signal on any rank stops every rank at the same step.

What the outcome means (see `effects`): "applied" only once the effect
happened on every rank. `reduce_lr` waits for the next optimizer step and
checks the rate it used ("overridden" if the loop overwrote it: the
reduction then uses no cap or cooldown and is undone); `checkpoint` is
applied when the loop's `checkpoint()` says it wrote one; `stop` when the
loop has left (the channel is closed), "overridden" if it trained on.
Until then the action is "pending" in the status, with what it waits for.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from prometheus_client import CollectorRegistry

from rankscope.contract import PHASES, PREFIX
from rankscope.control.actions import ActionRequest
from rankscope.control.app import AppDeps, create_app
from rankscope.control.catalog import action_spec, check_result
from rankscope.control.collective import agree_on_worst, broadcast_json, exchange
from rankscope.control.config import ControlConfig, load_token
from rankscope.control.effects import Check, LRReductionCheck, OptimizerWatch
from rankscope.control.endpoint import ControlServer, serve_control
from rankscope.control.limits import ActionLimits
from rankscope.control.lr import (
    _as_float,
    can_reduce,
    capture_references,
    current_learning_rates,
    reduction_ratios,
    reference_rates,
    restore_references,
    scale_learning_rates,
)
from rankscope.control.lr_return import LRReturn
from rankscope.control.peer import create_peer_app
from rankscope.control.recovery import ActionUnavailable, MicroBatchChange, RollbackDone, RollbackRequest
from rankscope.control.restart import Restarter
from rankscope.control.stacks import fold, gather, own_stacks, render
from rankscope.control.state import ActionQueue, ActionRecord, RunSnapshot
from rankscope.control.stop_deadline import StopDeadline
from rankscope.control.stops import StopSignals, first_reason
from rankscope.identity import RankIdentity
from rankscope.instruments import Instruments
from rankscope.serving.exposition import state_changed
from rankscope.serving.webconfig import web_config_for

__all__ = ["ControlChannel", "ControlHandler", "ControlStartError"]

logger = logging.getLogger("rankscope")

# Outcome codes agreed by MAX over ranks: the worst outcome on any rank wins (a rank still waiting
# for the effect keeps the action pending; one that saw it fail makes it fail everywhere).
# From _REFUSED on, the action did not happen: what it changed is undone and it uses no cap or cooldown.
_APPLIED, _NOOP, _AWAITING, _REFUSED, _UNSUPPORTED, _OVERRIDDEN, _FAILED = range(7)
_RESULT = {
    _APPLIED: "applied",
    _NOOP: "noop",
    _REFUSED: "refused_unavailable",
    _UNSUPPORTED: "unsupported",
    _OVERRIDDEN: "overridden",
    _FAILED: "failed",
}
#: Boundaries remembered on rank 0 to find the step at an alert's startsAt (older alerts take the oldest).
_HISTORY_STEPS = 100_000
#: Format of `ControlChannel.state_dict()` (2 added the learning-rate return; 1 is still read).
_STATE_FORMAT = 2
_READ_FORMATS = (1, 2)


class ControlHandler(Protocol):
    """What the training loop provides to carry out actions it alone knows how to do (every rank)."""

    def checkpoint(self, reason: str) -> Any:
        """Write a checkpoint now, recording `reason` ("alert:<alertname>", "operator:<reason>").

        Return something true (the path written, or True) once it is written, something false if it
        was not; a framework that writes it later returns a callable answering None until then, True
        once written, or a one-line reason it was not. Only then is the action "applied"."""

    def request_stop(self, reason: str) -> None:
        """Make the loop checkpoint and leave its loop (exit 0) after this step; the action is "applied"
        once the loop has left (`ControlChannel.close()`), "overridden" if it trains on."""

    # Optional: `rollback(request: RollbackRequest) -> RollbackDone` and
    # `reduce_micro_batch(reason: str) -> MicroBatchChange` (see `recovery`); without them those
    # actions are "unsupported".


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
        # Time held paused is the goodput's "paused" bucket (a monitor without phases: nothing to account).
        self._phase = getattr(monitor, "phase", None) or (lambda name: contextlib.nullcontext())
        self._goodput = getattr(monitor, "goodput", None)
        # Stacks carry the collective in flight (a monitor without a collective view: none).
        self._in_flight = getattr(monitor, "collective_in_flight", None)
        # What a SIGTERM that finds this rank hung writes: its phase, as rankscope_phase shows it.
        self._progress = getattr(monitor, "progress", None)
        self._collective_view = getattr(monitor, "collectives", None)
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
        self._lr_scale = 1.0
        self._lr_references: list[float] = []
        # A reduce_lr with restore_after_steps: the rates owed back, and when (every rank alike).
        self._lr_return: LRReturn | None = None
        # Actions carried out whose effect is not confirmed yet, by order id, in the order carried out:
        # on every rank what to check and how to undo it; on rank 0 also the record to settle.
        self._checks: dict[str, _Awaited] = {}
        self._awaiting: dict[str, ActionRecord] = {}
        self._signals: StopSignals | None = None
        self._deadline: StopDeadline | None = None
        self._watch: OptimizerWatch | None = None
        # Rank 0: (unix time, step) at each boundary, to turn an alert's startsAt into a step.
        self._history: deque[tuple[float, int]] = deque(maxlen=_HISTORY_STEPS)
        self._boundary_step = 0
        # `restart` and GET /v1/stacks: every other rank's peer endpoint (rank 0 knows their URLs).
        self._restarter: Restarter | None = None
        self._peer_server: ControlServer | None = None
        self._peer_urls: dict[int, str] = {}
        self._token: str | None = None
        if not self.config.enabled:
            return
        self._instruments.child(PREFIX + "paused").set(0)
        if optimizer is not None:
            self._watch = OptimizerWatch(optimizer)
            self._lr_references = self._initial_references()
        if self._distributed:
            self._group = self._new_group()
        error = self._start_server(identity.run_id) if self.rank == 0 and self.config.endpoint else ""
        self._agree_on_start(error)
        if self.config.endpoint:
            self._meet_peers()
        if self.config.handle_signals and self.config.stop_grace_seconds > 0:
            self._deadline = StopDeadline(
                self.rank, self.config.stop_grace_seconds, self.config.state_dir,
                phase=self._phase_now, in_flight=self._in_flight, flush_ledger=self._write_ledger,
                loop_left=lambda: bool(getattr(monitor, "finished", False)),
            )  # fmt: skip
        on_sigterm = self._deadline.on_sigterm if self._deadline is not None else None
        self._signals = StopSignals(self.config.handle_signals, self.config.stop_when_orphaned, on_sigterm)

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

    @property
    def lr_scale(self) -> float:
        """The product of the learning-rate reductions in force (1.0 until the first one, and again once a
        reduction for a number of steps has given its rate back).

        A loop that computes its own learning rate honours reductions by multiplying it in:
        `group["lr"] = my_lr(step) * channel.lr_scale`. Saved with `state_dict()`."""
        return self._lr_scale

    def at_step_boundary(self, step: int, handler: ControlHandler) -> list[str]:
        """Carry out pending actions on every rank at `step`; returns the actions carried out here
        (their outcome may be settled at a later boundary, once their effect is seen).

        Every rank must call it after every step with the same `step`. Blocks
        while the run is paused.
        """
        if not self.config.enabled:
            return []
        self._boundary_step = step
        if self._lr_return is not None and step >= self._lr_return.due_step and not self._reduction_unsettled():
            self._give_back_lr(step)
        if self.rank == 0:
            self.snapshot.update(step=step, learning_rates=current_learning_rates(self._optimizer))
            if not self._history or self._history[-1][1] != step:
                self._history.append((time.time(), step))
            if self._restarter is not None:
                self._restarter.after_step(step)  # a restarted group's first step settles its restart
        if step % self.config.check_every_n_steps:
            return []
        applied = self._exchange(step, handler)
        if self._paused:
            with self._phase("paused"):
                applied += self._hold(step, handler)
        return applied

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep for the control loop to resume as it was: the learning-rate
        scale and reference rates, the rates owed back by a reduction for a number of steps, and how often
        each action was applied (caps hold across resumes)."""
        return {
            "format": _STATE_FORMAT,
            "lr_scale": self._lr_scale,
            "lr_references": list(self._lr_references),
            "lr_return": self._lr_return.to_json() if self._lr_return is not None else None,
            "applied": self._limits.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (every rank, before the first step boundary)."""
        if state.get("format") not in _READ_FORMATS:
            raise ValueError(
                f"control state has format {state.get('format')!r}, this version reads "
                + " and ".join(map(str, _READ_FORMATS))
            )
        owed = state.get("lr_return")
        groups = len(self._optimizer.param_groups) if self._optimizer is not None else 0
        self._lr_return = LRReturn.from_json(owed, groups) if owed is not None else None
        self._lr_scale = float(state["lr_scale"])
        saved = [float(v) for v in state["lr_references"]]
        if len(saved) == len(self._lr_references):
            self._lr_references = [max(a, b) for a, b in zip(saved, self._lr_references, strict=True)]
        self._limits.load_state_dict(state["applied"])

    def finish(self, linger_seconds: float = 0.0) -> None:
        """The loop has left after its last step: call on every rank instead of close().

        A stop the loop was asked for is "applied" now: every rank logs `rank R applied stop at step N`,
        and rank 0's /v1/status and rankscope_control_actions_total say so. Every rank then waits
        `linger_seconds` before its endpoints close and the call returns, so that each rank's metrics page
        (closed by `monitor.close()` after this) is scraped showing rankscope_run_finished 1, and a waiting
        `rankscope-ctl` sees the outcome: more than one scrape interval. A rank that left at once would be
        down, not finished, to Prometheus, and page as a rank that went down. Local: issues no collective. Call
        it from the thread that created the channel, as close(): the signal handlers are put back there."""
        self._settle_stop()
        if self._deadline is not None:
            self._deadline.reached.set()  # the loop has left: a SIGTERM during the linger has no boundary to reach
        if linger_seconds > 0:
            logger.info("rankscope: rank %d serves for %.0fs more (finish)", self.rank, linger_seconds)
            time.sleep(linger_seconds)
        self.close()

    def close(self) -> None:
        """Stop serving (rank 0). Local: issues no collective. Idempotent.

        A requested stop is "applied" here too (the loop has left), as in finish(), without lingering."""
        self._settle_stop()
        self._checks.clear()
        if self._deadline is not None:
            self._deadline.reached.set()  # the loop has left: a SIGTERM from now on has no boundary to reach
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._peer_server is not None:
            self._peer_server.close()
            self._peer_server = None
        if self._signals is not None:
            self._signals.close()
            self._signals = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.config.enabled:
            self._instruments.child(PREFIX + "paused").set(0)

    def _settle_stop(self) -> None:
        """A stop carried out at a boundary is applied once the loop has left: say so on every rank."""
        for order_id, awaited in list(self._checks.items()):
            if awaited.action != "stop":
                continue
            del self._checks[order_id]
            logger.info("rankscope: rank %d applied stop at step %d (the loop has left)", self.rank, awaited.step)
            record = self._awaiting.pop(order_id, None)
            if record is not None:
                self._settle(record, "applied", awaited.step)
        state_changed()

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
        dist.set_timeout(timeout, group=group)  # type: ignore[arg-type]  # every rank is a member of it
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
            self._token = token
            self._restarter = Restarter(
                self.config, self.queue, self.snapshot, peers=lambda: self._peer_urls, token=token, count=self._count,
                lost=self._count_lost_steps, in_flight=self._in_flight, before_exit=self._flush_goodput,
            )  # fmt: skip
            self._instruments.child(PREFIX + "restart_lost_steps_total")  # at 0, so increase() sees the first loss
            deps = AppDeps(
                self.queue,
                self.snapshot,
                token,
                run_id=run_id,
                world_size=self.world_size,
                max_body_bytes=self.config.max_body_bytes,
                count=self._count,
                stacks=self._stacks,
                immediate=self._restarter.submit,
            )
            web = web_config_for("control", self.config.web_config_file)
            self._server = serve_control(create_app(deps), self.config.host, self.config.port, web=web)
        except (ValueError, OSError, RuntimeError) as exc:
            return str(exc)
        where = f"{self.config.host}:{self._server.port}"
        if self.config.host in ("0.0.0.0", "::", ""):
            where += " (every interface)"
        if token is None:
            logger.warning("rankscope: control endpoint listening on %s WITHOUT a token (control.insecure)", where)
        else:
            logger.info("rankscope: control endpoint listening on %s (%s)", where, self._server.url)
        return ""

    def _agree_on_start(self, error: str) -> None:
        # Rank 0 tells every rank whether it started, so a failure raises everywhere
        # instead of leaving the other ranks waiting in the first boundary broadcast.
        if self._distributed:
            error = broadcast_json(error or None, self._group, self.rank) or ""
        if error:
            raise ControlStartError(error if self.rank == 0 else f"control endpoint failed on rank 0: {error}")

    def _meet_peers(self) -> None:
        """Every other rank serves its peer endpoint (stacks, exit) and rank 0 learns where. A rank whose
        endpoint cannot start trains on; rank 0 names it as having no stacks."""
        url = None
        if self.rank != 0:
            try:
                token = load_token(self.config)
                if token is not None or self.config.insecure:
                    web = web_config_for("control", self.config.web_config_file)
                    app = create_peer_app(self.rank, token, in_flight=self._in_flight)
                    self._peer_server = serve_control(app, self.config.host, 0, web=web)
                    url = self._peer_server.url
            except (ValueError, OSError, RuntimeError) as exc:
                logger.warning("rankscope: rank %d serves no stacks: %s", self.rank, exc)
        if not self._distributed:
            return
        urls: list[Any] = [None] * self.world_size
        dist.all_gather_object(urls, url, group=self._group)
        self._peer_urls = {rank: u for rank, u in enumerate(urls) if rank != 0 and u}

    def _stacks(self, local: bool) -> dict[str, Any]:
        """GET /v1/stacks on rank 0: this rank's, or every rank's gathered over HTTP and folded."""
        mine = own_stacks(self.rank, self._in_flight)
        if local:
            return mine
        by_rank = {self.rank: mine, **gather(self._peer_urls, self._token)}
        for rank in range(self.world_size):
            by_rank.setdefault(rank, {"error": "this rank's endpoint did not start"})
        folded = fold(by_rank)
        groups = [{"ranks": list(g.ranks), "headline": g.headline, "stacks": g.text} for g in folded]
        return {"summary": render(folded, full=False), "groups": groups}

    def _flush_goodput(self) -> None:
        """Write the goodput ledger (rank 0's, if the monitor keeps one) at the restart's exit: the time
        until then (a hang, say) belongs to this incarnation, not to the next one's start-up."""
        if self._goodput is not None:
            self._goodput.flush()

    def _write_ledger(self) -> bool:
        """Write the goodput ledger at a SIGTERM exit; whether this rank keeps one on disk."""
        self._flush_goodput()
        return self._goodput is not None and getattr(self._goodput, "path", None) is not None

    def _phase_now(self) -> tuple[str, float]:
        """This rank's phase and since when (Unix time), as rankscope_phase shows it."""
        if self._progress is None:
            return "unknown", time.time()
        view = self._collective_view
        index, since = self._progress.current(view if view is not None and getattr(view, "enabled", False) else None)
        return PHASES[index], since

    def _count_lost_steps(self, steps: int) -> None:
        self._instruments.child(PREFIX + "restart_lost_steps_total").inc(steps)

    def _initial_references(self) -> list[float]:
        """Each group's reference rate for the relative floor: its scheduler's initial rate if it has one."""
        peak = self._watch.peak if self._watch is not None else []
        assert self._optimizer is not None, "reference rates are read only with an optimizer"
        groups = self._optimizer.param_groups
        return [max(_as_number(g.get("initial_lr", 0.0)), p) for g, p in zip(groups, peak, strict=False)]

    def _floors(self) -> list[float]:
        """Per param group: the lowest rate a reduction may reach."""
        peak = self._watch.peak if self._watch is not None else []
        references = [max(r, p) for r, p in zip(self._lr_references, peak, strict=False)]
        self._lr_references = references
        return [max(self.config.lr_floor, self.config.lr_floor_ratio * r) for r in references]

    # --- the step boundary ------------------------------------------------------------

    def _exchange(self, step: int, handler: ControlHandler) -> list[str]:
        """One round: rank 0 decides, all ranks receive and apply, all agree on the outcome."""
        records = {record.id: record for record in self._decide(step)} if self.rank == 0 else {}
        message: dict[str, Any] | None = None
        if self.rank == 0 and (records or self._awaiting):
            orders = [self._order(record, step) for record in records.values()]
            message = {"orders": orders, "awaiting": list(self._awaiting)}
        flags = self._signals.flags() if self._signals is not None else [0, 0, 0]
        if self._distributed:
            message, flags = exchange(message, flags, self._group, self.rank)
        message = message or {"orders": [], "awaiting": []}
        reason = first_reason(flags)
        if reason is not None and not self._stop_requested:
            message["orders"].append(self._stop_order(reason, step, records))
        if not message["orders"] and not message["awaiting"]:
            return []
        # Earlier actions' effects first (they happened before this boundary), then this round's actions.
        verdicts = [self._verify(order_id) for order_id in message["awaiting"]]
        outcomes = [self._apply(order, step, handler) for order in message["orders"]]
        codes = [code for code, _ in verdicts + outcomes]
        agreed = agree_on_worst(codes, self._group) if self._distributed else codes
        for order_id, (code, detail), worst in zip(message["awaiting"], verdicts, agreed, strict=False):
            if worst != _AWAITING:
                self._conclude(order_id, code, detail, worst, step)
        carried = agreed[len(verdicts) :]
        for order, (code, detail), worst in zip(message["orders"], outcomes, carried, strict=True):
            self._after_apply(order, code, detail, worst, step, records.get(order["id"]))
        return [order["action"] for order, worst in zip(message["orders"], carried, strict=True) if worst <= _AWAITING]

    def _decide(self, step: int) -> list[ActionRecord]:
        """Rank 0: what to broadcast; refusals are settled here and never reach other ranks."""
        chosen = []
        for record in self.queue.take():
            spec = action_spec(record.action)
            if spec is not None and spec.immediate:  # never here (the endpoint carries them out); never hang on one
                self._settle(record, "failed", step, f"{record.action} reached the step boundary; it is immediate")
                continue
            refusal = self._limits.check(record.action, step)
            if refusal is None and record.action == "reduce_lr":
                if self._optimizer is None:
                    refusal = ("failed", "no optimizer was given to the ControlChannel")
                elif not can_reduce(self._optimizer, self._floors()):
                    refusal = ("refused_floor", "every learning rate is at its floor")
            if refusal is not None:
                self._settle(record, refusal[0], step, refusal[1])
                continue
            # Counted now, so a second request in the same batch already sees the cooldown
            # (taken back if the effect does not happen).
            self._limits.record(record.action, step)
            chosen.append(record)
        return chosen

    def _order(self, record: ActionRecord, step: int) -> dict[str, Any]:
        """What the other ranks need to apply `record` (the wire format of one action): its parameters
        with the configured defaults filled in, decided here so that every rank applies the same."""
        spec = action_spec(record.action)
        params = {
            p.name: record.params.get(p.name, getattr(self.config, p.default_setting, None))
            for p in (spec.parameters if spec is not None else ())
        }
        order: dict[str, Any] = {"id": record.id, "action": record.action, "reason": record.reason, "params": params}
        if record.action == "reduce_lr":
            order["floors"] = self._floors()  # rank 0's, so every rank scales alike
        if record.action == "rollback":
            order["rollback"] = self._rollback_request(record, params, step).to_json()
        return order

    def _rollback_request(self, record: ActionRecord, params: dict[str, Any], step: int) -> RollbackRequest:
        """Rank 0: where to roll back to. An explicit before_step wins; else the step at the alert's startsAt (when
        it fired: Prometheus sends that, its `for` after the condition began); else the current step. An alert's
        incident_lookback_seconds moves where to go back to that much earlier (a smoothed signal fires its `for`
        and up to a window after the fault), not the incident: the data skipped still runs through it, plus the
        margin."""
        before, before_time = None, None
        if params.get("before_step") is not None:
            incident = int(params["before_step"])
        elif record.started_at is not None:
            incident = self._step_at(record.started_at, step)
            if params.get("incident_lookback_seconds"):
                moment = record.started_at - float(params["incident_lookback_seconds"])
                # Past this process's first step no step of it is older: "before step 1" and the moment itself; the
                # loop takes the newest checkpoint written before it, or its oldest (RollbackRequest.from_start).
                if self._before_first_boundary(moment):
                    before, before_time = 1, moment
                else:
                    before = self._step_at(moment, step)
        else:
            incident = step
        skip = params.get("skip_batches")
        return RollbackRequest(
            before_step=incident if before is None else before,
            incident_step=incident,
            skip_batches=None if skip is None else int(skip),
            margin_batches=self.config.rollback_margin_batches,
            lr_factor=float(params.get("lr_factor") or 1.0),
            reason=record.reason,
            lookahead_batches=self.config.rollback_lookahead_batches,
            onset_window_steps=self.config.rollback_onset_window_steps,
            before_time=before_time,
        )

    def _before_first_boundary(self, moment: float) -> bool:
        """Whether `moment` precedes the first step boundary this process saw (its history still holds it)."""
        whole = len(self._history) < (self._history.maxlen or 0)
        return bool(self._history) and whole and moment < self._history[0][0]

    def _step_at(self, moment: float, current: int) -> int:
        """The step the run was at, at Unix time `moment` (the last boundary at or before it)."""
        found = None
        for when, step in reversed(self._history):
            if when <= moment:
                found = step
                break
        if found is None:  # before the remembered history (or the run): its oldest step
            found = self._history[0][1] if self._history else current
        return max(1, found)

    def _stop_order(self, reason: str, step: int, records: dict[str, ActionRecord]) -> dict[str, Any]:
        """Every rank builds the same stop order from the agreed flags; rank 0 also records it."""
        order = {"id": f"signal@{step}", "action": "stop", "reason": reason}
        if self.rank == 0:
            records[order["id"]] = self.queue.start(ActionRequest("stop", "signal", reason))
            logger.warning("rankscope: %s: every rank checkpoints and stops at step %d", reason, step)
        return order

    def _apply(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        """Carry out one order on this rank; (outcome code, one-line detail)."""
        action = order["action"]
        try:
            return self._behaviours[action](order, step, handler)
        except Exception as exc:  # an action must not kill training; the outcome says it failed
            logger.exception("rankscope: rank %d failed to apply %s at step %d", self.rank, action, step)
            return _FAILED, f"rank {self.rank}: {type(exc).__name__}: {exc}"[:200]

    # --- what each action does (one per catalog entry; see `_behaviours`) ---------------------------

    def _checkpoint(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        return self._expect(order, step, _checkpoint_check(handler.checkpoint(order["reason"])))

    def _pause(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        if self._paused:
            return _NOOP, "already paused"
        self._set_paused(True)
        return _APPLIED, ""

    def _resume(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        if not self._paused:
            return _NOOP, "not paused"
        self._set_paused(False)
        return _APPLIED, ""

    def _stop(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        handler.request_stop(order["reason"])
        self._stop_requested = True
        if self._deadline is not None:
            self._deadline.reached.set()  # every rank agreed on the stop: no SIGTERM deadline from here on
        self._set_paused(False)
        if self.rank == 0:
            self.snapshot.update(stop_requested=True)
        return self._expect(order, step, _trained_on, next_boundary=True)

    def _reduce_lr(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        factor, floors = float(order["params"]["lr_factor"]), order["floors"]
        lasts = int(order["params"].get("restore_after_steps") or 0)
        before, references = current_learning_rates(self._optimizer), reference_rates(self._optimizer)
        saved = capture_references(self._optimizer, self._scheduler)
        scale, owed = self._lr_scale, self._lr_return
        written = scale_learning_rates(self._optimizer, self._scheduler, factor, floors)
        self._lr_scale = max(scale * factor, self.config.lr_floor_ratio)
        if lasts:
            ratios = reduction_ratios(references, reference_rates(self._optimizer))
            self._lr_return = LRReturn.after(owed, step, lasts, ratios, scale / self._lr_scale)
        if self.rank == 0:
            self.snapshot.update(learning_rates=written)
        check = LRReductionCheck(before, written)
        if self._watch is not None:
            self._watch.expect(check)
        else:
            check.used = written  # no optimizer to watch: nothing can overwrite what was written

        def undo() -> None:
            restore_references(saved)
            self._lr_scale, self._lr_return = scale, owed

        return self._expect(order, step, check, undo)

    def _reduction_unsettled(self) -> bool:
        """A reduce_lr still waits for the optimizer to use its rate: give nothing back before it is judged."""
        return any(awaited.action == "reduce_lr" for awaited in self._checks.values())

    def _give_back_lr(self, step: int) -> None:
        """Every rank, at the same boundary: the rates a reduction for a number of steps took, given back."""
        owed, self._lr_return = self._lr_return, None
        assert owed is not None
        written = scale_learning_rates(self._optimizer, self._scheduler, owed.ratios)
        self._lr_scale = min(1.0, self._lr_scale * owed.scale)
        if self.rank == 0:
            self.snapshot.update(learning_rates=written)
            logger.warning(
                "rankscope: learning rates given back at step %d, %d steps after the reduction at step %d: %s",
                step, step - owed.reduced_at, owed.reduced_at, ", ".join(f"{lr:.3g}" for lr in written),
            )  # fmt: skip

    @staticmethod
    def _ask_loop(handler: ControlHandler, method: str, argument: Any, answer: type) -> tuple[Any, tuple[int, str]]:
        """Call the loop's optional `method(argument)` (see `recovery`): (its answer, (_APPLIED, "")), or
        (None, the outcome): unsupported without the method, refused_unavailable if it raised
        ActionUnavailable, failed for an answer that is not an `answer`."""
        call = getattr(handler, method, None)
        if call is None:
            return None, (_UNSUPPORTED, f"{type(handler).__name__} has no {method}() method")
        try:
            result = call(argument)
        except ActionUnavailable as exc:
            return None, (_REFUSED, str(exc)[:200])
        if not isinstance(result, answer):
            return None, (_FAILED, f"{method}() returned {type(result).__name__}, not a {answer.__name__}")
        return result, (_APPLIED, "")

    def _rollback(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        done, outcome = self._ask_loop(handler, "rollback", RollbackRequest(**order["rollback"]), RollbackDone)
        if done is None:
            return outcome
        if self._lr_return is not None:
            # The loop loaded the checkpoint's rates, reduced or not: what was owed back no longer applies to them.
            if self.rank == 0:
                logger.warning("rankscope: the rollback at step %d drops the learning rates owed back at step %d",
                               step, self._lr_return.due_step)  # fmt: skip
            self._lr_return = None
        if self.rank == 0:
            logger.warning(
                "rankscope: rollback at step %d to checkpoint step %d (%s), skipping %d batches: %s",
                step, done.checkpoint_step, done.checkpoint, done.skipped_batches, done.detail,
            )  # fmt: skip
        # Seen at the next exchange: a loop that went back is at most one check interval past the checkpoint.
        reached = done.checkpoint_step + self.config.check_every_n_steps

        def went_back() -> bool | str | None:
            if self._paused:
                return None  # held at the boundary: the loop trains on from the checkpoint once resumed
            if self._boundary_step <= reached:
                return True
            return f"the loop went on from step {step} instead of the checkpoint's step {done.checkpoint_step}"

        return self._expect(order, step, went_back, next_boundary=True)

    def _reduce_micro_batch(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        change, outcome = self._ask_loop(handler, "reduce_micro_batch", order["reason"], MicroBatchChange)
        if change is None:
            return outcome
        same_global = change.micro_batch * change.accumulation_steps == (
            change.previous_micro_batch * change.previous_accumulation_steps
        )
        if not same_global or change.micro_batch >= change.previous_micro_batch:
            return _FAILED, (
                f"micro-batch {change.previous_micro_batch}x{change.previous_accumulation_steps} became "
                f"{change.micro_batch}x{change.accumulation_steps}: not a smaller micro-batch of the same global batch"
            )
        if self.rank == 0:
            logger.warning(
                "rankscope: micro-batch %d -> %d, gradient accumulation %d -> %d from step %d",
                change.previous_micro_batch, change.micro_batch, change.previous_accumulation_steps,
                change.accumulation_steps, step + 1,
            )  # fmt: skip
        return _APPLIED, ""

    @property
    def _behaviours(self) -> dict[str, Callable[[dict[str, Any], int, ControlHandler], tuple[int, str]]]:
        """Action name -> what this rank does for it (tests check it covers the catalog exactly)."""
        return {
            "checkpoint": self._checkpoint,
            "reduce_lr": self._reduce_lr,
            "rollback": self._rollback,
            "reduce_micro_batch": self._reduce_micro_batch,
            "pause": self._pause,
            "resume": self._resume,
            "stop": self._stop,
            "restart": self._restart_at_boundary,
        }

    def _restart_at_boundary(self, order: dict[str, Any], step: int, handler: ControlHandler) -> tuple[int, str]:
        # `restart` is carried out by rank 0's endpoint thread (restart.Restarter), never broadcast.
        return _FAILED, "restart is immediate and is never carried out at a step boundary"

    def _unstop(self) -> None:
        """A stop that did not happen: the run is not stopping, and takes requests again."""
        self._stop_requested = False
        if self.rank == 0:
            self.snapshot.update(stop_requested=False)
            self.queue.accept_again()

    def _expect(
        self,
        order: dict[str, Any],
        step: int,
        check: Check,
        undo: Callable[[], None] | None = None,
        next_boundary: bool = False,
    ) -> tuple[int, str]:
        """Settle at once if the effect is already known, else keep the check for later boundaries
        (`next_boundary`: the effect can only be seen there, e.g. the loop having left or gone back)."""
        awaited = self._checks[order["id"]] = _Awaited(order["action"], step, check, undo)
        verdict = None if next_boundary else check()
        return (_AWAITING, "") if verdict is None else awaited.code(verdict)

    def _verify(self, order_id: str) -> tuple[int, str]:
        awaited = self._checks.get(order_id)
        if awaited is None:
            return _APPLIED, ""  # nothing left to see on this rank
        try:
            verdict = awaited.check()
        except Exception as exc:
            return _FAILED, f"rank {self.rank}: checking the effect failed: {type(exc).__name__}: {exc}"[:200]
        return (_AWAITING, "") if verdict is None else awaited.code(verdict)

    def _after_apply(
        self, order: dict[str, Any], code: int, detail: str, worst: int, step: int, record: ActionRecord | None
    ) -> None:
        """This round's action, once every rank's outcome is known: settle it, or wait for its effect."""
        if worst == _AWAITING:
            if code != _AWAITING:
                self._checks[order["id"]].check = _done  # seen here already; another rank still waits
            if record is not None:
                self._awaiting[order["id"]] = self.queue.note(
                    record, f"carried out at step {step}; {_waits_for(order)}"
                )
            return
        self._finish(order["id"], order["action"], code, detail, worst, step, record)

    def _conclude(self, order_id: str, code: int, detail: str, worst: int, step: int) -> None:
        """An awaited effect is now known on every rank."""
        record = self._awaiting.pop(order_id, None)
        awaited = self._checks.get(order_id)
        action = record.action if record is not None else awaited.action if awaited is not None else "?"
        self._finish(order_id, action, code, detail, worst, step, record)

    def _finish(
        self,
        order_id: str,
        action: str,
        code: int,
        detail: str,
        worst: int,
        step: int,
        record: ActionRecord | None,
    ) -> None:
        """Settle an action whose outcome every rank now knows; `step` is the boundary where that became known.
        `action` is the order's name: only rank 0 holds the record, every rank logs the name."""
        awaited = self._checks.pop(order_id, None)
        carried_at = awaited.step if awaited is not None else step
        state_changed()  # every rank: what the action changed is on the next page, not one from before it
        if worst >= _REFUSED:  # the effect did not happen: put back what was changed
            if awaited is not None and awaited.undo is not None:
                awaited.undo()
            if action == "stop":
                self._unstop()
        if code >= _REFUSED:
            logger.warning("rankscope: rank %d: %s %s at step %d: %s", self.rank, action, _RESULT[code], step, detail)
        elif worst == _APPLIED:
            logger.info("rankscope: rank %d applied %s at step %d", self.rank, action, carried_at)
            # A rollback is seen at a step before it, or at its own number when it went back to the checkpoint just
            # before it: the run went back, not time.
            if action == "rollback" and step <= carried_at:
                detail = f"the run went back to step {step}"
            elif carried_at != step:
                detail = f"took effect by step {step}"
        if record is not None:
            if worst >= _REFUSED:
                self._limits.undo(record.action)  # no cap or cooldown used by what did not happen
            result_detail = detail if worst == code else f"{_RESULT[worst]} on another rank; see that rank's log"
            self._settle(record, _RESULT[worst], carried_at, result_detail)

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
        state_changed()  # a scrape right after shows it (the metrics page's cache holds no older page)
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
        check_result(result)  # the `result` label's values are the catalog's, and no others
        self._instruments.child(PREFIX + "control_actions_total", action=action, source=source, result=result).inc()
        if result == "applied":  # the rules' guards read when, which a restarted process's counter cannot say
            self._instruments.child(PREFIX + "control_last_applied_timestamp_seconds", action=action).set(time.time())
        state_changed()


class _Awaited:
    """One carried-out action whose effect this rank has not confirmed yet."""

    __slots__ = ("action", "step", "check", "undo")

    def __init__(self, action: str, step: int, check: Check, undo: Callable[[], None] | None) -> None:
        self.action, self.step, self.check, self.undo = action, step, check, undo

    def code(self, verdict: bool | str) -> tuple[int, str]:
        """A known verdict as an outcome: a checkpoint not written failed; other effects were overridden."""
        if verdict is True:
            return _APPLIED, ""
        return (_FAILED if self.action == "checkpoint" else _OVERRIDDEN), str(verdict or "the effect did not happen")


def _checkpoint_check(result: Any) -> Check:
    """The handler's answer to checkpoint() as a check (see ControlHandler.checkpoint)."""
    if callable(result) and not isinstance(result, (str, Path)):
        return result
    if result:
        return _done
    return lambda: "the loop's checkpoint() reported that no checkpoint was written"


def _done() -> bool:
    return True


def _trained_on() -> str:
    # Asked at the next boundary, which a loop that stopped never reaches.
    return "the loop went on training after request_stop() (it must leave its loop)"


def _waits_for(order: dict[str, Any]) -> str:
    return {
        "reduce_lr": "waiting for the next optimizer step to use the reduced rate",
        "checkpoint": "waiting for the loop to write the checkpoint",
        "stop": "waiting for the loop to leave",
        "rollback": "waiting for the loop to train on from the checkpoint",
    }.get(order["action"], "waiting for its effect")


def _as_number(value: Any) -> float:
    number = _as_float(value)
    return number if math.isfinite(number) else 0.0
