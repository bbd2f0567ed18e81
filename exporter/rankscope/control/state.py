"""State shared between rank 0's HTTP thread and its training thread.

The HTTP thread submits requests and reads status; the training thread takes
pending requests at a step boundary, settles them and publishes the run's
progress. Both classes hold a lock for exactly that reason, and hand out
copies, never their live objects.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rankscope.control.actions import ActionRequest, RequestError
from rankscope.control.catalog import check_result

__all__ = ["ActionQueue", "ActionRecord", "RunSnapshot", "Submitted"]

#: Idempotency keys remembered; far more alert episodes than a run sees.
_SEEN_KEYS = 4096


@dataclass(frozen=True)
class ActionRecord:
    """One request and, once settled, what came of it."""

    id: str
    action: str
    source: str
    reason: str
    params: dict[str, float]
    received_at: float
    """Unix time the endpoint accepted it."""
    status: str = "pending"
    """"pending" until settled, then one of actions.RESULTS."""
    step: int | None = None
    """The step boundary at which it was settled (applied on every rank at this step)."""
    settled_at: float | None = None
    detail: str = ""
    """Why it was refused or failed, in one line."""
    started_at: float | None = None
    """For an alert: Unix time its incident began (startsAt); `rollback` goes back to before it."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Submitted:
    """The answer to one submitted request."""

    id: str
    duplicate: bool


class ActionQueue:
    """Pending requests, recent outcomes and the alert keys already seen.

    Locked because the HTTP thread submits and reads while rank 0's training
    thread takes and settles; a condition lets a paused loop wake as soon as
    a request arrives instead of at its next heartbeat.
    """

    def __init__(
        self,
        max_pending: int = 64,
        recent: int = 100,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._max_pending = max_pending
        self._clock = clock
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._pending: deque[ActionRecord] = deque()
        # Taken by the training thread, not yet settled (e.g. a checkpoint being written): still "pending".
        self._taken: dict[str, ActionRecord] = {}
        self._recent: deque[ActionRecord] = deque(maxlen=recent)
        self._seen: OrderedDict[str, str] = OrderedDict()
        self._stopping = False
        # A random prefix keeps ids of a restarted run apart from the previous run's.
        self._prefix = secrets.token_hex(3)
        self._counter = itertools.count(1)

    def submit(self, requests: Iterable[ActionRequest]) -> list[Submitted]:
        """Queue requests atomically: all of them, or (on RequestError) none.

        A request whose idempotency key was seen before is answered with the
        first one's id and queued again never. 409 once a stop is queued; 503
        when the queue is full (a retry later may succeed).
        """
        with self._lock:
            # Each answer is either a duplicate's Submitted or the index of a fresh request.
            answers: list[Submitted | int] = []
            fresh: list[ActionRequest] = []
            first_in_batch: dict[str, int] = {}
            for request in requests:
                if request.key is not None and request.key in self._seen:
                    answers.append(Submitted(self._seen[request.key], duplicate=True))
                elif request.key is not None and request.key in first_in_batch:
                    answers.append(-1 - first_in_batch[request.key])  # a repeat inside one payload
                else:
                    if request.key is not None:
                        first_in_batch[request.key] = len(fresh)
                    answers.append(len(fresh))
                    fresh.append(request)
            if fresh and self._stopping:
                raise RequestError(409, "the run is stopping; no further actions are accepted")
            if len(self._pending) + len(fresh) > self._max_pending:
                raise RequestError(503, f"{len(self._pending)} actions already pending; retry later")
            now = self._clock()
            records = [
                ActionRecord(
                    id=f"{self._prefix}-{next(self._counter)}",
                    action=request.action,
                    source=request.source,
                    reason=request.reason,
                    params=dict(request.params),
                    received_at=now,
                    started_at=request.started_at,
                )
                for request in fresh
            ]
            for request, record in zip(fresh, records, strict=True):
                self._pending.append(record)
                if request.key is not None:
                    self._remember(request.key, record.id)
                if request.action == "stop":
                    self._stopping = True
            if records:
                self._arrived.notify_all()
        return [
            answer
            if isinstance(answer, Submitted)
            else Submitted(records[answer].id, duplicate=False)
            if answer >= 0
            else Submitted(records[-1 - answer].id, duplicate=True)
            for answer in answers
        ]

    def _remember(self, key: str, action_id: str) -> None:
        self._seen[key] = action_id
        while len(self._seen) > _SEEN_KEYS:
            self._seen.popitem(last=False)

    def take(self) -> list[ActionRecord]:
        """Every pending request, oldest first; they stay "pending" (in status too) until settled."""
        with self._lock:
            taken = list(self._pending)
            self._pending.clear()
            self._taken.update((record.id, record) for record in taken)
            return taken

    def start(self, request: ActionRequest) -> ActionRecord:
        """A request that did not come over HTTP (a signal), taken at once: pending until settled."""
        with self._lock:
            record = ActionRecord(
                id=f"{self._prefix}-{next(self._counter)}",
                action=request.action,
                source=request.source,
                reason=request.reason,
                params=dict(request.params),
                received_at=self._clock(),
            )
            self._taken[record.id] = record
            if request.action == "stop":
                self._stopping = True
            return record

    def adopt(self, record: ActionRecord) -> ActionRecord:
        """A request taken by an earlier incarnation of this run (a `restart` in flight across the exit):
        pending in status until settled here."""
        with self._lock:
            self._taken[record.id] = record
        return record

    def note(self, record: ActionRecord, detail: str) -> ActionRecord:
        """Attach a one-line detail to a taken, not yet settled request (e.g. what it waits for)."""
        noted = replace(record, detail=detail)
        with self._lock:
            if record.id in self._taken:
                self._taken[record.id] = noted
        return noted

    def settle(self, record: ActionRecord, status: str, step: int, detail: str = "") -> ActionRecord:
        """Record the outcome of a taken request (one of catalog.RESULTS: what /v1/status and the docs promise)."""
        check_result(status)
        settled = replace(record, status=status, step=step, settled_at=self._clock(), detail=detail)
        with self._lock:
            self._taken.pop(record.id, None)
            self._recent.append(settled)
        return settled

    def wait_for_pending(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until something is pending; True if it is."""
        with self._arrived:
            return self._arrived.wait_for(lambda: bool(self._pending), timeout=timeout)

    def accept_again(self) -> None:
        """A stop did not happen (failed, or the loop trained on): new requests are accepted again."""
        with self._lock:
            self._stopping = False

    @property
    def stopping(self) -> bool:
        with self._lock:
            return self._stopping

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Pending and recent (newest last) actions, as JSON-ready copies."""
        with self._lock:
            return {
                "pending": [r.to_json() for r in (*self._taken.values(), *self._pending)],
                "recent": [r.to_json() for r in self._recent],
            }


@dataclass
class _Progress:
    step: int = 0
    learning_rates: list[float] = field(default_factory=list)
    paused: bool = False
    paused_since: float | None = None
    stop_requested: bool = False


class RunSnapshot:
    """The run's progress as rank 0's training thread last saw it, for GET /v1/status.

    Locked because the training thread writes it at every step boundary while
    the HTTP thread reads it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress = _Progress()

    def update(self, **changes: Any) -> None:
        """Set any of: step, learning_rates, paused, paused_since, stop_requested."""
        with self._lock:
            for name, value in changes.items():
                if not hasattr(self._progress, name):
                    raise AttributeError(f"RunSnapshot has no field {name!r}")
                setattr(self._progress, name, list(value) if isinstance(value, list) else value)

    def read(self) -> dict[str, Any]:
        with self._lock:
            return asdict(self._progress)
