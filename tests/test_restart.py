"""The `restart` action (issue 26): decided at once, true across the process boundary.

Two Restarter objects over one state directory stand for two incarnations of rank 0; `leave` records
the exit status instead of ending pytest. The end-to-end run with torchrun is tests/e2e/test_hangs.py.
"""

from __future__ import annotations

import json
import threading

import pytest
from rankscope.control.app import AppDeps, create_app
from rankscope.control.config import ControlConfig
from rankscope.control.restart import LEDGER_FILE, RESTART_EXIT_STATUS, Restarter, restarts_left
from rankscope.control.state import ActionQueue, RunSnapshot

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UNDER_TORCHRUN = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0"}


class Incarnation:
    """Rank 0 of one incarnation: its queue, snapshot, counted outcomes and exit."""

    def __init__(self, state_dir, env, clock=lambda: 1000.0, peers=None, in_flight=None, **settings):
        self.queue, self.snapshot = ActionQueue(), RunSnapshot()
        self.events: list[str] = []
        self.counted: list[tuple[str, str, str]] = []
        self.lost: list[int] = []
        self.left = threading.Event()
        self.status: int | None = None
        config = ControlConfig(state_dir=str(state_dir) if state_dir else "", **settings)
        self.restarter = Restarter(
            config, self.queue, self.snapshot, peers=peers or (lambda: {}), token=TOKEN,
            count=lambda *outcome: self.counted.append(outcome), lost=self.lost.append, env=env, clock=clock,
            leave=self._leave, before_exit=lambda: self.events.append("before_exit"), in_flight=in_flight,
        )  # fmt: skip
        self.app = create_app(AppDeps(self.queue, self.snapshot, TOKEN, immediate=self.restarter.submit))

    def _leave(self, status: int) -> None:
        self.events.append("leave")
        self.status = status
        self.left.set()

    def recent(self) -> list[dict]:
        return self.queue.snapshot()["recent"]

    def pending(self) -> list[dict]:
        return self.queue.snapshot()["pending"]


def test_restarts_left_reads_torchruns_environment():
    assert restarts_left(UNDER_TORCHRUN) == (1, "")
    left, reason = restarts_left({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert left == 0 and reason == "no restart left: torchrun --max-restarts 1, 1 already used"
    assert restarts_left({})[1].startswith("not launched by torchrun (TORCHELASTIC_MAX_RESTARTS is unset)")


@pytest.mark.parametrize(
    ("env", "state", "expected"),
    [
        ({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "2"}, True, "no restart left"),
        ({}, True, "not launched by torchrun"),
        (UNDER_TORCHRUN, False, "control.state_dir is not set"),
    ],
)
def test_a_restart_that_cannot_happen_is_refused_in_one_line_and_nothing_changes(
    wsgi_call, tmp_path, env, state, expected
):
    rank0 = Incarnation(tmp_path if state else None, env)
    rank0.snapshot.update(step=7)
    status, _, body = wsgi_call(rank0.app, "POST", "/v1/actions", {"action": "restart", "reason": "hung"}, AUTH)
    assert status == 202
    assert body["status"] == "refused_unavailable" and body["detail"].startswith(expected)
    assert "\n" not in body["detail"]
    [record] = rank0.recent()
    assert (record["status"], record["step"]) == ("refused_unavailable", 7)
    assert rank0.counted == [("restart", "operator", "refused_unavailable")]
    assert rank0.status is None and not list(tmp_path.iterdir())  # no exit, no file


def test_restart_never_enters_the_step_boundary_exchange(wsgi_call, tmp_path):
    # An earlier attempt queued it: take() handed `restart` to the boundary exchange (KeyError there).
    rank0 = Incarnation(None, {})
    alert = {"status": "firing", "labels": {"alertname": "RankscopeRankHung", "action": "restart"},
             "annotations": {}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "f1"}  # fmt: skip
    notification = {"version": "4", "status": "firing", "alerts": [alert]}
    wsgi_call(rank0.app, "POST", "/v1/alerts", notification, AUTH)
    wsgi_call(rank0.app, "POST", "/v1/actions", {"action": "restart"}, AUTH)
    assert rank0.queue.take() == []
    assert [r["status"] for r in rank0.recent()] == ["refused_unavailable", "refused_unavailable"]


def test_restart_exits_every_rank_and_the_next_incarnation_settles_it_after_a_step(wsgi_call, tmp_path):
    first = Incarnation(tmp_path, UNDER_TORCHRUN, peers=None)
    first.snapshot.update(step=10)

    def peers():  # the loop trained two more steps while the request was being carried out
        first.snapshot.update(step=12)
        return {}

    first.restarter._peers = peers
    status, _, body = wsgi_call(first.app, "POST", "/v1/actions", {"action": "restart", "reason": "hung"}, AUTH)
    assert (status, body["status"]) == (202, "pending")
    assert first.left.wait(10) and first.status == RESTART_EXIT_STATUS
    # What has to be on disk at the moment of exit (the goodput ledger: the hang ran until now) is written
    # first; os._exit runs no atexit hook.
    assert first.events == ["before_exit", "leave"]
    ledger = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert ledger["pending"]["exit_step"] == 12  # the moment of exit, not of the request
    assert (tmp_path / "rankscope-stacks-restart-1000.txt").read_text().startswith("rank 0: ")
    assert first.recent() == []  # not settled by the incarnation that exits

    second = Incarnation(tmp_path, {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    [pending] = second.pending()
    assert (pending["id"], pending["action"], pending["status"]) == (body["id"], "restart", "pending")
    second.restarter.after_step(9)  # resumed from the checkpoint at step 8
    [record] = second.recent()
    assert (record["id"], record["status"], record["step"]) == (body["id"], "applied", 9)
    assert "4 step(s) after the newest checkpoint lost" in record["detail"]  # 12 - 8
    assert second.lost == [4]
    assert second.counted == [("restart", "operator", "applied")]
    assert json.loads((tmp_path / LEDGER_FILE).read_text())["pending"] is None


def test_steps_the_group_trains_while_its_ranks_are_told_to_leave_are_counted_lost(wsgi_call, tmp_path):
    """A restart of a job that is not hung: the loop trains on while the stacks are gathered, the peers are
    told to leave and rank 0 waits out its grace. The lost steps count up to rank 0's last step before its exit
    (the Lightning restart test saw 3 counted for 12 lost when the step was read only before the peers left)."""
    first = Incarnation(tmp_path, UNDER_TORCHRUN)
    first.snapshot.update(step=10)
    first.restarter._before_exit = lambda: first.snapshot.update(step=19)  # trained on until the exit
    status, _, body = wsgi_call(first.app, "POST", "/v1/actions", {"action": "restart", "reason": "test"}, AUTH)
    assert status == 202 and first.left.wait(10)
    assert json.loads((tmp_path / LEDGER_FILE).read_text())["pending"]["exit_step"] == 19

    second = Incarnation(tmp_path, {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    second.restarter.after_step(9)  # resumed from the checkpoint at step 8
    [record] = second.recent()
    assert "11 step(s) after the newest checkpoint lost (exited at step 19)" in record["detail"], record
    assert second.lost == [11]


def test_cooldown_and_cap_hold_across_the_restart(wsgi_call, tmp_path):
    (tmp_path / LEDGER_FILE).write_text(json.dumps({"applied": 1, "last_exit_at": 990.0, "lost_steps": 4}))
    env = {"TORCHELASTIC_MAX_RESTARTS": "5", "TORCHELASTIC_RESTART_COUNT": "1"}
    cooling = Incarnation(tmp_path, env, clock=lambda: 1000.0, restart_cooldown_seconds=60)
    _, _, body = wsgi_call(cooling.app, "POST", "/v1/actions", {"action": "restart"}, AUTH)
    assert body["status"] == "refused_cooldown"
    capped = Incarnation(tmp_path, env, clock=lambda: 5000.0, restart_max=1)
    _, _, body = wsgi_call(capped.app, "POST", "/v1/actions", {"action": "restart"}, AUTH)
    assert body["status"] == "refused_cap"
    assert cooling.status is None and capped.status is None


def test_an_alert_resent_to_the_new_incarnation_does_not_restart_it_again(wsgi_call, tmp_path):
    alert = {"status": "firing", "labels": {"alertname": "RankscopeRankHung", "action": "restart"},
             "annotations": {}, "startsAt": "2026-01-01T00:00:00Z", "fingerprint": "f1"}  # fmt: skip
    notification = {"version": "4", "status": "firing", "alerts": [alert]}
    first = Incarnation(tmp_path, UNDER_TORCHRUN)
    status, _, body = wsgi_call(first.app, "POST", "/v1/alerts", notification, AUTH)
    assert status == 202 and first.left.wait(10)
    second = Incarnation(tmp_path, {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "1"})
    status, _, body = wsgi_call(second.app, "POST", "/v1/alerts", notification, AUTH)
    assert (status, body["duplicates"][0]["id"]) == (200, first.queue.snapshot()["pending"][0]["id"])
    assert second.status is None


def test_restart_while_one_is_under_way_is_a_noop(wsgi_call, tmp_path):
    rank0 = Incarnation(tmp_path, UNDER_TORCHRUN)
    release = threading.Event()
    rank0.restarter._peers = lambda: release.wait(10) and {}
    wsgi_call(rank0.app, "POST", "/v1/actions", {"action": "restart"}, AUTH)
    _, _, body = wsgi_call(rank0.app, "POST", "/v1/actions", {"action": "restart"}, AUTH)
    release.set()
    assert body["status"] == "noop" and "already under way" in body["detail"]
    assert rank0.left.wait(10)


def test_a_restart_holds_rank_0_s_training_thread_at_its_next_boundary_and_records_that_step(wsgi_call, tmp_path):
    """A loop that is not hung: its training thread, still stepping, is held at the next boundary once the
    stacks are gathered, and the exit step recorded is the step it was held at (nothing trained after it)."""
    first = Incarnation(tmp_path, UNDER_TORCHRUN)
    held_at: list[int] = []
    stop = threading.Event()

    def training() -> None:
        step = 0
        while not stop.is_set() and not first.left.is_set():
            step += 1
            first.snapshot.update(step=step)
            held_at.append(step)
            first.restarter.after_step(step)  # returns only while no restart is under way

    thread = threading.Thread(target=training, daemon=True)
    thread.start()
    try:
        status, _, _ = wsgi_call(first.app, "POST", "/v1/actions", {"action": "restart", "reason": "test"}, AUTH)
        assert status == 202 and first.left.wait(10)
        exit_step = json.loads((tmp_path / LEDGER_FILE).read_text())["pending"]["exit_step"]
        assert thread.is_alive() and exit_step == held_at[-1], (exit_step, held_at[-3:])
    finally:
        stop.set()


def test_rank_0_waiting_in_a_collective_is_not_waited_for_at_a_step_boundary(wsgi_call, tmp_path, monkeypatch):
    """A hang's restart: rank 0 waits in the collective its hung peer never joins, so it reaches no step
    boundary until the group exits. It has waited there longer than the boundary wait already: the restart
    does not wait again (the campaign's hangs spent 2 s each in it), and the exit step is the step it is at."""
    monkeypatch.setattr("rankscope.control.restart._FREEZE_WAIT_SECONDS", 3600.0)  # only an exit could end it
    collective = {"kind": "all_reduce", "dim": "data", "group": "0", "since": 1000.0 - 9.5}
    rank0 = Incarnation(tmp_path, UNDER_TORCHRUN, in_flight=lambda: collective)
    rank0.snapshot.update(step=40)
    status, _, body = wsgi_call(rank0.app, "POST", "/v1/actions", {"action": "restart", "reason": "hung"}, AUTH)
    assert status == 202 and rank0.left.wait(10), "the restart waited for a boundary rank 0 cannot reach"
    assert json.loads((tmp_path / LEDGER_FILE).read_text())["pending"]["exit_step"] == 40
    [record] = rank0.pending()
    assert "rank 0 has waited 9.5 s in all_reduce (data): no step boundary to wait for" in record["detail"], record
    second = Incarnation(tmp_path, {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    second.restarter.after_step(37)  # resumed from the checkpoint at step 36
    [settled] = second.recent()
    assert "4 step(s) after the newest checkpoint lost (exited at step 40; rank 0 has waited 9.5 s" in settled["detail"]


def test_a_collective_younger_than_the_boundary_wait_is_waited_out(wsgi_call, tmp_path, monkeypatch):
    """A loop that is not hung is in a collective most of the time: a young one is no reason to skip the wait
    that stops it at its next boundary."""
    monkeypatch.setattr("rankscope.control.restart._FREEZE_WAIT_SECONDS", 3600.0)
    collective = {"kind": "all_reduce", "dim": "data", "group": "0", "since": 1000.0 - 0.2}
    rank0 = Incarnation(tmp_path, UNDER_TORCHRUN, in_flight=lambda: collective)
    rank0.snapshot.update(step=40)
    wsgi_call(rank0.app, "POST", "/v1/actions", {"action": "restart", "reason": "test"}, AUTH)
    assert rank0.restarter._freeze.wait(10)  # the stacks are written; the training thread is to be held
    assert not rank0.left.wait(0.2)  # waiting for the boundary (a restart that skipped it has exited by now)
    rank0.snapshot.update(step=41)
    held = threading.Thread(target=rank0.restarter.after_step, args=(41,), daemon=True)
    held.start()  # the training thread reaches its boundary: held there, and the group exits
    assert rank0.left.wait(10)
    assert json.loads((tmp_path / LEDGER_FILE).read_text())["pending"]["exit_step"] == 41


def test_rank_0_notes_its_ending_before_any_peer_is_told_to_leave(wsgi_call, tmp_path):
    """torchrun stops rank 0 as soon as a peer has exited: a note still saying "running" then had the next
    process report rank 0 vanished, a false page (the CI's quick campaign, loop-off arm, once)."""
    import http.server

    from rankscope.exits import ExitNote, end_all

    note = ExitNote(tmp_path, 0, "run").begin()
    seen: list[object] = []

    class Peer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the peer's /v1/exit: what rank 0's note says when a peer leaves
            seen.append(json.loads(note.path.read_text()).get("ended"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rank0 = Incarnation(tmp_path, UNDER_TORCHRUN, peers=lambda: {1: f"http://127.0.0.1:{server.server_port}"})
        wsgi_call(rank0.app, "POST", "/v1/actions", {"action": "restart", "reason": "hung"}, AUTH)
        assert rank0.left.wait(10)
        assert seen == ["restart"]
    finally:
        server.shutdown()
        server.server_close()
        end_all("test")
