"""rankscope_trainer.faults: each switch does what it says, and leaves its signature in the scraped metrics.

The unit tests drive a FaultInjector directly. The integration tests share one
2-rank torchrun run (CPU is scarce) with every switch but the crash on, at
different steps and ranks, and scrape both ranks' /metrics over HTTP once the
run has finished (it keeps serving for `run.linger_seconds`). The crash is
tested with torchrun's restarts in test_trainer_training.py.
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
    faults = FaultInjector(_faults(diverge={"at_step": 3, "lr_factor": 50}), rank=1, restart_count=0)
    for step in (1, 2, 3, 4):
        faults.at_step_start(step, optimizer, scheduler)
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5.0)  # once, and not undone by the scheduler


def test_a_nonfinite_loss_comes_only_at_its_steps_and_on_its_rank() -> None:
    config = _faults(nonfinite={"at_step": 5, "steps": 2, "rank": 0})
    mine, other = FaultInjector(config, rank=0, restart_count=0), FaultInjector(config, rank=1, restart_count=0)
    loss = torch.tensor(1.0, requires_grad=True)
    bad_steps = [step for step in range(1, 10) if torch.isnan(mine.after_forward(step, loss * 2))]
    assert bad_steps == [5, 6]
    assert all(torch.isfinite(other.after_forward(step, loss * 2)) for step in range(1, 10))
    poisoned = mine.after_forward(5, loss * 2)
    poisoned.backward()
    assert torch.isnan(loss.grad)  # backward still runs, as for a real overflow


def test_poison_scrambles_the_captions_of_its_data_batches_only_and_draws_no_randomness() -> None:
    from rankscope_trainer.data import Batch

    def batch() -> Batch:
        ids = torch.arange(12).reshape(4, 3)
        return Batch(torch.zeros(4, 3, 2, 2), ids, torch.ones(4, 3, dtype=torch.long), torch.tensor([3, 2, 3, 1]),
                     torch.ones(4, 2, dtype=torch.long))  # fmt: skip

    faults = FaultInjector(_faults(poison={"at_batch": 5, "batches": 2}), rank=0, restart_count=0)
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


def test_a_memory_balloon_grows_resident_memory_step_by_step_up_to_its_size() -> None:
    process = psutil.Process()
    faults = FaultInjector(
        _faults(memory_balloon={"at_step": 2, "rank": 0, "bytes": 96_000_000, "step_bytes": 48_000_000}),
        rank=0,
        restart_count=0,
    )
    optimizer, scheduler = _optimizer_and_scheduler()
    before = process.memory_info().rss
    faults.at_step_start(1, optimizer, scheduler)
    assert process.memory_info().rss - before < 30_000_000
    faults.at_step_start(2, optimizer, scheduler)
    faults.at_step_start(3, optimizer, scheduler)
    faults.at_step_start(4, optimizer, scheduler)  # full: no more
    grown = process.memory_info().rss - before
    assert 90_000_000 <= grown < 140_000_000


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


def test_a_slow_checkpoint_delays_the_first_save_at_or_after_its_step_and_no_other() -> None:
    faults = FaultInjector(_faults(slow_checkpoint={"at_step": 15, "seconds": 0.2}), rank=0)
    state = lambda: {"step": 1}  # noqa: E731 - the loop's state_dict, as save() calls it

    def timed(step: int) -> float:
        started = time.perf_counter()
        assert faults.slow_checkpoint(step, state)() == {"step": 1}
        return time.perf_counter() - started

    assert timed(10) < 0.1
    assert timed(20) >= 0.2  # the first save at or after step 15
    assert timed(30) < 0.1  # once only
    # A restarted group (torchrun's TORCHELASTIC_RESTART_COUNT) saves at normal speed, as crash and hang
    # happen on the first attempt only.
    restarted = FaultInjector(_faults(slow_checkpoint={"at_step": 15, "seconds": 0.2}), rank=0, restart_count=1)
    started = time.perf_counter()
    restarted.slow_checkpoint(20, state)()
    assert time.perf_counter() - started < 0.1
    with pytest.raises(ValueError, match=r"^faults.slow_checkpoint.seconds must be >= 0, got -1.0$"):
        _faults(slow_checkpoint={"at_step": 5, "seconds": -1})


def test_a_crash_exits_the_process_on_the_first_attempt_only() -> None:
    script = (
        "import torch\n"
        "from rankscope_trainer.faults import FaultInjector, FaultsConfig, CrashFault\n"
        "opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)\n"
        "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)\n"
        "cfg = FaultsConfig(crash=CrashFault(at_step=2, rank=0, exit_code=17))\n"
        "import sys; attempt = int(sys.argv[1])\n"
        "faults = FaultInjector(cfg, rank=0, restart_count=attempt)\n"
        "for step in (1, 2, 3): faults.at_step_start(step, opt, sched)\n"
        "print('survived')\n"
    )
    first = subprocess.run([sys.executable, "-c", script, "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert first.returncode == 17 and "survived" not in first.stdout
    assert "crashes at step 2" in first.stderr
    restarted = subprocess.run(
        [sys.executable, "-c", script, "1"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert restarted.returncode == 0 and "survived" in restarted.stdout


@pytest.mark.parametrize("kind", ["data", "compute"])
def test_a_hang_blocks_the_rank_where_its_stacks_show_it_on_the_first_attempt_only(kind) -> None:
    script = (
        "import sys, torch\n"
        "from rankscope.control.endpoint import serve_control\n"
        "from rankscope.control.peer import create_peer_app\n"
        "from rankscope_trainer.faults import FaultInjector, FaultsConfig, HangFault\n"
        "kind, attempt = sys.argv[1], int(sys.argv[2])\n"
        "faults = FaultInjector(FaultsConfig(hang=HangFault(at_step=2, rank=0, kind=kind)), 0, attempt)\n"
        "print(serve_control(create_peer_app(0, 'tok'), '127.0.0.1', 0).url, flush=True)\n"
        "for step in (1, 2, 3):\n"
        "    if kind == 'data': list(faults.slow_data([None], lambda: step))\n"
        "    else: faults.after_forward(step, torch.zeros(()))\n"
        "print('survived', flush=True)\n"
    )
    hung = subprocess.Popen([sys.executable, "-c", script, kind, "0"], cwd=REPO, stdout=subprocess.PIPE, text=True)
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
    restarted = subprocess.run(
        [sys.executable, "-c", script, kind, "1"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert restarted.returncode == 0 and "survived" in restarted.stdout


def test_a_hang_of_an_unknown_kind_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^faults.hang.kind must be one of data, compute, collective, got 'disk'$"):
        HangFault(at_step=3, kind="disk")


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
    "faults.slow_data.at_step=3",
    "faults.slow_data.rank=0",
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
    # The fast rank's waiting for it is communication time, not compute.
    assert _mean(rank0, "rankscope_comm_duration_seconds") > _mean(rank1, "rankscope_comm_duration_seconds")


@pytest.mark.integration
def test_slow_data_loading_shows_in_that_ranks_data_wait(faulty_run) -> None:
    _, (rank0, rank1), _ = faulty_run
    slow, fast = _mean(rank0, "rankscope_data_wait_seconds"), _mean(rank1, "rankscope_data_wait_seconds")
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
