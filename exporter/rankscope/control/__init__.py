"""rankscope's control endpoint: alerts and operators act on a running job, on every rank at the same step.

    from rankscope.control import ControlChannel, ControlConfig

    channel = ControlChannel(ControlConfig(token_file="/run/secrets/control"), monitor,
                             optimizer=optimizer, scheduler=scheduler)   # every rank
    ...
    channel.at_step_boundary(step, handler)   # every rank, every step
    ...
    channel.close()

`handler` is the loop's: `checkpoint(reason)` and `request_stop(reason)`, and optionally
`rollback(RollbackRequest)` and `reduce_micro_batch(reason)` (see `recovery`).
Routes (rank 0): POST /v1/alerts (Alertmanager webhook v4), POST /v1/actions,
GET /v1/status, GET /healthz; see openapi.yaml beside this file.

Public API: :class:`ControlChannel`, :class:`ControlConfig`,
:class:`ControlHandler`, :class:`ControlStartError`, :class:`ControlPortInUse`,
:func:`record_checkpoint`, :func:`record_checkpoint_failure`, :data:`ACTIONS`, :data:`RESULTS`, the recovery
contract (:class:`RollbackRequest`, :class:`RollbackDone`, :class:`MicroBatchChange`, :class:`ActionUnavailable`),
and for embedding
the endpoint elsewhere :func:`create_app` / :class:`AppDeps` /
:func:`serve_control`, :class:`ActionQueue` and :class:`RunSnapshot`; :class:`WorkerInit` (and
:func:`ignore_stop_signals`) for DataLoader workers started with spawn/forkserver;
:func:`init_restartable_process_group` (or
:func:`attempt_store`) for a process group that torchrun can restart after `restart`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankscope._lazy import lazy_attributes

if TYPE_CHECKING:  # at run time each name is imported on first use: the CLI needs neither torch nor the channel
    from rankscope.control.actions import ACTIONS, RESULTS
    from rankscope.control.app import AppDeps, create_app
    from rankscope.control.channel import ControlChannel, ControlHandler, ControlStartError
    from rankscope.control.config import ControlConfig, load_token
    from rankscope.control.endpoint import ControlPortInUse, ControlServer, serve_control
    from rankscope.control.lr import scale_learning_rates
    from rankscope.control.metrics import record_checkpoint, record_checkpoint_failure
    from rankscope.control.recovery import ActionUnavailable, MicroBatchChange, RollbackDone, RollbackRequest
    from rankscope.control.rendezvous import attempt_store, init_restartable_process_group
    from rankscope.control.state import ActionQueue, RunSnapshot
    from rankscope.control.stops import WorkerInit, ignore_stop_signals

_WHERE = {
    "ACTIONS": ".actions",
    "RESULTS": ".actions",
    "AppDeps": ".app",
    "create_app": ".app",
    "ControlChannel": ".channel",
    "ControlHandler": ".channel",
    "ControlStartError": ".channel",
    "ControlConfig": ".config",
    "load_token": ".config",
    "scale_learning_rates": ".lr",
    "record_checkpoint": ".metrics",
    "record_checkpoint_failure": ".metrics",
    "ActionUnavailable": ".recovery",
    "MicroBatchChange": ".recovery",
    "RollbackDone": ".recovery",
    "RollbackRequest": ".recovery",
    "ControlPortInUse": ".endpoint",
    "ControlServer": ".endpoint",
    "serve_control": ".endpoint",
    "attempt_store": ".rendezvous",
    "init_restartable_process_group": ".rendezvous",
    "ActionQueue": ".state",
    "RunSnapshot": ".state",
    "WorkerInit": ".stops",
    "ignore_stop_signals": ".stops",
}

__all__ = [
    "ACTIONS",
    "ActionQueue",
    "ActionUnavailable",
    "AppDeps",
    "ControlChannel",
    "ControlConfig",
    "ControlHandler",
    "ControlPortInUse",
    "ControlServer",
    "ControlStartError",
    "MicroBatchChange",
    "RESULTS",
    "RollbackDone",
    "RollbackRequest",
    "RunSnapshot",
    "WorkerInit",
    "attempt_store",
    "create_app",
    "ignore_stop_signals",
    "init_restartable_process_group",
    "load_token",
    "record_checkpoint",
    "record_checkpoint_failure",
    "scale_learning_rates",
    "serve_control",
]

__getattr__ = lazy_attributes(__name__, _WHERE, globals())


def __dir__() -> list[str]:
    return __all__
