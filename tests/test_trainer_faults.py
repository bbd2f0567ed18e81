"""rankscope_trainer.faults: each switch does what it says, and leaves its signature in the scraped metrics.

The unit tests drive a FaultInjector directly. The integration tests share one
2-rank torchrun run (CPU is scarce) with every switch but the crash on, at
different steps and ranks, and scrape both ranks' /metrics over HTTP once the
run has finished (it keeps serving for `run.linger_seconds`). A schedule of two
crashes runs under torchrun's restarts (each fires once per job); the single
crash switch is also tested with restarts in test_trainer_training.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest
import torch
from rankscope.control.stacks import gather, headline
from rankscope_trainer.config import build_section
from rankscope_trainer.fault_markers import FaultMarkers
from rankscope_trainer.faults import FaultInjector, FaultsConfig, HangFault

from devstack.jobs import wait_for
from tests.support import REPO, sample_value


def _faults(**sections: dict) -> FaultsConfig:
    return build_section(FaultsConfig, sections, "faults")


def _optimizer_and_scheduler(lr: float = 0.1):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_every_switch_is_off_by_default() -> None:
    assert FaultsConfig().active() == []
    assert _faults(straggler={"at_step": 3}, crash={"at_step": 9}).active() == ["straggler", "crash"]


def test_divergence_multiplies_every_rate_and_the_schedule_keeps_it() -> None:
    optimizer, scheduler = _optimizer_and_scheduler()
    faults = FaultInjector(_faults(diverge={"at_step": 3, "lr_factor": 50}), rank=1)
    for step in (1, 2, 3, 4):
        faults.at_step_start(step, optimizer, scheduler)
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5.0)  # once, and not undone by the scheduler


def test_a_nonfinite_loss_comes_only_at_its_steps_and_on_its_rank() -> None:
    config = _faults(nonfinite={"at_step": 5, "steps": 2, "rank": 0})
    mine, other = FaultInjector(config, rank=0), FaultInjector(config, rank=1)
    loss = torch.tensor(1.0, requires_grad=True)
    bad_steps = [step for step in range(1, 10) if torch.isnan(mine.after_forward(step, loss * 2))]
    assert bad_steps == [5, 6]
    assert all(torch.isfinite(other.after_forward(step, loss * 2)) for step in range(1, 10))
    poisoned = FaultInjector(config, rank=0).after_forward(5, loss * 2)  # a fresh job's (mine fired once)
    poisoned.backward()
    assert torch.isnan(loss.grad)  # backward still runs, as for a real overflow


def test_poison_scrambles_the_captions_of_its_data_batches_only_and_draws_no_randomness() -> None:
    from rankscope_trainer.data import Batch

    def batch() -> Batch:
        ids = torch.arange(12).reshape(4, 3)
        return Batch(torch.zeros(4, 3, 2, 2), ids, torch.ones(4, 3, dtype=torch.long), torch.tensor([3, 2, 3, 1]),
                     torch.ones(4, 2, dtype=torch.long))  # fmt: skip

    faults = FaultInjector(_faults(poison={"at_batch": 5, "batches": 2}), rank=0)
    assert faults.config.active() == ["poison"]
    rng = torch.get_rng_state()
    hit = [index for index in range(1, 10) if not torch.equal(faults.poison(index, [batch()])[0].input_ids,
                                                              batch().input_ids)]  # fmt: skip
    assert hit == [5, 6]
    (scrambled,) = faults.poison(5, [batch()])
    assert scrambled.input_ids[1].tolist() == batch().input_ids[0].tolist()  # image 1 gets caption 0
    assert scrambled.lengths.tolist() == [1, 3, 2, 3] and torch.equal(scrambled.images, batch().images)
    assert torch.equal(torch.get_rng_state(), rng)


def test_poison_settings_are_checked_with_their_names() -> None:
    with pytest.raises(ValueError, match="faults.poison.at_batch must be >= 0"):
        _faults(poison={"at_batch": -1})
    with pytest.raises(ValueError, match="faults.poison.batches must be >= 1"):
        _faults(poison={"batches": 0})


def test_a_memory_balloon_grows_resident_memory_step_by_step_up_to_its_size_and_frees_it_at_its_end() -> None:
    process = psutil.Process()
    records: list = []
    faults = FaultInjector(
        _faults(memory_balloon={"at_step": 2, "rank": 0, "bytes": 96_000_000, "step_bytes": 48_000_000,
                                "until_step": 6}),
        rank=0,
        on_fire=records.append,
    )  # fmt: skip
    optimizer, scheduler = _optimizer_and_scheduler()
    before = process.memory_info().rss
    faults.at_step_start(1, optimizer, scheduler)
    assert process.memory_info().rss - before < 30_000_000
    faults.at_step_start(2, optimizer, scheduler)
    faults.at_step_start(3, optimizer, scheduler)
    faults.at_step_start(4, optimizer, scheduler)  # full: no more
    grown = process.memory_info().rss - before
    assert 90_000_000 <= grown < 140_000_000
    faults.at_step_start(5, optimizer, scheduler)
    assert process.memory_info().rss - before >= 90_000_000  # held up to its end
    faults.at_step_start(6, optimizer, scheduler)
    assert process.memory_info().rss - before < 30_000_000  # glibc: 48 MB chunks go back to the OS at once
    assert [(r["type"], r["step"]) for r in records] == [("fault", 2), ("fault_end", 6)]


def test_a_straggler_spends_its_extra_time_inside_the_step() -> None:
    loss = torch.tensor(1.0)
    for mode in ("sleep", "compute"):
        faults = FaultInjector(_faults(straggler={"at_step": 2, "rank": 1, "seconds": 0.2, "mode": mode}), rank=1)
        started = time.perf_counter()
        faults.after_forward(1, loss)
        assert time.perf_counter() - started < 0.1
        started = time.perf_counter()
        faults.after_forward(2, loss)
        assert time.perf_counter() - started >= 0.2


def test_slow_data_delays_the_batches_of_its_rank_from_its_step() -> None:
    config = _faults(slow_data={"at_step": 3, "rank": 0, "seconds": 0.15})
    step = {"next": 1}

    def timed(rank: int) -> list[float]:
        step["next"] = 1
        waits = []
        batches = iter(FaultInjector(config, rank=rank).slow_data(range(4), lambda: step["next"]))
        for _ in range(4):
            started = time.perf_counter()
            next(batches)
            waits.append(time.perf_counter() - started)
            step["next"] += 1
        return waits

    slow = timed(rank=0)
    assert max(slow[:2]) < 0.1 and min(slow[2:]) >= 0.15
    assert max(timed(rank=1)) < 0.1


def test_slow_data_delays_every_micro_batch_of_its_steps() -> None:
    # With data.accumulation_steps 2 the loader delivers two batches per step: both come late.
    faults = FaultInjector(_faults(slow_data={"at_step": 2, "rank": 0, "seconds": 0.15}), rank=0)
    batches = iter(faults.slow_data(range(4), lambda: 2))
    for _ in range(2):
        started = time.perf_counter()
        next(batches)
        assert time.perf_counter() - started >= 0.15


def test_a_slow_checkpoint_delays_the_first_save_at_or_after_its_step_and_no_other(tmp_path) -> None:
    faults = FaultInjector(_faults(slow_checkpoint={"at_step": 15, "seconds": 0.2}), 0, FaultMarkers(tmp_path, "L1"))
    state = lambda: {"step": 1}  # noqa: E731 - the loop's state_dict, as save() calls it

    def timed(step: int) -> float:
        started = time.perf_counter()
        assert faults.slow_checkpoint(step, state)() == {"step": 1}
        return time.perf_counter() - started

    assert timed(10) < 0.1
    assert timed(20) >= 0.2  # the first save at or after step 15
    assert timed(30) < 0.1  # once only
    # A restarted group (a new process, the same job's markers) replays the save at normal speed: once per job.
    restarted = FaultInjector(_faults(slow_checkpoint={"at_step": 15, "seconds": 0.2}), 0, FaultMarkers(tmp_path, "L1"))
    started = time.perf_counter()
    restarted.slow_checkpoint(20, state)()
    assert time.perf_counter() - started < 0.1
    with pytest.raises(ValueError, match=r"^faults.slow_checkpoint.seconds must be >= 0, got -1.0$"):
        _faults(slow_checkpoint={"at_step": 5, "seconds": -1})


def test_each_crash_of_a_schedule_exits_its_process_once_per_job_across_restarts(tmp_path) -> None:
    # Three processes with one state directory, as torchrun's attempts of one job: the first crashes at
    # step 2, the second replays step 2 and crashes at step 4, the third trains through both.
    script = (
        "import sys, torch\n"
        "from rankscope_trainer.config import build_section\n"
        "from rankscope_trainer.fault_markers import FaultMarkers\n"
        "from rankscope_trainer.faults import FaultInjector, FaultsConfig\n"
        "opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)\n"
        "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)\n"
        "cfg = build_section(FaultsConfig, {'crash': {'at_step': 2, 'rank': 0, 'exit_code': 17},\n"
        "    'schedule': [{'kind': 'crash', 'at_step': 4, 'rank': 0, 'exit_code': 18}]}, 'faults')\n"
        "faults = FaultInjector(cfg, 0, FaultMarkers(sys.argv[1], 'L1', run_id='job-1'), on_fire=print)\n"
        "for step in (1, 2, 3, 4, 5): faults.at_step_start(step, opt, sched)\n"
        "print('survived')\n"
    )

    def attempt() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    first, second, third = attempt(), attempt(), attempt()
    assert first.returncode == 17 and "survived" not in first.stdout, first.stderr
    assert "crashes at step 2" in first.stderr and "'name': 'crash-step2'" in first.stdout
    assert second.returncode == 18 and "crashes at step 4" in second.stderr, second.stderr
    assert "crash-step2" not in second.stdout  # fired once: the replayed step 2 is clean
    assert third.returncode == 0 and "survived" in third.stdout and "fault" not in third.stdout, third.stderr
    markers = sorted(path.name for path in tmp_path.iterdir())
    assert markers == ["crash-step2.rank0.L1.json", "crash-step4.rank0.L1.json"]  # no temporary file left
    assert json.loads((tmp_path / markers[1]).read_text())["step"] == 4


@pytest.mark.parametrize("kind", ["data", "compute"])
def test_a_hang_blocks_the_rank_where_its_stacks_show_it_once_per_job(kind, tmp_path) -> None:
    script = (
        "import sys, torch\n"
        "from rankscope.control.endpoint import serve_control\n"
        "from rankscope.control.peer import create_peer_app\n"
        "from rankscope_trainer.fault_markers import FaultMarkers\n"
        "from rankscope_trainer.faults import FaultInjector, FaultsConfig, HangFault\n"
        "kind = sys.argv[1]\n"
        "markers = FaultMarkers(sys.argv[2], 'L1', run_id='job-1')\n"
        "faults = FaultInjector(FaultsConfig(hang=HangFault(at_step=2, rank=0, kind=kind)), 0, markers)\n"
        "print(serve_control(create_peer_app(0, 'tok'), '127.0.0.1', 0).url, flush=True)\n"
        "for step in (1, 2, 3):\n"
        "    if kind == 'data': list(faults.slow_data([None], lambda: step))\n"
        "    else: faults.after_forward(step, torch.zeros(()))\n"
        "print('survived', flush=True)\n"
    )
    argv = [sys.executable, "-c", script, kind, str(tmp_path)]
    hung = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        url = hung.stdout.readline().strip()
        frame = "_hang_in_data_loader" if kind == "data" else "_hang_in_compute"

        def blocked() -> bool:
            answer = gather({0: url}, "tok")[0]
            return headline(answer["threads"]).startswith(frame)

        wait_for(blocked, 60, f"rank 0's stacks to show {frame}")
        assert hung.poll() is None
    finally:
        hung.kill()
        hung.wait(10)
    restarted = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert restarted.returncode == 0 and "survived" in restarted.stdout


def test_a_hang_of_an_unknown_kind_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^faults.hang.kind must be one of data, compute, collective, got 'disk'$"):
        HangFault(at_step=3, kind="disk")


# --- once per job: what a restarted group (a new process, the same state directory) sees ----------


def _injector(config: FaultsConfig, rank: int, directory, lineage: str = "L1", run_id: str = "job-1",
              records: list | None = None) -> FaultInjector:  # fmt: skip
    on_fire = None if records is None else records.append
    return FaultInjector(config, rank, FaultMarkers(directory, lineage, run_id=run_id), on_fire=on_fire)


def _nan_steps(faults: FaultInjector, steps) -> list[int]:
    return [step for step in steps if torch.isnan(faults.after_forward(step, torch.tensor(1.0)))]


def test_a_nonfinite_burst_fires_its_steps_once_per_job_and_a_replay_stays_finite(tmp_path) -> None:
    config = _faults(schedule=[{"kind": "nonfinite", "at_step": 5, "steps": 3, "rank": 0}])
    records: list = []
    first = _injector(config, 0, tmp_path, records=records)
    assert _nan_steps(first, range(1, 9)) == [5, 6, 7]
    assert _nan_steps(first, range(4, 9)) == []  # a rollback's replay in the same process
    assert _nan_steps(_injector(config, 0, tmp_path), range(1, 9)) == []  # a restart that resumed its checkpoint
    # A restart before any checkpoint has a new lineage, but the launch's run id names the job.
    assert _nan_steps(_injector(config, 0, tmp_path, lineage="L2"), range(1, 9)) == []
    # A fresh job in the same directory (new lineage, new launch) has fired nothing; nor has torchrun's
    # default run id "none" a job to name.
    assert _nan_steps(_injector(config, 0, tmp_path, lineage="L3", run_id="job-2"), range(1, 9)) == [5, 6, 7]
    assert _nan_steps(_injector(config, 0, tmp_path / "n", lineage="L4", run_id="none"), range(1, 9)) == [5, 6, 7]
    assert _nan_steps(_injector(config, 0, tmp_path / "n", lineage="L5", run_id="none"), range(1, 9)) == [5, 6, 7]
    (fired,) = records  # one record for the burst, when it began
    assert {k: fired[k] for k in ("type", "kind", "name", "step", "rank", "source")} == {
        "type": "fault", "kind": "nonfinite", "name": "nonfinite-step5", "step": 5, "rank": 0,
        "source": "faults.schedule[0]",
    }  # fmt: skip
    assert abs(fired["time"] - time.time()) < 60
    marker = json.loads((tmp_path / "nonfinite-step5.rank0.L1.json").read_text())
    assert (marker["step"], marker["rank"], marker["run_id"], marker["time"]) == (5, 0, "job-1", fired["time"])


def test_a_fault_any_rank_fired_is_over_for_every_rank_of_the_restarted_group(tmp_path) -> None:
    config = _faults(diverge={"at_step": 3, "lr_factor": 50})
    optimizer, scheduler = _optimizer_and_scheduler()
    _injector(config, 0, tmp_path).at_step_start(3, optimizer, scheduler)  # rank 0 diverged, then the group died
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5.0)
    optimizer, scheduler = _optimizer_and_scheduler()
    for rank in (0, 1):  # rank 1 never reached step 3; restarted, it must not diverge alone
        faults = _injector(config, rank, tmp_path)
        for step in (1, 2, 3, 4):
            faults.at_step_start(step, optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_a_poisoned_stretch_stays_poisoned_when_replayed_but_is_recorded_once(tmp_path) -> None:
    from rankscope_trainer.data import Batch

    ids = torch.arange(12).reshape(4, 3)
    batch = Batch(torch.zeros(4, 3, 2, 2), ids, torch.ones(4, 3, dtype=torch.long), torch.tensor([3, 2, 3, 1]),
                  torch.ones(4, 2, dtype=torch.long))  # fmt: skip
    config = _faults(poison={"at_batch": 5, "batches": 2})
    records: list = []
    for attempt in range(2):  # the second attempt replays the data batches after a restart
        faults = _injector(config, 1, tmp_path, records=records)
        hit = [i for i in range(1, 9) if not torch.equal(faults.poison(i, [batch])[0].input_ids, ids)]
        assert hit == [5, 6], attempt
    assert [(r["type"], r["name"], r["step"], r["rank"]) for r in records] == [("fault", "poison-batch5", 5, 1)]


def test_a_straggler_and_slow_data_with_an_end_slow_their_window_only_and_log_its_end(tmp_path) -> None:
    config = _faults(schedule=[
        {"kind": "straggler", "at_step": 2, "until_step": 4, "rank": 1, "seconds": 0.15},
        {"kind": "slow_data", "at_step": 3, "until_step": 4, "rank": 1, "seconds": 0.15},
    ])  # fmt: skip
    records: list = []
    faults = _injector(config, 1, tmp_path, records=records)
    step = {"next": 1}
    batches = iter(faults.slow_data(range(6), lambda: step["next"]))
    slowed = []
    for index in range(1, 6):
        step["next"] = index
        started = time.perf_counter()
        next(batches)
        data = time.perf_counter() - started
        started = time.perf_counter()
        faults.after_forward(index, torch.tensor(1.0))
        slowed.append((index, data >= 0.15, time.perf_counter() - started >= 0.15))
    assert slowed == [(1, False, False), (2, False, True), (3, True, True), (4, False, False), (5, False, False)]
    assert [(r["type"], r["kind"], r["step"]) for r in records] == [
        ("fault", "straggler", 2), ("fault", "slow_data", 3), ("fault_end", "slow_data", 4),
        ("fault_end", "straggler", 4),
    ]  # fmt: skip


def test_every_scheduled_fault_is_checked_as_its_switch_is_and_named_by_its_place() -> None:
    with pytest.raises(ValueError, match=r"^faults.schedule\[1\].at_step must be >= 0 \(0 = off\), got -2$"):
        _faults(schedule=[{"kind": "crash", "at_step": 5}, {"kind": "crash", "at_step": -2}])
    with pytest.raises(ValueError, match=r"^faults.schedule\[0\].where must be one of data, compute, collective"):
        _faults(schedule=[{"kind": "hang", "at_step": 5, "where": "disk"}])
    with pytest.raises(ValueError, match=r"^faults.schedule\[0\] repeats faults.crash \(crash-step4 on every rank\)"):
        _faults(crash={"at_step": 4, "rank": 1}, schedule=[{"kind": "crash", "at_step": 4, "rank": -1}])
    both = _faults(
        crash={"at_step": 4, "rank": 1},
        schedule=[{"kind": "crash", "at_step": 4, "rank": 0}, {"kind": "hang", "at_step": 9, "where": "collective"}],
    )
    assert [(e.name, e.rank, e.source) for e in both.events()] == [
        ("crash-step4", 1, "faults.crash"), ("crash-step4", 0, "faults.schedule[0]"),
        ("hang-step9", 1, "faults.schedule[1]"),
    ]  # fmt: skip
    assert both.events()[2].fault.kind == "collective"


def test_fault_records_of_any_rank_reach_the_run_log_whole(tmp_path) -> None:
    from rankscope_trainer.logbook import ProgressLog

    path = tmp_path / "log.jsonl"
    main, other = ProgressLog(str(path), True, 10, 32), ProgressLog(str(path), False, 10, 32)
    main.event("start", step=0)
    other.fault({"type": "fault", "kind": "crash", "name": "crash-step3", "step": 3, "rank": 1, "time": 12.5})
    main.event("finished", step=10)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in records] == ["start", "fault", "finished"]
    assert records[1] == {"type": "fault", "kind": "crash", "name": "crash-step3", "step": 3, "rank": 1, "time": 12.5}


# --- one 2-rank run with the faults on, scraped over HTTP ------------------------------------------

MAX_STEPS = 50
DIVERGE_AT = 45
BALLOON_BYTES = 300_000_000
FAULTS = [
    f"run.max_steps={MAX_STEPS}",
    "run.linger_seconds=300",  # the test scrapes, then ends the job
    "metrics.step_peak_memory=true",  # on CPU, which has no device memory: no series
    "faults.straggler.at_step=3",
    "faults.straggler.rank=1",
    "faults.straggler.seconds=0.12",
    # On the straggler's rank: slow data on the other rank would hold that rank back as long as the straggler
    # holds back its own, the two would reach the all-reduce together, and which one waits there would be noise.
    "faults.slow_data.at_step=3",
    "faults.slow_data.rank=1",
    "faults.slow_data.seconds=0.12",
    "faults.memory_balloon.at_step=5",
    "faults.memory_balloon.rank=1",
    f"faults.memory_balloon.bytes={BALLOON_BYTES}",
    "faults.nonfinite.at_step=8",
    "faults.nonfinite.steps=2",
    "faults.nonfinite.rank=0",
    f"faults.diverge.at_step={DIVERGE_AT}",
    "faults.diverge.lr_factor=1000",
]


@pytest.fixture(scope="module")
def faulty_run(trainer_job):
    """(job, [rank 0 samples, rank 1 samples], rank 0's /metrics page) after the last step."""
    job = trainer_job("faults", FAULTS)

    def finished() -> list | None:
        # The final validation and checkpoint come after the last step: only the log's "finished"
        # record (written after them) says the values are final. Scrape after seeing it, not before.
        if not job.records("finished"):
            return None
        scraped = [job.scrape(rank) for rank in (0, 1)]
        assert all(sample_value(s, "rankscope_global_step") == MAX_STEPS for s in scraped)
        return scraped

    scraped = job.wait_for(finished, f"both ranks to finish step {MAX_STEPS}", timeout=420)
    return job, scraped, job.page(1)


def _mean(samples: dict, histogram: str) -> float:
    return sample_value(samples, histogram + "_sum") / sample_value(samples, histogram + "_count")


@pytest.mark.integration
def test_the_straggler_rank_shows_in_its_own_compute_time(faulty_run) -> None:
    _, (rank0, rank1), _ = faulty_run
    slow, fast = _mean(rank1, "rankscope_compute_duration_seconds"), _mean(rank0, "rankscope_compute_duration_seconds")
    assert slow > fast + 0.08, (slow, fast)
    # The fast rank's waiting for it (its compute and its data) is communication time, not compute.
    waited, other = _mean(rank0, "rankscope_comm_duration_seconds"), _mean(rank1, "rankscope_comm_duration_seconds")
    assert waited > other + 0.08, (waited, other)


@pytest.mark.integration
def test_slow_data_loading_shows_in_that_ranks_data_wait(faulty_run) -> None:
    _, (rank0, rank1), _ = faulty_run
    slow, fast = _mean(rank1, "rankscope_data_wait_seconds"), _mean(rank0, "rankscope_data_wait_seconds")
    assert slow > fast + 0.08, (slow, fast)


@pytest.mark.integration
def test_the_memory_balloon_shows_in_that_ranks_resident_memory(faulty_run) -> None:
    _, (rank0, rank1), _ = faulty_run
    grown = sample_value(rank1, "rankscope_process_resident_memory_bytes") - sample_value(
        rank0, "rankscope_process_resident_memory_bytes"
    )
    assert grown > 0.8 * BALLOON_BYTES, grown
    assert 0 < sample_value(rank1, "rankscope_host_memory_used_ratio") < 1


@pytest.mark.integration
def test_a_nonfinite_loss_on_one_rank_is_counted_and_skipped_on_every_rank(faulty_run) -> None:
    _, scraped, _ = faulty_run
    for samples in scraped:
        # At least the two injected steps (the divergence may add its own).
        assert sample_value(samples, "rankscope_nonfinite_steps_total") >= 2
        assert sample_value(samples, "rankscope_skipped_steps_total") >= 2


@pytest.mark.integration
def test_divergence_raises_the_learning_rate_and_the_loss_climbs_far_above_its_minimum(faulty_run) -> None:
    job, scraped, _ = faulty_run
    lr = sample_value(scraped[0], "rankscope_learning_rate", param_group="0")
    assert lr > 100 * 2e-3  # test.yaml's peak rate, times a factor the schedule cannot explain
    # Smoothed (validation) loss before and after, as the divergence alert compares them; the tiny
    # training batches are too noisy to attribute any single spike to the fault.
    val = {r["step"]: r for r in job.records("val")}
    before, after = val[40], val[MAX_STEPS]
    assert after["loss"] > 2 * before["loss"], (before, after)
    assert after["acc_i2t"] < 0.5 * before["acc_i2t"] and after["acc_t2i"] < 0.5 * before["acc_t2i"]
    assert sample_value(scraped[0], "rankscope_loss", split="val") == pytest.approx(after["loss"])
    assert max(sample_value(s, "rankscope_loss_spikes_total") for s in scraped) >= 1


@pytest.mark.integration
def test_both_ranks_serve_the_trainers_own_metrics(faulty_run) -> None:
    job, scraped, page = faulty_run
    for rank, samples in enumerate(scraped):
        assert sample_value(samples, "rankscope_run_info", model="clip-vit", world_size="2") == 1
        assert sample_value(samples, "rankscope_global_step", rank=str(rank), run_id="trainer-test") == MAX_STEPS
        assert sample_value(samples, "rankscope_text_length_tokens_count") > 0
        assert sample_value(samples, "rankscope_image_size_pixels_count") > 0
        assert sample_value(samples, "rankscope_image_channel_std", channel="g") > 0
        assert sample_value(samples, "rankscope_attention_entropy_nats", layer="1") is not None
        assert sample_value(samples, "rankscope_fusion_gate_weight", stat="std") > 0
        assert sample_value(samples, "rankscope_contrastive_temperature") > 0
        assert sample_value(samples, "rankscope_loss", split="val") is not None
        assert (
            sample_value(samples, "rankscope_contrastive_accuracy_ratio", split="val", direction="image_to_text") >= 0
        )
        assert sample_value(samples, "rankscope_checkpoints_total", reason="interval") == MAX_STEPS // 10
        assert sample_value(samples, "rankscope_tokens_total") > sample_value(samples, "rankscope_samples_total")
        # The last step's longest caption: [CLS], a word or more and [SEP], at most data.max_text_length (16).
        assert 3 <= sample_value(samples, "rankscope_sequence_length_max_tokens") <= 16
        # A CPU rank has no device memory: no step peak, though metrics.step_peak_memory is on.
        assert sample_value(samples, "rankscope_step_peak_device_memory_bytes") is None
    # Rank 0 advertised both ranks to Prometheus (file_sd), with the identity labels of their series.
    targets = json.loads(job.targets_file.read_text())
    assert [t["targets"] for t in targets] == [[f"127.0.0.1:{job.metrics_base_port + r}"] for r in (0, 1)]
    assert [t["labels"]["rank"] for t in targets] == ["0", "1"]
    assert {t["labels"]["run_id"] for t in targets} == {"trainer-test"}
    # The page is valid exposition format by Prometheus's own checker.
    checked = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True)
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr


# --- a schedule under torchrun's restarts ------------------------------------------------------------

TWO_CRASHES = "[{kind: crash, at_step: 15, rank: 1}, {kind: crash, at_step: 35, rank: 0, exit_code: 9}]"


@pytest.mark.integration
def test_each_crash_of_a_schedule_fires_once_across_torchruns_restarts_and_the_job_completes(trainer_job) -> None:
    # test.yaml checkpoints every 10 steps: the first attempt crashes at 15, the second resumes from 10 and
    # replays 11..15 without crashing, then crashes at 35; the third resumes from 30 and finishes.
    job = trainer_job("two-crashes", [f"faults.schedule={TWO_CRASHES}"], resume="auto", max_restarts=2)
    assert job.wait_exit(timeout=480) == 0, job.tail()
    fired = [(r["name"], r["step"], r["rank"], r["attempt"]) for r in job.records("fault")]
    assert fired == [("crash-step15", 15, 1, 0), ("crash-step35", 35, 0, 1)]
    assert [r["step"] for r in job.records("resume")] == [10, 30]
    assert [r["step"] for r in job.records("finished")] == [60]
    assert job.output.read_text().count("crashes at step") == 2
    markers = sorted((job.checkpoint_dir / "faults").iterdir())
    assert [(m["name"], m["rank"], m["attempt"]) for m in (json.loads(p.read_text()) for p in markers)] == [
        ("crash-step15", 1, 0), ("crash-step35", 0, 1),
    ]  # fmt: skip
