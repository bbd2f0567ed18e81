"""The handler contract of the two recovery actions, `rollback` and `reduce_micro_batch`.

A loop that implements them gives its handler (the object passed to `at_step_boundary`) these
methods; one that does not gets the outcome "unsupported", and nothing changes:

    def rollback(self, request: RollbackRequest) -> RollbackDone: ...
        # load the first readable checkpoint of request.checkpoint_order(its steps) (every rank the same one):
        # the newest written before request.before_step (a loop that keeps its step losses may take a
        # newer one written before they left their level: request.onset_window_steps; one that knows when
        # its checkpoints were written, the newest written before request.before_time where that is set; with
        # none kept before the bound, a loop that keeps its step losses may still load one written before they
        # left their level, if they reach back to its oldest kept checkpoint and stayed at their level since),
        # skip request.window(checkpoint step, batches trained since it) batches of data after it (and,
        # if it can read ahead, up to request.lookahead_batches more that the restored model finds bad),
        # multiply the learning rates by
        # request.lr_factor; record what was skipped so that a resumed run skips it too.
    def reduce_micro_batch(self, reason: str) -> MicroBatchChange: ...
        # halve the micro-batch and double gradient accumulation from the next step on, so that
        # the global batch, the learning-rate schedule and the loss scale stay as they were.

Either may raise `ActionUnavailable("<one line>")` when its state does not allow it (no checkpoint
before the incident, a micro-batch of 2 that cannot be halved): the outcome is then
"refused_unavailable", and the loop must not have changed anything. Any other exception is "failed".
Every rank is called at the same step with the same request and must answer alike.

No torch here: the CLI and the rule generator import the catalog, which names these actions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ActionUnavailable", "MicroBatchChange", "RollbackDone", "RollbackRequest"]


class ActionUnavailable(Exception):
    """The loop cannot carry the action out in its present state (one-line reason); nothing was changed."""


@dataclass(frozen=True)
class RollbackRequest:
    """What every rank is asked to roll back to; decided once on rank 0."""

    before_step: int
    """Load the newest checkpoint with a step below this one."""
    incident_step: int
    """The step at which the incident began (the alert's startsAt), for the default skip window."""
    skip_batches: int | None
    """Batches of data to skip after the checkpoint; None: the default window (`window`)."""
    margin_batches: int
    lr_factor: float
    """Multiply every learning rate by this after loading (1.0: unchanged)."""
    reason: str
    lookahead_batches: int = 0
    """A loop that can read its data ahead may skip on past the window while the restored model finds the
    batches bad, up to this many more (0: the window alone; not with an explicit skip_batches)."""
    onset_window_steps: int = 0
    """A loop that keeps its step losses may load a newer checkpoint, written before the loss left its level
    (the median of this many steps' losses; 0: the newest before `before_step`, as `checkpoint_order` says)."""
    before_time: float | None = None
    """Set with `from_start` (the lookback reaches past this process's first step): the Unix time it reaches. A
    loop that knows when its checkpoints were written, also before a restart, loads the newest written before
    it (`checkpoint_order`'s oldest-first order is for a loop that does not)."""

    def window(self, checkpoint_step: int, trained_batches: int = 0) -> int:
        """How many batches to skip after a checkpoint at `checkpoint_step`, given the `trained_batches` the run
        consumed after that checkpoint before rolling back. By default every batch from the checkpoint through
        the incident or through where the run was, whichever is later, plus the margin: the data trained while
        the alert waited for its `for` and its answer is suspect too (a poisoned stretch would train in again)."""
        if self.skip_batches is not None:
            return self.skip_batches
        return max(0, self.incident_step - checkpoint_step, trained_batches) + self.margin_batches

    @property
    def from_start(self) -> bool:
        """Whether the rollback reaches back past the first step this run (this process) trained: before step 1, as
        the channel asks when an alert's lookback reaches past it. No checkpoint is older than that."""
        return self.before_step <= 1

    @property
    def checkpoint_bound(self) -> int:
        """Every checkpoint a rollback may load is below this step: `before_step`, or from the start the incident."""
        return self.incident_step if self.from_start else self.before_step

    def checkpoint_order(self, steps: Iterable[int]) -> list[int]:
        """The checkpoint steps a rollback may load, in the order to try them: those before `before_step`, newest
        first; from the start, those before the incident, oldest first (the nearest there is to the start)."""
        return sorted({s for s in steps if s < self.checkpoint_bound}, reverse=not self.from_start)

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RollbackDone:
    """What a rank did: the checkpoint it loaded and the data it skipped."""

    checkpoint_step: int
    checkpoint: str
    """The checkpoint's path or name."""
    skipped_batches: int
    detail: str = ""
    """One line for the outcome, e.g. which data positions were skipped."""


@dataclass(frozen=True)
class MicroBatchChange:
    """A micro-batch halved, from the next step on."""

    micro_batch: int
    """Samples per micro-batch now (per rank)."""
    accumulation_steps: int
    """Micro-batches per optimizer step now."""
    previous_micro_batch: int
    previous_accumulation_steps: int
