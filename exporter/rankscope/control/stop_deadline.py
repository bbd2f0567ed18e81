"""SIGTERM that cannot reach a step boundary: what a preempted hung rank leaves behind before SIGKILL.

SIGTERM means "checkpoint, then stop" at the next step boundary, agreed by every rank (`stops`). A rank
that is hung, or waits in a collective for a peer that is, never gets there, and its launcher kills it
(torchrun 30 s after the signal) without a word. So on SIGTERM each rank gives the stop
`control.stop_grace_seconds`. If by then the stop has not been agreed at a boundary, the loop has not left
(`channel.finish()`/`close()`, `monitor.finish()`) and the rank is not writing a checkpoint or validating
(work a loop does on its way to the boundary, or on its way out: waited for), the rank

1. takes its own stacks, with its phase and the collective it has in flight, and writes them beside the
   checkpoints (`control.state_dir`; without one, into the log);
2. writes the goodput ledger (rank 0 keeps it), so that the hang's last seconds are accounted;
3. logs one line: no checkpoint was written, and why (this rank did not reach the boundary, in phase P; or
   it waits in a collective for a peer that did not);
4. ends its DataLoader workers and exits with UNCHECKPOINTED_EXIT_STATUS (143: as if the signal had ended it).

Rank-local: no collective (it would wait behind the hang) and no network (a peer may be gone already).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rankscope.control.stacks import InFlightReader, fold, own_stacks, render, write_stacks
from rankscope.control.stops import end_daemon_children
from rankscope.exits import end_all

__all__ = ["UNCHECKPOINTED_EXIT_STATUS", "StopDeadline"]

logger = logging.getLogger("rankscope")

#: Every rank that gave up on the stop exits with this (128 + SIGTERM: ended by the signal, no checkpoint).
UNCHECKPOINTED_EXIT_STATUS = 143
#: Phases in which a rank waits for its peers: the one that did not arrive is elsewhere.
_WAITING_PHASES = ("collective", "step_boundary")
#: Phases of work on the way to the boundary or out of the loop: waited for past the deadline.
_WORKING_PHASES = ("checkpoint", "validation")
#: How often such work is looked at again.
_POLL_SECONDS = 0.5

#: (this rank's phase, Unix time it began), as rankscope_phase shows it.
PhaseReader = Callable[[], tuple[str, float]]


class StopDeadline:
    """One rank's deadline for a SIGTERM stop (see the module docstring). `reached` is set by the channel once
    the stop is agreed at a step boundary, or the loop has left."""

    def __init__(
        self,
        rank: int,
        grace_seconds: float,
        state_dir: str,
        *,
        phase: PhaseReader,
        in_flight: InFlightReader | None = None,
        flush_ledger: Callable[[], bool] = lambda: False,
        loop_left: Callable[[], bool] = lambda: False,
        leave: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.reached = threading.Event()
        self._rank, self._grace, self._state_dir = rank, grace_seconds, state_dir
        self._phase, self._in_flight, self._flush_ledger, self._loop_left = phase, in_flight, flush_ledger, loop_left
        self._leave, self._clock = leave, clock

    def on_sigterm(self) -> None:
        """SIGTERM arrived (called on a thread of its own): wait out the grace, then give up if still short."""
        if self.reached.wait(self._grace):
            return
        while not self.reached.is_set():
            if self._loop_left():
                return  # what remains is the loop's ending (its last checkpoint, a linger), not a hang
            phase, since = self._phase()
            # A rank still moving through its step (a phase younger than the grace: a long step, not a hang)
            # may yet reach the boundary; one held in a phase for the whole grace does not.
            if phase not in _WORKING_PHASES and self._clock() - since >= self._grace:
                self.give_up()
                return
            self.reached.wait(_POLL_SECONDS)

    def give_up(self) -> None:
        """Stacks, ledger, one line, exit."""
        answer = own_stacks(self._rank, self._in_flight)  # reads the collective view first: the phase is fresh
        phase, since = self._phase()
        answer.update(phase=phase, phase_since=since)
        why = self.reason(answer)
        where = self._write(answer, why)
        try:
            ledger = "; goodput ledger written" if self._flush_ledger() else ""
        except Exception as exc:  # the line and the exit matter more
            ledger = f"; goodput ledger not written ({type(exc).__name__}: {exc})"
        logger.error(
            "rankscope: rank %d: SIGTERM: no checkpoint written: %s; %s%s; exiting with status %d",
            self._rank, why, where, ledger, UNCHECKPOINTED_EXIT_STATUS,
        )  # fmt: skip
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.flush()
        if self.reached.is_set():  # the stop was agreed meanwhile: the loop checkpoints and exits 0 itself
            logger.error("rankscope: rank %d: the stop was agreed after all; not exiting here", self._rank)
            return
        try:  # the exit runs no atexit hook: DataLoader workers, which ignore SIGTERM, are ended here
            end_daemon_children()
        except Exception:
            logger.exception("rankscope: rank %d: ending the DataLoader workers failed", self._rank)
        end_all("stop deadline")  # os._exit runs no atexit hook
        self._leave(UNCHECKPOINTED_EXIT_STATUS)

    def reason(self, answer: dict[str, Any]) -> str:
        """Why the stop did not happen, from this rank's side: it did not reach the boundary, or it waits for a
        peer that did not."""
        phase, collective = answer["phase"], answer.get("collective")
        since = f"since {_clock_time(answer['phase_since'])}"
        grace = f"within control.stop_grace_seconds={self._grace:g}"
        if collective is not None or phase in _WAITING_PHASES:
            what = f"{collective['kind']} ({collective['dim']})" if collective is not None else f"phase {phase}"
            return f"a peer did not reach the step boundary {grace} (rank {self._rank} waits in {what} {since})"
        return (
            f"rank {self._rank} did not reach the step boundary {grace}: it is in phase {phase} {since} "
            "with no collective in flight"
        )

    def _write(self, answer: dict[str, Any], why: str) -> str:
        """The stacks beside the checkpoints; where they are, for the line."""
        by_rank = {self._rank: answer}
        if self._state_dir:
            header = f"rank {self._rank}: SIGTERM: no checkpoint written: {why}\nphase: {answer['phase']}"
            try:
                label = f"sigterm-{int(self._clock())}-rank{self._rank}"
                return f"stacks in {write_stacks(self._state_dir, by_rank, label, header)}"
            except OSError as exc:
                failure = f"stacks not written to {Path(self._state_dir)} ({exc})"
        else:
            failure = "no control.state_dir for the stacks"
        logger.error("rankscope: rank %d: stacks at SIGTERM:\n%s", self._rank, render(fold(by_rank)))
        return f"{failure}: they are in the log above"


def _clock_time(unix: float) -> str:
    return time.strftime("%H:%M:%SZ", time.gmtime(unix))
