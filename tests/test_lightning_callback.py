"""The PyTorch Lightning callback: real `lightning.Trainer` runs in this process, and a real 2-process
torchrun DDP job (tests/jobs/lightning_job.py) steered over HTTP. The model and data come from
examples/lightning_example.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import requests
import torch
from rankscope import MonitorConfig, NullMonitor
from rankscope.control import ControlConfig
from rankscope.integrations.lightning.callback import RankscopeCallback, config_hash

from examples.lightning_example import FEATURES, Regression, build_trainer, make_loader
from tests.jobs.lightning_job import LightningJob
from tests.support import (
    REPO,
    contract_violations,
    fetch,
    free_port,
    hold_paused,
    promtool_problems,
    sample_value,
    samples,
)

STEPS = 12
ACCUMULATE = 2
BATCH = 8
STATS_EVERY = 3
CLIP = 0.05  # small enough that Lightning really clips: the reported norm must be the one before


class _Recorder(pl.Callback):
    """What the trainer computed, seen from a second callback (after rankscope's): each optimizer step's
    micro-batch losses and, read-only, its gradient norm before clipping."""

    def __init__(self) -> None:
        self.step_losses: dict[int, float] = {}
        self.norms: dict[int, float] = {}
        self._micro: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.norms[trainer.global_step + 1] = float(torch.stack([g.norm() for g in grads]).norm())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        self._micro.append(float(outputs["loss"]))  # already divided by accumulate_grad_batches
        if len(self._micro) == ACCUMULATE:
            self.step_losses[trainer.global_step], self._micro = sum(self._micro), []


def _fit(
    root: Path, callbacks: list[pl.Callback], steps: int = STEPS, ckpt_path: str | None = None, **trainer_args
) -> tuple[pl.Trainer, Regression]:
    """A seeded single-process fit: the same data, initial weights and settings whatever the callbacks."""
    torch.manual_seed(0)
    model = Regression(learning_rate=0.05, warmup_steps=3)
    settings = {"accumulate_grad_batches": ACCUMULATE, "gradient_clip_val": CLIP, "enable_checkpointing": False}
    settings.update(num_sanity_val_steps=0, val_check_interval=4, limit_val_batches=2)
    trainer = build_trainer(str(root), steps, callbacks, **{**settings, **trainer_args})
    trainer.fit(model, make_loader(256, BATCH), make_loader(64, BATCH, seed=1, shuffle=False), ckpt_path=ckpt_path)
    return trainer, model


def _metrics(**overrides) -> MonitorConfig:
    settings = dict(host="127.0.0.1", base_port=0, module_stats_every_n_steps=STATS_EVERY, resolve_every_n_steps=1)
    return MonitorConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A fit of STEPS optimizer steps of ACCUMULATE micro-batches, with rankscope and a recorder, and the same
    fit without rankscope; yields (trainer, model, callback, recorder, page, baseline model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A token count that is a tensor, as one computed from an attention mask would be.
    callback = RankscopeCallback(_metrics(), count_tokens=lambda batch: (batch[0] != 0).sum())
    recorder = _Recorder()
    try:
        trainer, model = _fit(tmp_path_factory.mktemp("pl_single"), [callback, recorder])
        page = fetch(f"http://127.0.0.1:{callback.monitor.port}/metrics")
        _, baseline = _fit(tmp_path_factory.mktemp("pl_baseline"), [_Recorder()])
        yield trainer, model, callback, recorder, page, baseline
    finally:
        callback.close()
        torch.set_num_threads(threads)


def test_one_step_is_one_optimizer_step_of_accumulated_micro_batches(one_process):
    trainer, _, _, _, page, _ = one_process
    found = samples(page)
    assert trainer.global_step == STEPS
    assert sample_value(found, "rankscope_steps_total") == STEPS
    assert sample_value(found, "rankscope_global_step") == STEPS
    assert sample_value(found, "rankscope_samples_total") == STEPS * ACCUMULATE * BATCH
    assert sample_value(found, "rankscope_tokens_total") == STEPS * ACCUMULATE * BATCH * FEATURES
    for histogram in ("step_duration_seconds", "data_wait_seconds", "compute_duration_seconds"):
        assert sample_value(found, f"rankscope_{histogram}_count") == STEPS, histogram
    assert sample_value(found, "rankscope_step_duration_seconds_sum") > sample_value(
        found, "rankscope_data_wait_seconds_sum"
    )


def test_the_loss_is_the_mean_over_the_step_micro_batches(one_process):
    _, _, _, recorder, page, _ = one_process
    assert sorted(recorder.step_losses) == list(range(1, STEPS + 1))
    assert sample_value(samples(page), "rankscope_loss", split="train") == pytest.approx(recorder.step_losses[STEPS])
    assert sample_value(samples(page), "rankscope_nonfinite_steps_total") == 0


def test_the_grad_norm_is_the_norm_before_clipping_on_the_statistics_interval(one_process):
    _, _, _, recorder, page, _ = one_process
    reported = sample_value(samples(page), "rankscope_grad_norm")
    assert STEPS % STATS_EVERY == 0  # the last step is a statistics step: the gauge holds its norm
    assert reported == pytest.approx(recorder.norms[STEPS], rel=1e-5)
    assert reported > CLIP  # Lightning clipped these gradients to CLIP after rankscope read them


def test_monitoring_does_not_change_training(one_process):
    _, model, _, _, _, baseline = one_process
    trained, untouched = model.state_dict(), baseline.state_dict()
    assert trained.keys() == untouched.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, untouched[name]), name


def test_learning_rate_module_statistics_and_probes_are_recorded(one_process):
    trainer, _, _, _, page, _ = one_process
    found = samples(page)
    rate = trainer.optimizers[0].param_groups[0]["lr"]
    assert sample_value(found, "rankscope_learning_rate", param_group="0") == pytest.approx(rate)
    for module in ("encoder", "head"):  # the LightningModule's top-level children
        assert sample_value(found, "rankscope_module_grad_norm", module=module) > 0, module
        assert sample_value(found, "rankscope_update_ratio", module=module) > 0, module
    assert sample_value(found, "rankscope_process_resident_memory_bytes") > 0


def test_the_validation_loss_is_the_logged_val_loss(one_process):
    trainer, _, _, _, page, _ = one_process
    logged = float(trainer.callback_metrics["val_loss"])
    assert sample_value(samples(page), "rankscope_loss", split="val") == pytest.approx(logged)


def test_run_info_names_the_module_and_hashes_the_setup(one_process):
    trainer, model, _, _, page, _ = one_process
    expected = config_hash(trainer, model)
    assert re.fullmatch(r"[0-9a-f]{12}", expected)
    assert sample_value(samples(page), "rankscope_run_info", model="Regression", config_hash=expected) == 1
    model.hparams.learning_rate = 0.1  # a different setup gets a different hash
    try:
        assert config_hash(trainer, model) != expected
    finally:
        model.hparams.learning_rate = 0.05


def test_the_page_passes_promtool_and_the_metric_contract(one_process):
    page = one_process[4]
    assert promtool_problems(page) == ""
    assert contract_violations(page) == []


def test_save_checkpoint_writes_a_lightning_checkpoint_and_counts_it(one_process, tmp_path):
    trainer, _, callback, _, _, _ = one_process
    callback.checkpoint_dir = str(tmp_path)
    try:
        path = callback.save_checkpoint(trainer, "operator:test")
    finally:
        callback.checkpoint_dir = None
    assert path == str(tmp_path / f"rankscope-step={STEPS}.ckpt")
    assert torch.load(path, weights_only=False)["global_step"] == STEPS
    registry, labels = callback.monitor.registry, callback.monitor.identity.labels()
    assert registry.get_sample_value("rankscope_checkpoints_total", {**labels, "reason": "operator"}) == 1


def test_a_failing_part_of_the_callback_is_counted_and_training_goes_on(tmp_path, caplog):
    def broken_counter(batch) -> int:
        raise ValueError("cannot count this batch")

    callback = RankscopeCallback(_metrics(), count_samples=broken_counter)
    try:
        with caplog.at_level("WARNING", logger="rankscope"):
            trainer, _ = _fit(tmp_path, [callback], steps=3)
        registry, labels = callback.monitor.registry, callback.monitor.identity.labels()
        errors = registry.get_sample_value("rankscope_monitor_errors_total", {**labels, "probe": "lightning_callback"})
        assert trainer.global_step == 3
        assert errors == 3 * ACCUMULATE  # once per micro-batch
        assert registry.get_sample_value("rankscope_steps_total", labels) == 3  # the steps still count
        said = [r.getMessage() for r in caplog.records if "Lightning callback failed" in r.getMessage()]
        assert len(said) == 1 and "cannot count this batch" in said[0]  # logged once
    finally:
        callback.close()


class _Operator(pl.Callback):
    """Posts control requests over HTTP at given steps (before rankscope's callback, so they are applied
    at the same step's boundary) and reads their outcomes while the endpoint still serves."""

    def __init__(self, rankscope: RankscopeCallback, token: str, plan: dict[int, list[str]]) -> None:
        self.rankscope, self.headers, self.plan = rankscope, {"Authorization": f"Bearer {token}"}, plan
        self.ids: dict[str, list[str]] = {}
        self.outcomes: dict[str, dict] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        for action in self.plan.pop(trainer.global_step, []):
            body = {"action": action, "reason": "test"}
            reply = requests.post(
                self.rankscope.control_url + "/v1/actions", json=body, headers=self.headers, timeout=5
            )
            assert reply.status_code == 202, reply.text
            self.ids.setdefault(action, []).append(reply.json()["id"])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        status = requests.get(self.rankscope.control_url + "/v1/status", headers=self.headers, timeout=5).json()
        self.outcomes = {record["id"]: record for record in status["recent"] + status["pending"]}


def _controlled_fit(tmp_path: Path, plan: dict[int, list[str]], steps: int, **trainer_args):
    """A single-process fit with the control endpoint, driven by `plan`; (trainer, callback, outcomes by action)."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    control = ControlConfig(host="127.0.0.1", port=0, token_file=str(token_file))
    callback = RankscopeCallback(_metrics(), control, checkpoint_dir=str(tmp_path / "ckpt"))
    operator = _Operator(callback, "s3cret-token", plan)
    try:
        trainer, _ = _fit(tmp_path, [operator, callback], steps=steps, **trainer_args)
    finally:
        callback.close()
    return trainer, callback, {action: [operator.outcomes[i] for i in ids] for action, ids in operator.ids.items()}


def test_checkpoint_and_stop_act_through_lightning_in_one_process(tmp_path):
    trainer, callback, outcome = _controlled_fit(tmp_path, {2: ["checkpoint"], 5: ["stop"]}, steps=40)
    assert [(r["status"], r["step"]) for r in outcome["checkpoint"]] == [("applied", 2)]
    assert trainer.global_step == 5 and trainer.should_stop  # fit() returned at the stop's step
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rankscope-step=2.ckpt", "rankscope-step=5.ckpt"]
    registry, labels = callback.monitor.registry, callback.monitor.identity.labels()
    for reason in ("operator", "stop"):
        assert registry.get_sample_value("rankscope_checkpoints_total", {**labels, "reason": reason}) == 1, reason
    # A stop is settled when the loop has left, i.e. after the endpoint stopped serving: read its counter.
    for action in ("checkpoint", "stop"):
        counted = {**labels, "action": action, "source": "operator", "result": "applied"}
        assert registry.get_sample_value("rankscope_control_actions_total", counted) == 1, action


def test_lightning_resumes_from_a_control_checkpoint_and_the_step_count_goes_on(tmp_path):
    (tmp_path / "first").mkdir()
    _controlled_fit(tmp_path / "first", {2: ["checkpoint"]}, steps=3)
    callback = RankscopeCallback(_metrics())
    try:
        ckpt = str(tmp_path / "first" / "ckpt" / "rankscope-step=2.ckpt")
        trainer, _ = _fit(tmp_path / "second", [callback], steps=4, ckpt_path=ckpt)
        registry, labels = callback.monitor.registry, callback.monitor.identity.labels()
        assert trainer.global_step == 4
        assert registry.get_sample_value("rankscope_global_step", labels) == 4
        assert registry.get_sample_value("rankscope_steps_total", labels) == 2  # steps 3 and 4, trained here
    finally:
        callback.close()


def test_a_stop_that_lightning_would_ignore_before_min_steps_fails_with_the_reason(tmp_path):
    trainer, _, outcome = _controlled_fit(tmp_path, {2: ["stop"]}, steps=6, min_steps=5)
    [record] = outcome["stop"]
    assert (record["status"], record["step"]) == ("failed", 2), record
    assert "min_steps=5" in record["detail"], record
    assert trainer.global_step == 6  # Lightning trained on, as the outcome says
    assert not (tmp_path / "ckpt").exists()  # checked before saving: no checkpoint for a stop that cannot happen


def test_with_monitoring_off_the_callback_records_nothing_and_training_runs(tmp_path):
    callback = RankscopeCallback(MonitorConfig(enabled=False))
    trainer, _ = _fit(tmp_path, [callback], steps=2)
    assert trainer.global_step == 2
    assert isinstance(callback.monitor, NullMonitor) and callback.monitor.port is None


def test_skip_nonfinite_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="metrics.skip_nonfinite is not supported with the Lightning callback"):
        RankscopeCallback(MonitorConfig(skip_nonfinite=True))


def test_importing_exporter_does_not_import_lightning():
    code = (
        "import sys, exporter, rankscope.control\n"
        "sys.exit(any(name.split('.')[0] in ('lightning', 'pytorch_lightning') for name in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "exporter imported lightning"


# --- two processes under torchrun, steered through the control endpoint --------------------------

#: The training process group's timeout in the 2-process job; the test pauses for longer than this.
PG_TIMEOUT = 4.0
HOLD = PG_TIMEOUT + 1.0
BASE_LR = 0.05  # Regression's rate in the job, reached after its 3 warmup steps
WARMUP = 3


def _page(job: LightningJob, rank: int) -> str:
    return fetch(f"http://127.0.0.1:{job.ready(rank)['metrics_port']}/metrics")


def _both(job: LightningJob, name: str) -> tuple[float | None, float | None]:
    return tuple(sample_value(samples(_page(job, rank)), name) for rank in (0, 1))


def _reached(job: LightningJob, step: int) -> bool:
    return all(job.step_lines(rank) and job.step_lines(rank)[-1]["step"] >= step for rank in (0, 1))


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    """2 processes steered over HTTP: reduce_lr and checkpoint, a pause longer than the training group's
    timeout, resume, then stop. Yields the job (its files stay) and what the tests check."""
    out = tmp_path_factory.mktemp("pl_torchrun")
    job = LightningJob(out, free_port(), free_port(), pg_timeout=PG_TIMEOUT)
    try:
        job.wait_ready()
        reduce_id, save_id = job.post_action("reduce_lr", lr_factor=0.5), job.post_action("checkpoint")
        reduce, save = job.wait_settled(reduce_id), job.wait_settled(save_id)
        job.wait_for(lambda: _reached(job, max(reduce["step"], save["step"]) + 3), "3 steps after the actions")
        pages = {rank: _page(job, rank) for rank in (0, 1)}

        pause = job.wait_settled(job.post_action("pause"))
        job.wait_for(lambda: _both(job, "rankscope_paused") == (1, 1), "both ranks paused")
        hold_paused(lambda name: _both(job, name), pause["step"], HOLD, job.diagnose)
        resume = job.wait_settled(job.post_action("resume"))
        job.wait_for(lambda: _reached(job, pause["step"] + 2), "steps after resume")

        job.post_action("stop")
        code = job.wait_exit(timeout=120)
        assert code == 0, f"torchrun exited {code}\n{job.diagnose()}"
        yield job, {"reduce": reduce, "checkpoint": save, "pause": pause, "resume": resume, "pages": pages}
    finally:
        job.close()


@pytest.mark.integration
def test_each_rank_serves_its_own_metrics_with_comm_time(ddp_job):
    _, seen = ddp_job
    for rank, page in seen["pages"].items():
        found = samples(page)
        assert {dict(labels)["rank"] for name, labels in found if name.startswith("rankscope_")} == {str(rank)}
        assert sample_value(found, "rankscope_run_info", world_size="2", backend="gloo", model="Regression") == 1
        assert sample_value(found, "rankscope_comm_duration_seconds_count") > 0, rank
        assert sample_value(found, "rankscope_comm_duration_seconds_sum") > 0, rank
        assert sample_value(found, "rankscope_module_grad_norm", module="encoder") > 0, rank
        assert promtool_problems(page) == "", rank
        assert contract_violations(page) == [], rank


@pytest.mark.integration
def test_reduce_lr_halves_the_rate_on_both_ranks_from_the_next_step(ddp_job):
    job, seen = ddp_job
    record = seen["reduce"]
    assert record["status"] == "applied", record
    step = record["step"]
    assert step > WARMUP  # the job was past its warmup: the rate is BASE_LR until the reduction
    for rank in (0, 1):
        rates = {line["step"]: line["lr"] for line in job.step_lines(rank)}
        assert {rates[s] for s in range(WARMUP, step + 1)} == {BASE_LR}, rank
        # The LambdaLR warmup recomputes lr from its base LRs every step: they were scaled too.
        after = {lr for s, lr in rates.items() if s > step}
        assert after == {BASE_LR * 0.5} and step + 1 in rates, (rank, after)


@pytest.mark.integration
def test_a_checkpoint_request_writes_a_lightning_checkpoint_at_that_step(ddp_job):
    job, seen = ddp_job
    record = seen["checkpoint"]
    assert record["status"] == "applied", record
    path = job.out / "checkpoints" / f"rankscope-step={record['step']}.ckpt"
    assert torch.load(path, weights_only=False)["global_step"] == record["step"]
    for rank in (0, 1):
        assert record["step"] in job.saved_at(rank), rank  # every rank took part in trainer.save_checkpoint
        found = samples(seen["pages"][rank])
        assert sample_value(found, "rankscope_checkpoints_total", reason="operator") == 1, rank


@pytest.mark.integration
def test_a_pause_longer_than_the_collective_timeout_holds_both_ranks_then_resumes(ddp_job):
    """Both ranks stopped training at the same step for HOLD seconds (checked in the fixture and in their
    step times), and trained on afterwards: no collective of the training group was left waiting."""
    job, seen = ddp_job
    pause, resume = seen["pause"], seen["resume"]
    assert (pause["status"], resume["status"]) == ("applied", "applied"), (pause, resume)
    assert pause["step"] == resume["step"]
    for rank in (0, 1):
        times = {line["step"]: line["t"] for line in job.step_lines(rank)}
        assert times[pause["step"] + 1] - times[pause["step"]] >= HOLD, rank


@pytest.mark.integration
def test_stop_checkpoints_then_ends_training_on_both_ranks(ddp_job):
    job, seen = ddp_job
    results = {rank: job.result(rank) for rank in (0, 1)}
    stopped_at = results[0]["global_step"]
    assert stopped_at > seen["pause"]["step"]
    for rank, result in results.items():
        assert result == {"global_step": stopped_at, "should_stop": True, "status": "finished"}, rank
        assert job.step_lines(rank)[-1]["step"] == stopped_at, rank
        assert job.saved_at(rank)[-1] == stopped_at, rank
        final = samples(job.final_page(rank))
        assert sample_value(final, "rankscope_checkpoints_total", reason="stop") == 1, rank
        assert sample_value(final, "rankscope_run_finished") == 1, rank
    path = job.out / "checkpoints" / f"rankscope-step={stopped_at}.ckpt"
    assert torch.load(path, weights_only=False)["global_step"] == stopped_at
    applied = samples(job.final_page(0))
    assert sample_value(applied, "rankscope_control_actions_total", action="stop", result="applied") == 1
    log = job.log.read_text()
    for rank in (0, 1):  # the end of the run says the stop was applied, on every rank
        assert f"[rank {rank}] rankscope: rank {rank} applied stop at step {stopped_at}" in log, log[-3000:]


@pytest.mark.integration
def test_a_restart_resumes_the_trainer_from_the_newest_checkpoint_and_is_settled_applied_with_the_lost_steps(tmp_path):
    """docs/hangs.md's recipe for the callbacks: `control.state_dir` and a restarted run that fits from
    `newest_checkpoint`. torchrun (--max-restarts 1) starts the group again after `restart`; the new
    incarnation trains on from the checkpoint's step and its rank 0 settles the restart applied, naming the
    steps lost since the checkpoint."""
    checkpoints = tmp_path / "checkpoints"
    job = LightningJob(
        tmp_path, free_port(), free_port(), PG_TIMEOUT, control={"state_dir": str(checkpoints)}, max_restarts=1
    )
    try:
        job.wait_ready()
        save = job.wait_settled(job.post_action("checkpoint"))
        assert save["status"] == "applied", save
        job.wait_for(lambda: _reached(job, save["step"] + 3), "3 steps after the checkpoint")
        restart_id = job.post_action("restart", reason="test")

        def settled() -> dict | None:  # by the new incarnation; the endpoint is down in between
            found = [r for r in job.status()["recent"] if r["id"] == restart_id and r["status"] != "pending"]
            return found[0] if found else None

        restart = job.wait_for(settled, "the restart settled by the new incarnation", timeout=180)
        job.wait_for(lambda: _reached(job, restart["step"] + 2), "steps after the restart")
        job.post_action("stop")
        assert job.wait_exit(timeout=120) == 0, job.diagnose()
    finally:
        job.close()

    assert restart["status"] == "applied", restart
    for rank in (0, 1):
        steps = [line["step"] for line in job.step_lines(rank)]
        drops = [n for n in range(1, len(steps)) if steps[n] <= steps[n - 1]]
        assert len(drops) == 1, (rank, steps)  # one restart, and each incarnation's steps go up one by one
        before, after = steps[: drops[0]], steps[drops[0] :]
        assert after == list(range(save["step"] + 1, after[-1] + 1)), (rank, steps)  # on from the checkpoint
        assert before == list(range(1, before[-1] + 1)), (rank, steps)
        lost = before[-1] - save["step"]
        assert f"{lost} step(s) after the newest checkpoint lost" in restart["detail"], (rank, restart, steps)
    assert sample_value(samples(job.final_page(0)), "rankscope_restart_lost_steps_total") == lost
    assert job.result(0)["global_step"] == job.result(1)["global_step"] > restart["step"]


@pytest.mark.integration
def test_under_lightnings_own_launcher_each_rank_serves_its_own_identity(tmp_path):
    """`python train.py` with Trainer(strategy="ddp", devices=2): Lightning starts rank 1 itself and sets
    LOCAL_RANK and WORLD_SIZE but not RANK. The identity comes from the trainer: two ranks, two identities,
    and each rank's log lines carry its own rank."""
    log = tmp_path / "job.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, "tests/jobs/lightning_launcher_job.py", "--out", str(tmp_path)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=240,
        )
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    for rank in (0, 1):
        identity = json.loads((tmp_path / f"rank{rank}.identity.json").read_text())
        assert (identity["rank"], identity["local_rank"], identity["world_size"]) == (rank, rank, 2), identity
        page = samples((tmp_path / f"rank{rank}.metrics.txt").read_text())
        ranks = {dict(labels)["rank"] for (_, labels) in page if "rank" in dict(labels)}
        assert ranks == {str(rank)}, (rank, ranks)
        assert f"[rank {rank}] rankscope: rank {rank} metrics at" in text, text[-4000:]


def test_without_a_control_token_the_run_stops_with_one_line_and_no_traceback(tmp_path):
    """A run asked for control without RANKSCOPE_CONTROL_TOKEN: one line naming the problem, exit status 1
    (before: about 30 lines of traceback per rank)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in ("RANKSCOPE_CONTROL_TOKEN", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "tests/jobs/lightning_launcher_job.py", "--out", str(tmp_path), "--devices", "1", "--control"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "needs a bearer token" in line]
    assert len(lines) == 1 and lines[0].startswith("rankscope: "), done.stderr[-3000:]
