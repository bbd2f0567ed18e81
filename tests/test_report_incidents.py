"""rankscope.report.incidents: alert episodes from ALERTS samples, actions from the control counter and the
run log, and the fault-to-action time between them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rankscope.report.incidents import action_events, alert_episodes, find_incidents
from rankscope.report.runlog import read_run_log
from rankscope.report.series import Series

T0 = 1_800_000_000.0
EVAL = 1.0


def _alert(name: str, state: str, times: list[float], **labels: str) -> Series:
    return Series({"alertname": name, "alertstate": state, "__name__": "ALERTS", **labels},
                  np.array(times) + T0, np.ones(len(times)))  # fmt: skip


def _counter(action: str, result: str, points: list[tuple[float, float]], source: str = "alert") -> Series:
    return Series({"action": action, "source": source, "result": result},
                  np.array([t for t, _ in points]) + T0, np.array([v for _, v in points]))  # fmt: skip


DIVERGING = {"severity": "ticket", "action": "reduce_lr", "run_id": "r"}


def test_pending_then_firing_samples_are_one_episode_and_a_long_gap_starts_another() -> None:
    alerts = [
        _alert("RankscopeLossDiverging", "pending", [10, 11], **DIVERGING),
        _alert("RankscopeLossDiverging", "firing", [12, 13, 14, 40, 41], **DIVERGING),
    ]
    first, second = alert_episodes(alerts, EVAL, end=T0 + 100)
    assert (first.pending_at, first.firing_at, first.ended_at) == (T0 + 10, T0 + 12, T0 + 14)
    assert first.onset == T0 + 10 and not first.active and first.action == "reduce_lr"
    assert (second.pending_at, second.firing_at) == (None, T0 + 40)  # it came back without pending again


def test_alerts_of_different_ranks_are_separate_episodes_and_an_alert_still_firing_is_active() -> None:
    alerts = [_alert("RankscopeRankDown", "firing", [5, 6, 7], rank=r, node="n0") for r in ("0", "1")]
    episodes = alert_episodes(alerts, EVAL, end=T0 + 7)
    assert [e.title for e in episodes] == ["RankscopeRankDown (rank=0, node=n0)", "RankscopeRankDown (rank=1, node=n0)"]
    assert all(e.active for e in episodes)


def test_an_alert_that_never_fired_is_an_episode_with_no_firing_time() -> None:
    (episode,) = alert_episodes([_alert("RankscopeRankImbalance", "pending", [3, 4, 5])], EVAL, end=T0 + 60)
    assert episode.firing_at is None and episode.onset == T0 + 3


def test_every_increase_of_the_action_counter_is_an_action_between_two_scrapes() -> None:
    applied = _counter("reduce_lr", "applied", [(20, 1), (21, 1), (22, 2), (30, 2), (31, 1)])
    events = action_events([applied])
    # First seen at 1 (the child is created by its first action), then +1, then a reset (a restart) to 1.
    assert [(e.at - T0, None if e.after is None else e.after - T0, e.count) for e in events] == [
        (20, None, 1), (22, 21, 1), (31, 30, 1),
    ]  # fmt: skip
    assert all((e.action, e.source, e.result) == ("reduce_lr", "alert", "applied") for e in events)


def _log(tmp_path, records: list[dict]):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return read_run_log(path)


def test_an_alert_checkpoint_is_attributed_to_its_alert_with_the_run_logs_exact_time(tmp_path) -> None:
    memory = {"severity": "ticket", "action": "checkpoint", "node": "n0"}
    alerts = [
        _alert("RankscopeHostMemoryHigh", "pending", [50, 51], **memory),
        _alert("RankscopeHostMemoryHigh", "firing", [52, 53, 54], **memory),
    ]
    counter = _counter("checkpoint", "applied", [(55, 1), (56, 1)])
    log = _log(tmp_path, [
        {"type": "start", "step": 0, "time": T0},
        {"type": "checkpoint", "step": 40, "reason": "interval", "path": "a", "time": T0 + 30},
        {"type": "checkpoint", "step": 77, "reason": "alert:RankscopeHostMemoryHigh", "path": "b", "time": T0 + 53.4},
    ])  # fmt: skip
    found = find_incidents(alerts, [counter], interval=EVAL, end=T0 + 60, log=log)
    (action,) = found.actions
    assert (action.action, action.step, action.reason) == ("checkpoint", 77, "alert:RankscopeHostMemoryHigh")
    assert action.at == T0 + 53.4 and action.evidence == ["prometheus", "run log"]
    assert action.cause is found.episodes[0]
    assert action.fault_to_action == pytest.approx(3.4)  # pending at 50 s, checkpoint written at 53.4 s
    assert [reason for _, reason in found.checkpoints] == ["interval", "alert:RankscopeHostMemoryHigh"]


def test_a_learning_rate_drop_in_the_run_log_gives_the_step_of_the_reduction(tmp_path) -> None:
    alerts = [_alert("RankscopeNonFiniteSteps", "firing", [10, 11, 12], severity="page", action="reduce_lr")]
    counter = _counter("reduce_lr", "applied", [(9, 0), (12, 1)])  # created at start by another outcome: 0
    train = [{"type": "train", "step": s, "loss": 1.0, "lr": 1e-3 if s <= 43 else 5e-4, "time": T0 + 10 + s // 10}
             for s in range(1, 60)]  # fmt: skip
    log = _log(tmp_path, [{"type": "start", "step": 0, "time": T0 + 9}, *train])
    found = find_incidents(alerts, [counter], interval=EVAL, end=T0 + 30, log=log)
    (action,) = found.actions
    assert (action.action, action.step, action.reason) == ("reduce_lr", 43, "learning rate x0.5")
    assert action.cause is not None and action.cause.alertname == "RankscopeNonFiniteSteps"
    assert action.fault_to_action == pytest.approx(2.0)


def test_a_rollback_and_a_micro_batch_cut_in_the_run_log_are_actions_with_their_step_and_cause(tmp_path) -> None:
    rollback_alert = {"severity": "ticket", "action": "rollback", "run_id": "r"}
    alerts = [_alert("RankscopeLossDiverging", "firing", [20, 21, 22], **rollback_alert)]
    counters = [_counter("rollback", "applied", [(19, 0), (23, 1)]),
                _counter("reduce_micro_batch", "applied", [(40, 0), (42, 1)], source="operator")]  # fmt: skip
    log = _log(tmp_path, [
        {"type": "start", "step": 0, "time": T0},
        {"type": "resume", "step": 10, "path": "x", "reason": "interval", "time": T0 + 1},
        {"type": "rollback", "step": 120, "path": "c", "reason": "interval", "action_reason":
         "alert:RankscopeLossDiverging", "rolled_back_from": 143, "time": T0 + 22.5},
        {"type": "micro_batch", "step": 150, "micro_batch": 8, "accumulation": 2, "reason": "operator:memory",
         "time": T0 + 41.5},
    ])  # fmt: skip
    found = find_incidents(alerts, counters, interval=EVAL, end=T0 + 60, log=log)
    rollback, cut = found.actions
    assert (rollback.action, rollback.step, rollback.at) == ("rollback", 143, T0 + 22.5)
    assert rollback.reason == "back to step 120 (alert:RankscopeLossDiverging)"
    assert rollback.cause is not None and rollback.cause.alertname == "RankscopeLossDiverging"
    assert (cut.action, cut.step, cut.reason) == ("reduce_micro_batch", 150, "micro-batch 8 x 2 (operator:memory)")
    assert cut.evidence == ["prometheus", "run log"]


def test_a_refusal_is_the_alerts_doing_but_has_no_fault_to_action_time_and_an_operator_stop_no_cause() -> None:
    alerts = [_alert("RankscopeLossDiverging", "firing", [10, 11], **DIVERGING)]
    counters = [
        _counter("stop", "applied", [(30, 1)], source="operator"),
        _counter("reduce_lr", "refused_cooldown", [(12, 1)]),
    ]
    step = Series({}, T0 + np.arange(0.0, 40.0), np.arange(0.0, 40.0) * 3)
    found = find_incidents(alerts, counters, interval=EVAL, end=T0 + 40, global_step=step)
    refused, stop = found.actions
    assert (refused.result, refused.cause, refused.fault_to_action) == ("refused_cooldown", found.episodes[0], None)
    assert (stop.action, stop.source, stop.cause, stop.step) == ("stop", "operator", None, 90)


def test_paused_intervals_come_from_the_paused_gauge() -> None:
    paused = Series({}, T0 + np.arange(20.0), np.array([0] * 5 + [1] * 6 + [0] * 9, dtype=float))
    found = find_incidents([], [], interval=EVAL, end=T0 + 20, paused=paused)
    assert found.paused == [(T0 + 5, T0 + 10)]


def _demo_like_log(tmp_path):
    """What the reference trainer logs around the demo's incident: NaN steps 300-304, the alert's reduce_lr,
    an operator's refused reduce_lr, a pause held for 6 s, a resume (each action at its own settle time)."""
    train = [{"type": "train", "step": s, "loss": None if 300 <= s <= 304 else 0.5, "lr": 1e-3 if s <= 310 else 5e-4,
              "time": T0 + (s // 10) * 1.0} for s in range(1, 400)]  # fmt: skip
    actions = [
        {"type": "action", "step": 310, "id": "a-1", "action": "reduce_lr", "source": "alert", "result": "applied",
         "reason": "alert:RankscopeNonFiniteSteps", "detail": "took effect by step 311", "time": T0 + 31.4},
        {"type": "action", "step": 369, "id": "a-2", "action": "reduce_lr", "source": "operator",
         "result": "refused_cooldown", "reason": "operator:loss still high", "detail": "cooldown is 60s",
         "time": T0 + 36.95},
        {"type": "action", "step": 382, "id": "a-3", "action": "pause", "source": "operator", "result": "applied",
         "reason": "operator:look at the loss", "detail": "", "time": T0 + 38.25},
        {"type": "action", "step": 382, "id": "a-4", "action": "resume", "source": "operator", "result": "applied",
         "reason": "operator:go on", "detail": "", "time": T0 + 44.3},
    ]  # fmt: skip
    # The log is appended in write order: the pause and resume records are both written after the hold.
    return _log(tmp_path, [{"type": "start", "step": 0, "time": T0}, *train, *actions])


def test_fault_to_action_is_measured_from_the_first_non_finite_step_when_the_run_log_shows_it(tmp_path) -> None:
    alerts = [_alert("RankscopeNonFiniteSteps", "firing", [33, 34, 35, 36], severity="page", action="reduce_lr")]
    counters = [_counter("reduce_lr", "applied", [(30, 0), (32, 1)])]
    found = find_incidents(alerts, counters, interval=EVAL, end=T0 + 50, log=_demo_like_log(tmp_path))
    applied = next(a for a in found.actions if a.result == "applied")
    assert applied.cause is not None and applied.cause.onset == T0 + 33  # named by its reason, detail or not
    # Step 300 is the first of the flush at T0 + 30 (steps 300-309): its time is spread to T0 + 29.1.
    assert applied.first_sign_step == 300 and applied.first_sign == pytest.approx(T0 + 29.1)
    assert applied.fault_to_action == pytest.approx(31.4 - 29.1)
    assert [step for _, step in found.nonfinite] == [300, 301, 302, 303, 304]


def test_without_a_first_sign_fault_to_action_runs_from_the_alert() -> None:
    alerts = [_alert("RankscopeNonFiniteSteps", "firing", [10, 11, 12], severity="page", action="reduce_lr")]
    found = find_incidents(alerts, [_counter("reduce_lr", "applied", [(9, 0), (13, 1)])], interval=EVAL, end=T0 + 20)
    (action,) = found.actions
    assert action.first_sign is None and action.fault_to_action == pytest.approx(3.0)


def test_the_loss_series_non_finite_samples_are_the_first_sign_without_a_run_log() -> None:
    alerts = [_alert("RankscopeNonFiniteSteps", "firing", [10, 11, 12], severity="page", action="reduce_lr")]
    loss = Series({"split": "train"}, T0 + np.arange(0.0, 20.0), np.where(np.arange(20) == 8, np.nan, 0.5))
    found = find_incidents(alerts, [_counter("reduce_lr", "applied", [(9, 0), (13, 1)])], interval=EVAL,
                           end=T0 + 20, loss=loss)  # fmt: skip
    assert found.actions[0].fault_to_action == pytest.approx(5.0)


def test_operator_actions_take_their_step_time_and_reason_from_the_run_log_and_the_pause_its_own_span(
    tmp_path,
) -> None:
    counters = [
        _counter("reduce_lr", "refused_cooldown", [(35, 0), (37.5, 1)], source="operator"),
        _counter("pause", "applied", [(38, 0), (39.5, 1)], source="operator"),
        _counter("resume", "applied", [(44, 0), (45.5, 1)], source="operator"),
    ]
    step = Series({}, T0 + np.arange(0.0, 50.0), np.arange(0.0, 50.0) * 9)  # the scrape's step is later
    # The gauge says paused from 40 to 45 (sampled late): the log's times win.
    paused = Series({}, T0 + np.arange(0.0, 50.0), ((np.arange(50) >= 40) & (np.arange(50) <= 45)).astype(float))
    found = find_incidents([], counters, interval=EVAL, end=T0 + 50, log=_demo_like_log(tmp_path),
                           global_step=step, paused=paused)  # fmt: skip
    by_id = {(a.action, a.result): a for a in found.actions}
    refused = by_id[("reduce_lr", "refused_cooldown")]
    assert (refused.step, refused.at, refused.source) == (369, T0 + 36.95, "operator")
    assert (refused.reason, refused.detail) == ("operator:loss still high", "cooldown is 60s")
    assert refused.evidence == ["prometheus", "run log"]
    pause = by_id[("pause", "applied")]
    assert (pause.step, pause.at, pause.reason) == (382, T0 + 38.25, "operator:look at the loss")
    assert found.paused == [(T0 + 38.25, T0 + 44.3)]
    # The alert's reduce_lr is in the log once: its record, not a second one from the learning-rate drop.
    assert [(a.action, a.result) for a in found.actions].count(("reduce_lr", "applied")) == 1


def test_a_stop_is_one_action_though_its_checkpoint_comes_seconds_before_its_logged_outcome(tmp_path) -> None:
    log = _log(tmp_path, [
        {"type": "start", "step": 0, "time": T0},
        {"type": "checkpoint", "step": 60, "reason": "stop:operator:over", "path": "c", "time": T0 + 3.0},
        {"type": "action", "step": 60, "id": "s-1", "action": "stop", "source": "operator", "result": "applied",
         "reason": "operator:over", "detail": "", "time": T0 + 9.0},
    ])  # fmt: skip
    found = find_incidents([], [], interval=EVAL, end=T0 + 20, log=log)
    (stop,) = found.actions
    assert (stop.action, stop.step, stop.at, stop.reason) == ("stop", 60, T0 + 9.0, "operator:over")


def test_a_hangs_fault_to_action_is_measured_from_the_last_step_before_it(tmp_path) -> None:
    # Issue 34: "fault to action 8.9 s" for the demo's hang was measured from the alert, while the user felt 30 s
    # from the hang to training again. The first sign of a hang is the last step that completed before it.
    train = [{"type": "train", "step": s, "loss": 0.5, "time": T0 + s * 0.1} for s in range(1, 301)]
    again = [{"type": "train", "step": s, "loss": 0.5, "time": T0 + 63 + (s - 290) * 0.1} for s in range(291, 330)]
    restart_record = {"type": "action", "step": 291, "id": "h-1", "action": "restart", "source": "alert",
                      "result": "applied", "reason": "alert:RankscopeRankHung", "time": T0 + 63.1}  # fmt: skip
    restarted = [{"type": "start", "step": 290, "time": T0 + 62.0}, *again, restart_record]
    log = _log(tmp_path, [{"type": "start", "step": 0, "time": T0}, *train, *restarted])
    alerts = [_alert("RankscopeRankHung", "firing", [40, 41, 42], severity="page", action="restart", rank="1")]
    found = find_incidents(alerts, [], interval=EVAL, end=T0 + 70, log=log)
    (restart,) = found.actions
    assert restart.cause is not None and restart.cause.onset == T0 + 40
    assert (restart.first_sign, restart.first_sign_step) == (pytest.approx(T0 + 30.0, abs=0.01), 300)
    assert restart.first_sign_what == "the last step before the hang"
    assert restart.fault_to_action == pytest.approx(63.1 - 30.0)
