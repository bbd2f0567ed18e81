"""The `restart` action: get a hung job training again, and say truly whether it did.

A hung rank never reaches a step boundary, so `restart` is carried out at once, on rank 0's endpoint
thread, never through the boundary exchange:

1. refused at once, in one line, when it cannot happen: no `control.state_dir` (the record could not
   outlive the exit), not under torchrun or no restart left (`TORCHELASTIC_MAX_RESTARTS` /
   `TORCHELASTIC_RESTART_COUNT`), its cap or cooldown. Nothing changes then; the run goes on.
2. else every rank's stacks are gathered over HTTP and written to the state dir (beside the
   checkpoints); rank 0's training thread is held at its next step boundary, so a loop that is not hung
   stops training too; the pending record is written to the state dir (with the step the group exits
   at), every other rank is told to leave, and rank 0 leaves: every rank exits with RESTART_EXIT_STATUS
   (75, EX_TEMPFAIL), so torchrun (`--max-restarts N`) starts the group again and the loop resumes from
   its newest checkpoint.
3. the new incarnation's rank 0 reads the record back and settles it `applied` once the restarted
   group has trained a step; the steps lost (completed after the newest checkpoint when the group
   exited) are counted in rankscope_restart_lost_steps_total and in the record's detail.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rankscope._files import write_atomically
from rankscope.control.actions import ActionRequest
from rankscope.control.config import ControlConfig
from rankscope.control.stacks import (
    GATHER_PARALLEL,
    InFlightReader,
    fold,
    gather,
    own_stacks,
    render,
    write_stacks,
)
from rankscope.control.state import ActionQueue, ActionRecord, RunSnapshot
from rankscope.exits import end_all

__all__ = ["RESTART_EXIT_STATUS", "RestartLedger", "Restarter", "restarts_left"]

logger = logging.getLogger("rankscope")

#: Every rank leaves with this status on `restart` (EX_TEMPFAIL: "try again"); torchrun, Kubernetes
#: (restartPolicy / podFailurePolicy) and Slurm (--requeue) restart on it.
RESTART_EXIT_STATUS = 75
#: The record that outlives the exit, in control.state_dir.
LEDGER_FILE = "rankscope-restart.json"
#: Seconds a restart waits for rank 0's training thread to reach its next step boundary and stop there (a
#: hung one never does; a step longer than this is caught by the exit step's second reading).
_FREEZE_WAIT_SECONDS = 2.0
#: Rank 0 in one collective this long waits for a peer (the hung one): the boundary wait is skipped.
_STUCK_COLLECTIVE_SECONDS = 2.0
#: Seconds rank 0 waits after telling the others, so its own 202 answer and their exits go out first.
_GRACE_SECONDS = 0.3
#: Idempotency keys of restart alerts remembered across incarnations (an alert re-sent to the new
#: incarnation must not restart it again).
_KEYS = 64


def restarts_left(env: Mapping[str, str]) -> tuple[int, str]:
    """(restarts torchrun has left, "" or the one-line reason there are none)."""
    maximum = env.get("TORCHELASTIC_MAX_RESTARTS")
    if maximum is None:
        return 0, "not launched by torchrun (TORCHELASTIC_MAX_RESTARTS is unset): nothing would start the group again"
    try:
        left = int(maximum) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0, f"TORCHELASTIC_MAX_RESTARTS={maximum!r} is not a number"
    if left <= 0:
        used = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return 0, f"no restart left: torchrun --max-restarts {maximum}, {used} already used"
    return left, ""


@dataclass
class RestartLedger:
    """What outlives a restart, in `<state_dir>/rankscope-restart.json`."""

    applied: int = 0
    last_exit_at: float | None = None
    """Unix time of the last restart's exit (its cooldown counts from there)."""
    lost_steps: int = 0
    """Steps lost to every restart of the run so far."""
    pending: dict[str, Any] | None = None
    """The restart whose group has not trained a step yet: its record, exit step and time."""
    keys: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, directory: str) -> RestartLedger:
        path = Path(directory) / LEDGER_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            logger.warning("rankscope: %s unreadable (%s); starting a fresh restart record", path, exc)
            return cls()
        return cls(**{k: raw[k] for k in ("applied", "last_exit_at", "lost_steps", "pending", "keys") if k in raw})

    def save(self, directory: str) -> None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        data = json.dumps(asdict(self), indent=1).encode("utf-8")
        write_atomically(folder / LEDGER_FILE, lambda handle: handle.write(data), sync_directory=True)


class Restarter:
    """Rank 0's `restart`: decided and carried out off the training thread (see the module docstring)."""

    def __init__(
        self,
        config: ControlConfig,
        queue: ActionQueue,
        snapshot: RunSnapshot,
        *,
        peers: Callable[[], dict[int, str]],
        token: str | None,
        count: Callable[[str, str, str], None],
        lost: Callable[[int], None] = lambda steps: None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        leave: Callable[[int], None] = os._exit,
        in_flight: InFlightReader | None = None,
        before_exit: Callable[[], None] = lambda: None,
    ) -> None:
        self._config = config
        self._in_flight = in_flight
        self._before_exit = before_exit
        self._queue = queue
        self._snapshot = snapshot
        self._peers = peers
        self._token = token
        self._count = count
        self._lost = lost
        self._env = os.environ if env is None else env
        self._clock = clock
        self._leave = leave
        self._lock = threading.Lock()
        self._under_way: ActionRecord | None = None
        # A restart under way holds the training thread at its next boundary (after_step) until the exit.
        self._freeze, self._frozen, self._thawed = threading.Event(), threading.Event(), threading.Event()
        self._state_dir = config.state_dir
        self.ledger = RestartLedger.load(self._state_dir) if self._state_dir else RestartLedger()
        self._resumed: ActionRecord | None = None
        if self.ledger.pending is not None:
            self._resumed = queue.adopt(_record_from(self.ledger.pending))

    # --- rank 0's endpoint thread --------------------------------------------------------

    def submit(self, request: ActionRequest) -> tuple[ActionRecord, bool]:
        """Decide on a `restart` request now: (its record, whether it is a duplicate)."""
        with self._lock:
            if request.key is not None and request.key in self.ledger.keys:
                record = self._find(request.key)
                return record, True
            record = self._queue.start(request)
            refusal = self._refusal()
            if refusal is not None:
                return self._settle(record, *refusal), False
            self._under_way = record
            if request.key is not None:
                self.ledger.keys = [*self.ledger.keys, request.key][-_KEYS:]
        threading.Thread(target=self._carry_out, args=(record,), name="rankscope-restart", daemon=True).start()
        return record, False

    def _find(self, key: str) -> ActionRecord:
        pending = self.ledger.pending or {}
        if self._resumed is not None and pending.get("key") == key:
            return self._resumed
        if self._under_way is not None:
            return self._under_way
        return ActionRecord("restarted", "restart", "alert", key, {}, self._clock(), status="duplicate")

    def _refusal(self) -> tuple[str, str] | None:
        if self._under_way is not None:
            return "noop", f"restart {self._under_way.id} is already under way"
        if self._resumed is not None and self.ledger.pending is not None:
            return "noop", f"restart {self._resumed.id} is waiting for the restarted group's first step"
        if not self._state_dir:
            return "refused_unavailable", (
                "control.state_dir is not set: the restart's record could not outlive the exit (set it to the "
                "checkpoint directory)"
            )
        left, reason = restarts_left(self._env)
        if not left:
            return "refused_unavailable", reason
        if self._config.restart_max and self.ledger.applied >= self._config.restart_max:
            return "refused_cap", f"restart reached its cap of {self._config.restart_max} applications"
        if self.ledger.last_exit_at is not None:
            elapsed = self._clock() - self.ledger.last_exit_at
            if elapsed < self._config.restart_cooldown_seconds:
                return "refused_cooldown", (
                    f"restart applied {elapsed:.1f}s ago; cooldown is {self._config.restart_cooldown_seconds:g}s"
                )
        return None

    def _carry_out(self, record: ActionRecord) -> None:
        """Stacks, record, every rank out. Runs on its own thread: the endpoint has answered 202 already."""
        try:
            label = f"restart-{int(self._clock())}"
            peers = self._peers()
            by_rank = {0: own_stacks(0, self._in_flight), **gather(peers, self._token)}
            path = write_stacks(self._state_dir, by_rank, label)
            logger.warning("rankscope: restart %s: stacks in %s: %s", record.id, path, render(fold(by_rank), False))
            # A loop that is not hung trains on meanwhile: rank 0's training thread is held at its next step
            # boundary (the others then wait in their next collective), so the step read here is the step the
            # group exits at. A hung rank 0 never arrives; its step does not move either. Rank 0 long in a
            # collective waits for the hung peer: no boundary comes before the exit, so none is waited for.
            self._thawed.clear()
            self._frozen.clear()
            self._freeze.set()
            waiting = _waiting_in_collective(by_rank[0], self._clock())
            if waiting is None:
                self._frozen.wait(_FREEZE_WAIT_SECONDS)
            step = int(self._snapshot.read()["step"])
            self.ledger.pending = {
                **record.to_json(),
                "key": self.ledger.keys[-1] if self.ledger.keys else None,
                "exit_step": step,
                "exited_at": self._clock(),
                "restart_count": int(self._env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "stacks": str(path),
                "rank0_waiting": waiting,
            }
            self.ledger.last_exit_at = self.ledger.pending["exited_at"]
            self.ledger.save(self._state_dir)
            note = f"every rank exits with status {RESTART_EXIT_STATUS} at step {step}"
            self._queue.note(record, note if waiting is None else f"{note} ({waiting})")
        except Exception as exc:  # nothing left the run: say so, and let a later request try again
            logger.exception("rankscope: restart %s failed before any rank left", record.id)
            with self._lock:
                self._under_way = None
                self.ledger.pending = None
            self._thaw()
            self._settle(record, "failed", f"{type(exc).__name__}: {exc}"[:200])
            return
        # What must be on disk at the exit (the goodput ledger) is written before any rank leaves: torchrun
        # stops rank 0 once a peer has exited, and leave() is os._exit, which runs no atexit hook.
        try:
            self._before_exit()
        except Exception:
            logger.exception("rankscope: restart %s: writing the state before the exit failed", record.id)
        # os._exit runs no atexit hook, and torchrun stops rank 0 as soon as a peer has left: the note of how this
        # process ends is written now, or the next process may call it vanished (a false page).
        end_all("restart")
        tell_peers_to_leave(peers, self._token)
        logger.warning("rankscope: restart %s: rank 0 exits with status %d", record.id, RESTART_EXIT_STATUS)
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.flush()
        time.sleep(_GRACE_SECONDS)
        self._note_exit_step()
        self._leave(RESTART_EXIT_STATUS)

    def _thaw(self) -> None:
        self._freeze.clear()
        self._thawed.set()

    def _note_exit_step(self) -> None:
        """The pending record's exit step, brought up to the step rank 0 has reached now (a slow step that
        ended after the freeze's wait): what is lost is counted from the moment of exit."""
        try:
            step = int(self._snapshot.read()["step"])
            pending = self.ledger.pending
            if pending is not None and step > int(pending["exit_step"]):
                pending["exit_step"] = step
                self.ledger.save(self._state_dir)
        except Exception:
            logger.exception("rankscope: restart: updating the exit step failed (the one recorded stands)")

    # --- the new incarnation's training thread -------------------------------------------

    def after_step(self, step: int) -> None:
        """Rank 0, at every step boundary: the first one after a restart settles it `applied`; while a restart
        is carried out, the training thread is held here until the process exits."""
        if self._freeze.is_set():
            self._frozen.set()
            self._thawed.wait()  # set only if the restart failed before any rank left
        if self._resumed is None or self.ledger.pending is None:
            return
        pending = self.ledger.pending
        resumed_from = step - 1  # the boundary of the first step trained from the checkpoint
        lost = max(0, int(pending["exit_step"]) - resumed_from)
        self.ledger.applied += 1
        self.ledger.lost_steps += lost
        self.ledger.pending = None
        self.ledger.save(self._state_dir)
        self._lost(lost)
        detail = (
            f"the restarted group trained step {step} from step {resumed_from}; {lost} step(s) after the newest "
            f"checkpoint lost (exited at step {pending['exit_step']}"
            + (f"; {pending['rank0_waiting']}" if pending.get("rank0_waiting") else "")
            + f"); stacks in {pending['stacks']}"
        )
        logger.warning("rankscope: restart %s applied: %s", self._resumed.id, detail)
        self._settle(self._resumed, "applied", detail, step)
        self._resumed = None

    def _settle(self, record: ActionRecord, result: str, detail: str, step: int | None = None) -> ActionRecord:
        at = int(self._snapshot.read()["step"]) if step is None else step
        settled = self._queue.settle(record, result, at, detail)
        self._count(settled.action, settled.source, result)
        if result != "applied":
            logger.warning("rankscope: control %s restart (%s): %s %s", settled.id, settled.reason, result, detail)
        return settled


def _waiting_in_collective(stacks: Mapping[str, Any], now: float) -> str | None:
    """The note "rank 0 has waited N s in <kind> (<dim>): ..." when rank 0's stacks show a collective in flight for
    `_STUCK_COLLECTIVE_SECONDS` or more: it waits for a peer (the hung one a restart is for) and reaches no step
    boundary before the exit, so waiting for one only adds to the hang. None otherwise: a young collective is
    a loop that is training, which the wait stops at its next boundary."""
    collective = stacks.get("collective")
    if not isinstance(collective, Mapping) or not isinstance(collective.get("since"), int | float):
        return None
    waited = now - float(collective["since"])
    if waited < _STUCK_COLLECTIVE_SECONDS:
        return None
    return (
        f"rank 0 has waited {waited:.1f} s in {collective.get('kind', 'a collective')} ({collective.get('dim', '?')}):"
        " no step boundary to wait for"
    )


def tell_peers_to_leave(peers: Mapping[int, str], token: str | None, timeout: float = 2.0) -> None:
    """POST /v1/exit to every other rank; one that does not answer is left to torchrun's agent, which
    stops the whole group when rank 0 exits."""

    def post(url: str) -> None:
        request = urllib.request.Request(f"{url}/v1/exit", data=b"{}", method="POST")
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            urllib.request.urlopen(request, timeout=timeout).close()
        except (OSError, urllib.error.HTTPError) as exc:
            logger.warning("rankscope: restart: %s did not take the exit request (%s)", url, exc)

    if peers:
        with ThreadPoolExecutor(max_workers=min(GATHER_PARALLEL, len(peers))) as pool:
            list(pool.map(post, peers.values()))


def _record_from(pending: dict[str, Any]) -> ActionRecord:
    fields = ActionRecord.__dataclass_fields__
    values = {k: v for k, v in pending.items() if k in fields}
    values.update(status="pending", detail="the group restarted; waiting for it to train a step")
    return ActionRecord(**values)
