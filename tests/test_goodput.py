"""The goodput ledger: buckets that add up to the job's wall time, kept across incarnations (fake clock)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rankscope import Monitor, MonitorConfig
from rankscope.goodput import BUCKETS, LEDGER_FILE, GoodputLedger
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


def test_a_hang_is_the_gap_beyond_hang_seconds_live_and_after_it_ended() -> None:
    clock = Clock()
    ledger = GoodputLedger(process_start=clock.now, hang_seconds=10, clock=clock)
    ledger.first_step(clock.now, 0)
    _train(ledger, clock, 1, 2)
    clock.tick(25)
    live = ledger.totals()
    assert live["hang"] == pytest.approx(15) and live["training"] == pytest.approx(12)
    ledger.on_step(3, clock.tick(1))
    after = ledger.totals()
    assert after["hang"] == pytest.approx(16) and after["training"] == pytest.approx(12)
    # A long phase is not a hang.
    ledger.enter("checkpoint")
    clock.tick(30)
    ledger.leave(saved_step=3)
    ledger.on_step(4, clock.tick(1))
    assert ledger.totals()["hang"] == pytest.approx(16)


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
