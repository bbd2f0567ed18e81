"""rollback and reduce_micro_batch under the real transformers.Trainer (tiny BERT from examples/hf_trainer.py, CPU),
requested over the real control endpoint by an operator that posts from inside the run at chosen steps.

What the model trained on is observed, not assumed: a forward pre-hook names the dataset rows of every micro-batch,
and the dataset records the order the data loader fetched them in (skipped batches are fetched, then dropped)."""

from __future__ import annotations

import copy
import json
import logging
import secrets

import pytest
import requests
import safetensors.torch
import torch
from rankscope import MonitorConfig
from rankscope.control import ControlConfig
from rankscope.integrations.hf.callback import RankscopeCallback
from rankscope.integrations.hf.recovery import POSITION_FILE, RECORD_FILE, ROLLED_BACK_DIR
from transformers import TrainerCallback

from examples.hf_trainer import MajorityDataset, build_trainer
from tests.support import fetch, free_port, free_port_block, sample_value, samples, stop_process, torchrun, wait_for

TOKEN = "hf-recovery-test-token"
BATCH = 4


class TracedDataset(MajorityDataset):
    """MajorityDataset that records the indices the data loader fetches, in order."""

    def __init__(self, size: int, seed: int = 0) -> None:
        super().__init__(size, seed)
        self.fetched: list[int] = []
        self.row = {bytes(row.numpy().tobytes()): i for i, row in enumerate(self.input_ids)}
        assert len(self.row) == size, "generated rows must be unique to name micro-batches by them"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.fetched.append(index)
        return super().__getitem__(index)

    def batches(self, size: int) -> list[tuple[int, ...]]:
        """The fetched data as consecutive batches of `size`: position p is the p-th batch the loader produced."""
        return [tuple(self.fetched[i : i + size]) for i in range(0, len(self.fetched) - size + 1, size)]


def trace_training(trainer, dataset: TracedDataset) -> list[tuple[int, ...]]:
    """The dataset rows of every micro-batch the model is trained on, in order (a forward pre-hook)."""
    trained: list[tuple[int, ...]] = []

    def hook(module, args, kwargs):
        trained.append(tuple(dataset.row[bytes(row.numpy().tobytes())] for row in kwargs["input_ids"]))

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    return trained


class Operator(TrainerCallback):
    """Posts control requests over HTTP at the first on_step_end of given steps, and looks at the run right
    after a rollback. Added after RankscopeCallback, so each event sees what the channel did at that boundary."""

    def __init__(self, rankscope: RankscopeCallback, requests_at: dict[int, list[dict]]) -> None:
        self.rankscope = rankscope
        self.requests_at = requests_at
        self.ids: list[str] = []
        self.seen: list[int] = []  # global_step after each on_step_end
        self.after_rollback: dict | None = None
        self.status: dict | None = None

    def call(self, path: str, body: dict | None = None) -> dict:
        url, headers = self.rankscope.control_url + path, {"Authorization": f"Bearer {TOKEN}"}
        response = (
            requests.post(url, json=body, headers=headers, timeout=5)
            if body
            else requests.get(url, headers=headers, timeout=5)
        )
        response.raise_for_status()
        return response.json()

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        step = state.global_step
        went_back = bool(self.seen) and step <= self.seen[-1]
        self.seen.append(step)
        if went_back and self.after_rollback is None:
            self.after_rollback = {
                "step": step,
                "model": {name: value.detach().clone() for name, value in model.state_dict().items()},
                "optimizer": copy.deepcopy(optimizer.state_dict()),
                "scheduler_step": lr_scheduler.last_epoch,
            }
        elif self.after_rollback is not None and self.status is None and step > self.after_rollback["step"]:
            self.status = self.call("/v1/status")  # the boundary after the rollback settled it
        for body in self.requests_at.pop(step, []) if not went_back else []:
            self.ids.append(self.call("/v1/actions", body)["id"])


def controlled(tmp_path, **settings) -> ControlConfig:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    return ControlConfig(
        port=0, token_file=str(token_file), handle_signals=False, rollback_cooldown_seconds=0, **settings
    )


def metrics() -> MonitorConfig:
    return MonitorConfig(host="127.0.0.1", base_port=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread per training run (module-wide, so it holds for the module's shared run too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(trainer, callback, operator: Operator | None = None, **train) -> dict:
    """Train; what the tests check, read before the metrics server closes."""
    if operator is not None:
        trainer.add_callback(operator)
    try:
        trainer.train(**train)
        page = samples(fetch(f"http://127.0.0.1:{callback.monitor.port}/metrics"))
    finally:
        callback.close()
    return {"page": page, "history": trainer.state.log_history, "state": trainer.state}


# --- one run: refusals early on, then a rollback to an older checkpoint with a margin of data skipped ----------------

STEPS = 20


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """Checkpoints every 4 steps. At step 2 the operator asks reduce_micro_batch and a rollback before step 3
    (no checkpoint yet); at step 10 a rollback before step 8 with lr_factor 0.5, carried out at step 11:
    checkpoint-4, and the 7 batches trained since it (more than the 4 up to the incident) plus 5 (margin)
    skipped after it."""
    out = tmp_path_factory.mktemp("hf_rollback")
    dataset = TracedDataset(4096)
    trainer = build_trainer(str(out), STEPS, batch_size=BATCH, save_steps=4)
    trainer.train_dataset = dataset
    callback = RankscopeCallback.attach(trainer, metrics(), controlled(out, rollback_margin_batches=5))
    operator = Operator(
        callback,
        {
            2: [
                {"action": "reduce_micro_batch", "reason": "test"},
                {"action": "rollback", "reason": "too early", "params": {"before_step": 3}},
            ],
            10: [{"action": "rollback", "reason": "test", "params": {"before_step": 8, "lr_factor": 0.5}}],
        },
    )
    trained = trace_training(trainer, dataset)
    result = run(trainer, callback, operator)
    return {**result, "out": out, "operator": operator, "trained": trained, "data": dataset.batches(BATCH)}


def _recent(rolled_back) -> dict[str, dict]:
    recent = {record["id"]: record for record in rolled_back["operator"].status["recent"]}
    micro, early, rollback = rolled_back["operator"].ids
    return {"micro": recent[micro], "early": recent[early], "rollback": recent[rollback]}


def test_the_rollback_is_applied_and_global_step_goes_back_to_the_checkpoint(rolled_back):
    record = _recent(rolled_back)["rollback"]
    assert record["status"] == "applied", record
    assert record["step"] == 11
    operator = rolled_back["operator"]
    assert operator.seen == list(range(1, 11)) + list(range(4, STEPS + 1))
    assert rolled_back["state"].global_step == STEPS
    assert sample_value(rolled_back["page"], "rankscope_global_step") == STEPS
    assert (
        sample_value(rolled_back["page"], "rankscope_control_actions_total", action="rollback", result="applied") == 1
    )


def test_model_optimizer_and_scheduler_hold_the_checkpoint_after_the_rollback(rolled_back):
    after, folder = rolled_back["operator"].after_rollback, rolled_back["out"] / "checkpoint-4"
    assert after["step"] == 4
    saved = safetensors.torch.load_file(str(folder / "model.safetensors"))
    assert saved.keys() <= after["model"].keys()
    assert all(torch.equal(after["model"][name], value) for name, value in saved.items())
    saved_optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    for index, state in saved_optimizer["state"].items():
        live = after["optimizer"]["state"][index]
        assert torch.equal(live["exp_avg"], state["exp_avg"]) and torch.equal(live["step"], state["step"])
    assert after["scheduler_step"] == 4


def test_the_data_after_the_checkpoint_is_skipped_not_replayed(rolled_back):
    """Steps 1-11 trained batches 0-10; after the rollback step 5 trains batch 16: batches 4-15 (trained
    since checkpoint-4, plus 11-15, fetched and dropped) are the skipped window."""
    data, trained = rolled_back["data"], rolled_back["trained"]
    assert trained == data[:11] + data[16 : 16 + STEPS - 4]
    assert sample_value(rolled_back["page"], "rankscope_skipped_batches_total") == 12


def test_the_rollback_is_recorded_beside_the_checkpoints(rolled_back):
    out = rolled_back["out"]
    (record,) = json.loads((out / RECORD_FILE).read_text())
    assert {
        k: record[k] for k in ("step", "checkpoint", "checkpoint_step", "skipped_batches", "data_from", "data_to")
    } == {
        "step": 11,
        "checkpoint": "checkpoint-4",
        "checkpoint_step": 4,
        "skipped_batches": 12,
        "data_from": 4,
        "data_to": 16,
    }
    assert record["lr_factor"] == 0.5 and record["reason"] == "operator:test"
    # checkpoint-8 of the abandoned steps is moved away; the one there now was written after the rollback.
    moved = out / ROLLED_BACK_DIR / "rollback-1-at-step-11" / "checkpoint-8"
    assert record["abandoned"]["checkpoints"] == ["checkpoint-8"] and (moved / "model.safetensors").is_file()
    positions = {step: json.loads((out / f"checkpoint-{step}" / POSITION_FILE).read_text()) for step in (4, 8, 12, 20)}
    assert {step: p["data_steps"] for step, p in positions.items()} == {4: 4, 8: 20, 12: 24, 20: 32}
    assert json.loads((moved / POSITION_FILE).read_text())["data_steps"] == 8


def test_after_the_rollback_logging_restarts_at_the_checkpoint_with_the_reduced_rate(rolled_back):
    logged = [entry for entry in rolled_back["history"] if "loss" in entry]
    # Step 11's loss belongs to a dropped step and is not logged; logging restarts at step 5.
    assert [entry["step"] for entry in logged] == list(range(1, 11)) + list(range(5, STEPS + 1))
    assert {entry["learning_rate"] for entry in logged[:10]} == {1e-3}
    assert {entry["learning_rate"] for entry in logged[10:]} == {5e-4}
    assert all(0 < entry["loss"] < 10 for entry in logged)


def test_a_rollback_without_a_checkpoint_before_the_step_is_refused(rolled_back):
    record = _recent(rolled_back)["early"]
    assert record["status"] == "refused_unavailable", record
    assert record["detail"] == f"no checkpoint-<N> with N < 3 in {rolled_back['out']}"
    page = rolled_back["page"]
    assert sample_value(page, "rankscope_control_actions_total", action="rollback", result="refused_unavailable") == 1


def test_reduce_micro_batch_is_refused_with_what_to_do_instead(rolled_back):
    record = _recent(rolled_back)["micro"]
    assert record["status"] == "refused_unavailable", record
    assert record["detail"] == (
        "transformers.Trainer builds its DataLoader (batch 4) once per train() and counts micro-batches in its loop: "
        "restart with per_device_train_batch_size=2, gradient_accumulation_steps=2"
    )
    assert sample_value(rolled_back["page"], "rankscope_micro_batch_size") == BATCH


# --- resuming the rolled-back run from checkpoint-12 (data position 24) ---------------------------------------------


def _resume(rolled_back, ignore_data_skip: bool) -> list[tuple[int, ...]]:
    dataset = TracedDataset(4096)
    trainer = build_trainer(str(rolled_back["out"]), 14, batch_size=BATCH)
    trainer.train_dataset = dataset
    trainer.args.ignore_data_skip = ignore_data_skip
    trained = trace_training(trainer, dataset)
    run(
        trainer,
        RankscopeCallback.attach(trainer, metrics(), controlled(rolled_back["out"])),
        resume_from_checkpoint=str(rolled_back["out"] / "checkpoint-12"),
    )
    return trained


def test_a_resume_with_ignore_data_skip_skips_the_window_again(rolled_back):
    """The original run's steps 13 and 14 (after the rollback) trained data batches 24 and 25; so does the resume."""
    assert _resume(rolled_back, ignore_data_skip=True) == rolled_back["data"][24:26]


def test_the_trainers_own_resume_trains_on_the_skipped_window_and_warns(rolled_back, caplog):
    """The documented limit: the Trainer fast-forwards global_step (12) batches, batch 12 was skipped."""
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        trained = _resume(rolled_back, ignore_data_skip=False)
    assert trained == rolled_back["data"][12:14]
    said = [r.getMessage() for r in caplog.records if "ignore_data_skip=True" in r.getMessage()]
    assert said == [
        "rankscope: resumed at step 12 from data position 24: the Trainer fast-forwards only 12 batches, so batches "
        "12-23, which the run had skipped or trained already, are trained on again; resume with "
        "TrainingArguments(ignore_data_skip=True) to let rankscope continue at 24"
    ]


def _plain_run(out, control: bool, resume: str | None = None, ignore_data_skip: bool = False) -> list:
    """6 steps (or on to 6 from `resume`), checkpoints every 2, no rollback; the micro-batches trained."""
    dataset = TracedDataset(4096)
    trainer = build_trainer(str(out), 6, batch_size=BATCH, save_steps=2)
    trainer.train_dataset = dataset
    trainer.args.ignore_data_skip = ignore_data_skip
    trained = trace_training(trainer, dataset)
    callback = RankscopeCallback.attach(trainer, metrics(), controlled(out) if control else None)
    run(trainer, callback, **({"resume_from_checkpoint": resume} if resume else {}))
    return trained


def test_metrics_alone_write_nothing_into_the_trainers_checkpoints(tmp_path):
    _plain_run(tmp_path, control=False)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not list(tmp_path.glob("checkpoint-*/rankscope.json"))


def test_where_no_rollback_skipped_data_ignore_data_skip_keeps_its_meaning(tmp_path):
    """A resume from checkpoint-4 with ignore_data_skip and no rollback before it starts the epoch's data again,
    exactly as without the callback's control."""
    _plain_run(tmp_path / "a", control=True)
    _plain_run(tmp_path / "b", control=False)
    resumed = {
        control: _plain_run(tmp_path / name, control, str(tmp_path / name / "checkpoint-4"), ignore_data_skip=True)
        for name, control in (("a", True), ("b", False))
    }
    assert resumed[True] == resumed[False] and len(resumed[True]) == 2


# --- a skip that reaches into the next epoch, with gradient accumulation --------------------------------------------


def test_a_skip_past_the_end_of_the_epoch_continues_in_the_next_one(tmp_path):
    """48 samples in micro-batches of 4 with 2 accumulated: 6 steps an epoch. At step 5 a rollback to
    checkpoint-4 skipping 4 batches: 1 trained since, 1 more left in epoch 0, 2 at the start of epoch 1.
    Epoch 2 is whole again; the fixed 3 epochs end at step 14, one below max_steps."""
    dataset = TracedDataset(48)
    trainer = build_trainer(str(tmp_path), 15, batch_size=BATCH, save_steps=2)
    trainer.train_dataset = dataset
    trainer.args.gradient_accumulation_steps = 2
    callback = RankscopeCallback.attach(trainer, metrics(), controlled(tmp_path))
    body = {"action": "rollback", "reason": "test", "params": {"before_step": 5, "skip_batches": 4}}
    operator = Operator(callback, {4: [body]})
    trained = trace_training(trainer, dataset)
    result = run(trainer, callback, operator)

    (record,) = operator.status["recent"]
    assert record["status"] == "applied", record
    assert operator.seen == [1, 2, 3, 4, 4] + list(range(5, 15))
    data = dataset.batches(BATCH)
    assert len(data) == 36  # 3 epochs of 12 micro-batches, every one fetched
    assert trained == data[:10] + data[16:36]
    assert result["state"].global_step == 14
    assert sample_value(result["page"], "rankscope_skipped_batches_total") == 4


# --- two processes under torchrun ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_both_processes_roll_back_to_the_same_checkpoint_and_skip_alike(tmp_path):
    """examples/hf_trainer.py under torchrun, saving every 4 steps: a rollback before step 6 takes every
    process back to checkpoint-4 at the same step, and each skips the same data."""
    from tests.test_hf_callback import _Job  # the 2-process job as test_hf_callback drives it

    job = _Job(free_port_block(2), free_port(), secrets.token_hex(16), tmp_path / "torchrun.log")
    target = ["examples/hf_trainer.py", "--output-dir", str(tmp_path), "--max-steps", "100000", "--save-steps", "4"]
    target += ["--metrics-host", "127.0.0.1", "--base-port", str(job.base_port), "--module-stats-every", "1000"]
    target += ["--control", "--control-port", job.control.rsplit(":", 1)[1]]
    proc = torchrun(2, target, master_port=free_port(), extra_env={"RANKSCOPE_CONTROL_TOKEN": job.token}, log=job.log)
    try:
        job.wait_for_steps(proc, 9)
        (record,) = job.settled([job.act("rollback", reason="test", params={"before_step": 6})]).values()
        assert record["status"] == "applied", record
        skipped = wait_for(lambda: min(job.both("rankscope_skipped_batches_total")), 60, "skip counters", job.diagnose)
        assert job.both("rankscope_skipped_batches_total") == (skipped, skipped)
        job.act("stop", reason="test done")
        assert proc.wait(timeout=120) == 0, job.diagnose()
    finally:
        stop_process(proc)
    (written,) = json.loads((tmp_path / RECORD_FILE).read_text())
    assert (written["checkpoint"], written["step"], written["skipped_batches"]) == (
        "checkpoint-4",
        record["step"],
        skipped,
    )
    # Default window: the steps trained since checkpoint-4 (past the incident, before_step 6), plus the margin.
    assert skipped == written["step"] - 4 + ControlConfig().rollback_margin_batches
    histories = [json.loads((tmp_path / f"log_history.rank{rank}.json").read_text()) for rank in (0, 1)]
    steps = [[entry["step"] for entry in history if "loss" in entry] for history in histories]
    assert steps[0] == steps[1]
    back = next(i for i in range(1, len(steps[0])) if steps[0][i] <= steps[0][i - 1])
    assert steps[0][:back] == list(range(1, written["step"])) and steps[0][back : back + 2] == [5, 6]
