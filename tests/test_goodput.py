"""The goodput ledger: buckets that add up to the job's wall time, kept across incarnations (fake clock)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rankscope import Monitor, MonitorConfig
from rankscope.goodput import BUCKETS, LEDGER_FILE, GoodputLedger
from rankscope.hang_threshold import HangThreshold, duration_seconds
from rankscope.identity import RankIdentity


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def _wall(totals: dict[str, float]) -> float:
    return sum(seconds for bucket, seconds in totals.items() if bucket != "lost")


def _train(ledger: GoodputLedger, clock: Clock, first: int, last: int, seconds: float = 1.0) -> None:
    for index in range(first, last + 1):
        ledger.on_step(index, clock.tick(seconds))


def test_buckets_add_up_to_wall_time_and_phases_land_in_their_own() -> None:
    clock = Clock()
    ledger = GoodputLedger(process_start=clock.now, clock=clock)
    clock.tick(5)  # imports, model build, checkpoint load
    ledger.first_step(clock.now, 0)
    _train(ledger, clock, 1, 10)
    ledger.enter("checkpoint")
    clock.tick(3)
    ledger.leave(saved_step=10)
    ledger.enter("validation")
    clock.tick(2)
    ledger.leave()
    ledger.enter("paused")
    clock.tick(4)
    ledger.leave()
    _train(ledger, clock, 11, 15)
    totals = ledger.totals()
    assert totals == {
        "startup": 5,
        "training": 15,
        "lost": 0,
        "checkpoint": 3,
        "validation": 2,
        "paused": 4,
        "hang": 0,
    }
    assert _wall(totals) == clock.now - 1000.0
    assert list(totals) == list(BUCKETS)


def test_a_rollback_loses_the_training_since_the_checkpoint_it_loads() -> None:
    clock = Clock()
    ledger = GoodputLedger(process_start=clock.now, clock=clock)
    ledger.first_step(clock.now, 0)
    _train(ledger, clock, 1, 10)
    ledger.enter("checkpoint")
    clock.tick(1)
    ledger.leave(saved_step=10)
    _train(ledger, clock, 11, 17, seconds=2.0)  # 14 s, thrown away
    ledger.restore(10)
    assert ledger.totals()["lost"] == pytest.approx(14)
    _train(ledger, clock, 11, 12)
    ledger.restore(12)  # a "restore" forward or in place loses nothing
    assert ledger.totals()["lost"] == pytest.approx(14)


def test_a_hang_is_the_whole_gap_from_the_last_step_once_it_passes_the_floor_live_and_after_it_ended() -> None:
    # One meaning with RankscopeRankHung: hung from the last step's end once the gap passes
    # max(floor, multiple x recent step time); the whole gap is the hang, from where the alert says it began.
    clock = Clock()
    ledger = GoodputLedger(process_start=clock.now, hang_floor_seconds=10, clock=clock)
    ledger.first_step(clock.now, 0)
    _train(ledger, clock, 1, 2)
    clock.tick(9)
    assert ledger.totals()["hang"] == 0  # within the floor: a slow step, still training
    clock.tick(16)
    live = ledger.totals()
    assert live["hang"] == pytest.approx(25) and live["training"] == pytest.approx(2)
    ledger.on_step(3, clock.tick(1))
    after = ledger.totals()
    assert after["hang"] == pytest.approx(26) and after["training"] == pytest.approx(2)
    # A long phase is not a hang, and the gap after it is measured from its end.
    ledger.enter("checkpoint")
    clock.tick(30)
    ledger.leave(saved_step=3)
    ledger.on_step(4, clock.tick(9))
    assert ledger.totals()["hang"] == pytest.approx(26) and ledger.totals()["checkpoint"] == pytest.approx(30)
    assert _wall(ledger.totals()) == pytest.approx(clock.now - 1000.0)


def test_the_exposed_buckets_never_decrease_while_a_gap_turns_into_a_hang() -> None:
    # They are counters (rankscope_goodput_seconds_total): a drop reads as a reset to Prometheus's increase().
    # Until a gap passes the threshold it is not yet known to be training or a hang: it is counted at its end.
    clock = Clock()
    ledger = GoodputLedger(process_start=clock.now, hang_floor_seconds=10, clock=clock)
    ledger.first_step(clock.now, 0)
    seen = [ledger.totals()]

    def wait(seconds: float) -> None:
        for _ in range(int(seconds * 2)):
            clock.tick(0.5)
            seen.append(ledger.totals())

    for index in range(1, 4):
        wait(1)
        ledger.on_step(index, clock.now)
    wait(25)  # a hang: past the threshold at 10 s
    ledger.on_step(4, clock.now)
    wait(1)
    ledger.enter("checkpoint")
    wait(3)
    ledger.leave(saved_step=4)
    wait(9)
    ledger.on_step(5, clock.now)
    seen.append(ledger.totals())
    for before, after in zip(seen, seen[1:], strict=False):
        assert all(after[bucket] >= before[bucket] for bucket in BUCKETS), (before, after)
    assert seen[-1]["hang"] == pytest.approx(25) and _wall(seen[-1]) == pytest.approx(clock.now - 1000.0)


def test_the_hang_threshold_is_the_alerts_multiple_of_the_recent_step_time() -> None:
    clock = Clock()
    ledger = GoodputLedger(process_start=clock.now, hang_floor_seconds=10, hang_step_multiple=10, clock=clock)
    ledger.first_step(clock.now, 0)
    _train(ledger, clock, 1, 5, seconds=3.0)  # 3 s steps: the threshold is 30 s, not the 10 s floor
    clock.tick(29)
    assert ledger.totals()["hang"] == 0
    clock.tick(2)
    assert ledger.totals()["hang"] == pytest.approx(31)
    # The step that ends the hang does not raise its own threshold: the 31 s gap stays a hang.
    ledger.on_step(6, clock.tick(1), seconds=32.0)
    assert ledger.totals()["hang"] == pytest.approx(32)


def test_the_recent_step_time_is_the_window_mean_up_to_the_last_step_kept_through_a_hang() -> None:
    threshold = HangThreshold(floor_seconds=1, step_multiple=10, window_seconds=60, lookback_seconds=600)
    assert threshold.seconds(0.0) == 1  # no step yet: the floor
    threshold.add_step(30.0, 30.0)  # a first step that compiles for 30 s
    assert threshold.seconds(30.0) == pytest.approx(300.0)
    for at in range(31, 61):
        threshold.add_step(float(at), 1.0)  # faster steps outnumber it: (30 + 30) / 31
    assert threshold.recent_step_seconds(60.0) == pytest.approx(60 / 31)
    for at in range(61, 91):
        threshold.add_step(float(at), 1.0)  # a minute of 1 s steps: the first step has left the window
    assert threshold.seconds(90.0) == pytest.approx(10.0)
    assert threshold.seconds(689.0) == pytest.approx(10.0)  # no step since (a hang): the mean holds...
    assert threshold.seconds(691.0) == 1  # ...for the lookback


def test_start_up_and_the_first_step_are_never_a_hang_however_long() -> None:
    # The alert needs a step completed by this incarnation (rankscope_last_step_timestamp_seconds > 0).
    clock = Clock()
    ledger = GoodputLedger(process_start=clock.now, hang_floor_seconds=10, clock=clock)
    clock.tick(300)  # imports, checkpoint load
    ledger.first_step(clock.now, 0)
    clock.tick(200)  # the first step compiles
    assert ledger.totals()["hang"] == 0
    ledger.on_step(1, clock.now, seconds=200.0)
    _train(ledger, clock, 2, 3)
    totals = ledger.totals()
    assert totals["hang"] == 0 and totals["startup"] == 300 and totals["training"] == pytest.approx(202)


def test_the_monitor_config_and_the_rule_pack_share_one_hang_threshold() -> None:
    from rankscope.mixin.config import Tunables

    monitor, rules = MonitorConfig(), Tunables()
    shipped = (rules.hang_floor_seconds, rules.hang_step_multiple)
    assert (monitor.hang_floor_seconds, monitor.hang_step_multiple) == shipped
    threshold = HangThreshold()
    assert (threshold.floor_seconds, threshold.step_multiple) == shipped
    assert (threshold.window_seconds, threshold.lookback_seconds) == (
        duration_seconds(rules.hang_step_window),
        duration_seconds(rules.hang_step_lookback),
    )


def test_the_next_incarnation_continues_the_job_and_counts_the_restart_and_lost_work(tmp_path) -> None:
    clock = Clock()
    first = GoodputLedger(tmp_path, process_start=clock.now, clock=clock)
    clock.tick(4)
    first.first_step(clock.now, 0)
    _train(first, clock, 1, 20)
    first.enter("checkpoint")
    clock.tick(2)
    first.leave(saved_step=20)
    _train(first, clock, 21, 29)  # 9 s after the checkpoint, then the crash
    first.flush()
    clock.tick(6)  # torchrun notices, restarts the group: the new process starts here
    second = GoodputLedger(tmp_path, process_start=clock.now, clock=clock)
    assert second.job_start == 1000.0 and second.incarnation == 2
    clock.tick(3)  # start-up again, the checkpoint load included
    second.restore(20)
    second.first_step(clock.now, 20)
    _train(second, clock, 21, 25)
    totals = second.totals()
    assert totals["startup"] == pytest.approx(4 + 6 + 3)
    assert totals["lost"] == pytest.approx(9)
    assert totals["training"] == pytest.approx(20 + 9 + 5)
    assert _wall(totals) == pytest.approx(clock.now - 1000.0)


def test_a_process_start_read_before_the_last_record_of_the_incarnation_before_counts_nothing_twice(tmp_path):
    # psutil's process start (the boot time in whole seconds plus clock ticks) can read up to a second
    # early against time.time(): a restart within that second must not count the overlap twice (seen in
    # the e2e hang run: the buckets added up to 33 ms more than the job's wall time).
    clock = Clock()
    first = GoodputLedger(tmp_path, process_start=clock.now, clock=clock)
    first.first_step(clock.tick(1), 0)
    _train(first, clock, 1, 5)
    first.flush()  # its last record, at 1006
    second = GoodputLedger(tmp_path, process_start=clock.now - 0.4, clock=clock)
    clock.tick(2)
    second.first_step(clock.now, 5)
    _train(second, clock, 6, 8)
    assert _wall(second.totals()) == pytest.approx(clock.now - 1000.0)
    assert second.totals()["startup"] == pytest.approx(1 + 2)


def test_a_restart_from_scratch_without_a_resume_loses_every_step(tmp_path) -> None:
    clock = Clock()
    first = GoodputLedger(tmp_path, process_start=clock.now, clock=clock)
    first.first_step(clock.now, 0)
    _train(first, clock, 1, 5)
    first.flush()
    second = GoodputLedger(tmp_path, process_start=clock.now, clock=clock)
    second.first_step(clock.now, 0)  # no set_step: the loop began again at step 1
    assert second.totals()["lost"] == pytest.approx(5)


def test_an_unreadable_ledger_starts_the_accounting_again_with_a_warning(tmp_path, caplog) -> None:
    (tmp_path / LEDGER_FILE).write_text("{not json")
    ledger = GoodputLedger(tmp_path, process_start=10.0, clock=lambda: 12.0)
    assert ledger.incarnation == 1 and ledger.totals()["startup"] == pytest.approx(2)
    assert "unreadable" in caplog.text


def test_an_unknown_phase_is_refused_in_one_line() -> None:
    ledger = GoodputLedger(process_start=0.0, clock=lambda: 1.0)
    with pytest.raises(ValueError, match="unknown goodput phase 'eval'; known: checkpoint, validation, paused"):
        ledger.enter("eval")


def _monitor(tmp_path, rank: int = 0, **config) -> Monitor:
    identity = RankIdentity(run_id="t", rank=rank, local_rank=rank, world_size=2, node="n", node_rank=0)
    return Monitor(
        MonitorConfig(base_port=0, probes=(), goodput_dir=str(tmp_path), **config),
        identity,
        device="cpu",
        registry=CollectorRegistry(),
    )


def test_rank_0_alone_exports_the_job_buckets_and_writes_the_ledger(tmp_path) -> None:
    zero, one = _monitor(tmp_path / "0"), _monitor(tmp_path / "1", rank=1)
    for monitor in (zero, one):
        for _ in range(3):
            with monitor.step():
                pass
        with monitor.phase("checkpoint"):
            pass
        monitor.close()
    page = generate_latest(zero.registry).decode()
    assert all(f'bucket="{bucket}"' in page for bucket in BUCKETS)
    assert "goodput" not in generate_latest(one.registry).decode()
    record = json.loads((tmp_path / "0" / LEDGER_FILE).read_text())
    assert record["step"] == 3 and "3" in record["marks"]
    assert not (tmp_path / "1" / LEDGER_FILE).exists()


def test_set_step_backwards_is_a_restore_and_forwards_is_not(tmp_path) -> None:
    monitor = _monitor(tmp_path)
    for _ in range(4):
        with monitor.step():
            pass
    assert monitor.goodput is not None
    monitor.set_step(6)
    assert monitor.goodput.totals()["lost"] == 0
    monitor.set_step(0)  # back to the start: every step trained so far is lost
    assert monitor.goodput.totals()["lost"] > 0
    monitor.close()


def test_goodput_off_exports_nothing(tmp_path) -> None:
    monitor = _monitor(tmp_path, goodput=False)
    with monitor.step():
        pass
    with monitor.phase("validation"):
        pass
    assert "goodput" not in generate_latest(monitor.registry).decode()
    with pytest.raises(ValueError, match="unknown phase 'lunch'"), monitor.phase("lunch"):
        pass
    monitor.close()


def test_the_time_after_the_run_finished_is_not_training_and_a_later_incarnation_counts_it_as_its_start(
    tmp_path,
) -> None:
    # Found by the fault campaign: the linger after Monitor.finish() (a clean end keeps the page up for the last
    # scrapes) was counted as training, 3 s of every run; its ground truth (the run log) ends at `finished`.
    clock = Clock()
    ledger = GoodputLedger(tmp_path, process_start=clock.now, clock=clock)
    ledger.first_step(clock.now, 0)
    _train(ledger, clock, 1, 10)
    finished = clock.now
    ledger.finish()
    clock.tick(3)  # the linger
    ledger.on_step(11, clock.tick(1))  # a step after the end (a misused monitor) changes nothing either
    assert ledger.totals() == {**dict.fromkeys(BUCKETS, 0.0), "training": 10.0}
    ledger.flush()
    record = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert record["updated_at"] == finished and _wall(record["totals"]) == finished - 1000.0
    # Preempted (a stop, then the job launched again): the next incarnation counts the linger and the relaunch
    # as its start-up, so the buckets still add up to the wall time.
    clock.tick(10)
    second = GoodputLedger(tmp_path, process_start=clock.now, clock=clock)
    second.first_step(clock.tick(2), 10)
    _train(second, clock, 11, 12)
    totals = second.totals()
    assert totals["startup"] == pytest.approx(3 + 1 + 10 + 2)
    assert _wall(totals) == pytest.approx(clock.now - 1000.0)
