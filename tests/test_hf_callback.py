"""The Hugging Face Trainer callback: a real Trainer in this process, and a real 2-process torchrun job
whose control endpoint is driven over HTTP. The model and data come from examples/hf_trainer.py."""

from __future__ import annotations

import json
import math
import re
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from rankscope import METRICS, MonitorConfig
from rankscope.integrations.hf.callback import RankscopeCallback, config_hash
from transformers import TrainerControl, TrainerState, TrainingArguments

from examples.hf_trainer import build_trainer
from tests.support import (
    REPO,
    contract_families,
    contract_violations,
    fetch,
    hold_paused,
    promtool_problems,
    sample_value,
    samples,
    stop_process,
    tail,
    torchrun,
    wait_for,
)

STEPS = 30
BATCH = 8


# --- one process, in this process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A Trainer for STEPS steps (saving every 20) with the callback; yields (trainer, callback, page)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("hf_single")
    trainer = build_trainer(str(out), STEPS, batch_size=BATCH, save_steps=20)
    metrics = MonitorConfig(host="127.0.0.1", base_port=0, module_stats_every_n_steps=5, resolve_every_n_steps=1)
    callback = RankscopeCallback.attach(trainer, metrics)
    try:
        trainer.train()
        page = fetch(f"http://127.0.0.1:{callback.monitor.port}/metrics")
        yield trainer, callback, page
    finally:
        callback.close()
        torch.set_num_threads(threads)


def test_a_trainer_run_counts_its_steps_samples_and_tokens(trainer_run):
    trainer, _, page = trainer_run
    found = samples(page)
    assert sample_value(found, "rankscope_steps_total") == STEPS
    assert sample_value(found, "rankscope_global_step") == STEPS
    assert sample_value(found, "rankscope_samples_total") == STEPS * BATCH
    # One process: its share of the Trainer's (non-padding) token count is all of it.
    assert sample_value(found, "rankscope_tokens_total") == trainer.state.num_input_tokens_seen > STEPS * BATCH
    for histogram in ("step_duration_seconds", "data_wait_seconds", "compute_duration_seconds"):
        assert sample_value(found, f"rankscope_{histogram}_count") == STEPS, histogram
    assert sample_value(found, "rankscope_step_duration_seconds_sum") > 0


def test_loss_grad_norm_and_learning_rate_match_the_trainer_logs(trainer_run):
    trainer, _, page = trainer_run
    found = samples(page)
    last = [entry for entry in trainer.state.log_history if "loss" in entry][-1]
    assert last["step"] == STEPS
    assert sample_value(found, "rankscope_loss", split="train") == pytest.approx(last["loss"])
    assert sample_value(found, "rankscope_grad_norm") == pytest.approx(last["grad_norm"])
    assert sample_value(found, "rankscope_learning_rate", param_group="0") == pytest.approx(1e-3)
    assert sample_value(found, "rankscope_nonfinite_steps_total") == 0


def test_module_statistics_and_probes_are_recorded(trainer_run):
    _, _, page = trainer_run
    found = samples(page)
    assert sample_value(found, "rankscope_module_grad_norm", module="bert") > 0
    assert sample_value(found, "rankscope_update_ratio", module="classifier") > 0
    assert sample_value(found, "rankscope_process_resident_memory_bytes") > 0
    assert 0 < sample_value(found, "rankscope_host_memory_used_ratio") <= 1


def test_run_info_names_the_model_and_hashes_the_training_arguments(trainer_run):
    trainer, _, page = trainer_run
    info = sample_value(samples(page), "rankscope_run_info", model="BertForSequenceClassification")
    assert info == 1
    expected = config_hash(trainer.args, trainer.model)
    assert sample_value(samples(page), "rankscope_run_info", config_hash=expected) == 1
    assert re.fullmatch(r"[0-9a-f]{12}", expected)


def test_trainer_checkpoints_are_counted_by_reason(trainer_run):
    _, _, page = trainer_run
    found = samples(page)
    assert sample_value(found, "rankscope_checkpoints_total", reason="interval") == 1  # step 20
    assert sample_value(found, "rankscope_checkpoints_total", reason="final") == 1  # step 30, the last
    assert sample_value(found, "rankscope_checkpoint_duration_seconds_count") == 2


def test_the_page_passes_promtool_check_metrics(trainer_run):
    assert promtool_problems(trainer_run[2]) == ""


def test_every_series_has_the_contract_name_and_labels(trainer_run):
    page = trainer_run[2]
    assert contract_violations(page) == []
    core = {spec.name for spec in METRICS.values() if spec.source == "core"}
    assert core - contract_families(page) == set()


def test_logged_losses_feed_the_nonfinite_and_spike_counters(tmp_path):
    """The callback's event methods called in the Trainer's order, without a Trainer."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    callback = RankscopeCallback(MonitorConfig(host="127.0.0.1", base_port=0, spike_window=3))
    try:
        callback.on_train_begin(args, state, control)
        for loss in (1.0, 1.1, 0.9, 10.0, float("nan")):
            callback.on_step_begin(args, state, control)
            state.global_step += 1
            callback.on_step_end(args, state, control)
            callback.on_log(args, state, control, logs={"loss": loss, "grad_norm": 1.0, "learning_rate": 1e-3})
        registry = callback.monitor.registry
        labels = callback.monitor.identity.labels()
        assert registry.get_sample_value("rankscope_loss_spikes_total", labels) == 1
        assert registry.get_sample_value("rankscope_nonfinite_steps_total", labels) == 1
        assert math.isnan(registry.get_sample_value("rankscope_loss", {**labels, "split": "train"}))
        assert registry.get_sample_value("rankscope_steps_total", labels) == 5
    finally:
        callback.close()


def test_skip_nonfinite_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="metrics.skip_nonfinite is not supported with the Trainer callback"):
        RankscopeCallback(MonitorConfig(skip_nonfinite=True))


def test_importing_exporter_does_not_import_transformers():
    code = "import sys, exporter, rankscope.control; sys.exit('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "exporter imported transformers"


# --- two processes under torchrun, steered through the control endpoint --------------------------


#: The training process group's timeout in the 2-process job; the test pauses for longer than this.
DDP_TIMEOUT = 8


class _Job:
    """The running torchrun job as the tests see it: two metrics pages and rank 0's control endpoint."""

    def __init__(self, base_port: int, control_port: int, token: str, log: Path) -> None:
        self.base_port, self.control, self.token, self.log = base_port, f"http://127.0.0.1:{control_port}", token, log

    def page(self, rank: int) -> str:
        return fetch(f"http://127.0.0.1:{self.base_port + rank}/metrics")

    def value(self, rank: int, name: str, **labels: str) -> float:
        return sample_value(samples(self.page(rank)), name, **labels) or 0.0

    def request(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.control + path, data=data, method="POST" if data else "GET")
        request.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def act(self, action: str, **body: object) -> str:
        return self.request("/v1/actions", {"action": action, **body})["id"]

    def settled(self, ids: list[str], timeout: float = 60) -> dict[str, dict]:
        def check() -> dict[str, dict] | None:
            recent = {record["id"]: record for record in self.request("/v1/status")["recent"]}
            return {i: recent[i] for i in ids} if all(i in recent for i in ids) else None

        return wait_for(check, timeout, f"actions {ids} to settle", self.diagnose)

    def both(self, name: str) -> tuple[float, float]:
        return self.value(0, name), self.value(1, name)

    def wait_for_steps(self, proc: subprocess.Popen, steps: int) -> None:
        """Until both ranks have made `steps` steps; the job must still be running then."""
        wait_for(
            lambda: proc.poll() is not None or min(self.both("rankscope_steps_total")) >= steps,
            300,
            "training",
            self.diagnose,
        )
        assert proc.poll() is None, f"job exited early:\n{self.diagnose()}"

    def diagnose(self) -> str:
        return tail(self.log)


@pytest.fixture(scope="module")
def controlled_run(tmp_path_factory):
    """2 processes steered over HTTP: reduce_lr and checkpoint, a pause longer than the process group's
    timeout, resume, then stop. Yields what the tests check."""
    from tests.support import free_port, free_port_block

    out = tmp_path_factory.mktemp("hf_torchrun")
    job = _Job(free_port_block(2), free_port(), secrets.token_hex(16), out / "torchrun.log")
    target = ["examples/hf_trainer.py", "--output-dir", str(out), "--max-steps", "100000"]
    target += ["--ddp-timeout", str(DDP_TIMEOUT), "--module-stats-every", "2"]
    target += ["--metrics-host", "127.0.0.1", "--base-port", str(job.base_port)]
    target += ["--control", "--control-port", job.control.rsplit(":", 1)[1]]
    env = {"RANKSCOPE_CONTROL_TOKEN": job.token}
    proc = torchrun(2, target, master_port=free_port(), extra_env=env, log=job.log)
    try:
        job.wait_for_steps(proc, 3)

        reduce_id = job.act("reduce_lr", params={"lr_factor": 0.5})
        save_id = job.act("checkpoint", reason="test")
        settled = job.settled([reduce_id, save_id])
        # Scraped while training goes on, a few steps after both actions.
        after = max(record["step"] for record in settled.values()) + 3
        wait_for(lambda: min(job.both("rankscope_steps_total")) >= after, 60, "steps", job.diagnose)
        pages = {rank: job.page(rank) for rank in (0, 1)}

        pause = job.settled([job.act("pause", reason="test")])
        wait_for(lambda: job.both("rankscope_paused") == (1, 1), 30, "both ranks paused", job.diagnose)
        paused_at = job.value(0, "rankscope_global_step")
        hold_paused(job.both, paused_at, DDP_TIMEOUT + 2, job.diagnose)
        resume = job.settled([job.act("resume", reason="test")])
        wait_for(lambda: min(job.both("rankscope_global_step")) > paused_at, 60, "steps after resume", job.diagnose)

        job.act("stop", reason="test done")
        code = proc.wait(timeout=120)
        assert code == 0, f"torchrun exited {code}:\n{job.diagnose()}"
        yield {
            "out": out,
            "reduce": settled[reduce_id],
            "checkpoint": settled[save_id],
            "pause": next(iter(pause.values())),
            "paused_at": paused_at,
            "resume": next(iter(resume.values())),
            "pages": pages,
            "histories": {rank: json.loads((out / f"log_history.rank{rank}.json").read_text()) for rank in (0, 1)},
            "log": job.log,
        }
    finally:
        stop_process(proc)


def _learning_rates(history: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["learning_rate"] for entry in history if "learning_rate" in entry}


@pytest.mark.integration
def test_both_processes_reduce_the_learning_rate_at_the_same_step(controlled_run):
    reduce = controlled_run["reduce"]
    assert reduce["status"] == "applied", reduce
    step = reduce["step"]
    for rank, history in controlled_run["histories"].items():
        rates = _learning_rates(history)
        # Logged at step s: the rate step s used. The reduction applies from the next step on.
        assert {lr for s, lr in rates.items() if s <= step} == {1e-3}, (rank, step)
        assert {lr for s, lr in rates.items() if s > step} == {5e-4}, (rank, step)
        assert step + 1 in rates, (rank, step)


@pytest.mark.integration
def test_a_checkpoint_request_makes_every_process_save_at_that_step(controlled_run):
    record = controlled_run["checkpoint"]
    assert record["status"] == "applied", record
    folder = controlled_run["out"] / f"checkpoint-{record['step']}"
    assert (folder / "rng_state_0.pth").is_file() and (folder / "rng_state_1.pth").is_file(), sorted(
        p.name for p in folder.parent.iterdir()
    )
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == record["step"]
    for rank, page in controlled_run["pages"].items():
        assert sample_value(samples(page), "rankscope_checkpoints_total", reason="operator") == 1, rank


@pytest.mark.integration
def test_stop_saves_then_ends_training_on_every_process(controlled_run):
    last_steps = {rank: history[-1]["step"] for rank, history in controlled_run["histories"].items()}
    assert len(set(last_steps.values())) == 1, last_steps
    final = controlled_run["out"] / f"checkpoint-{last_steps[0]}"
    assert (final / "rng_state_0.pth").is_file() and (final / "rng_state_1.pth").is_file(), tail(controlled_run["log"])


@pytest.mark.integration
def test_a_pause_longer_than_the_collective_timeout_holds_every_process_then_resumes(controlled_run):
    """Both ranks wait at the same step boundary for DDP_TIMEOUT + 2 s (checked in the fixture), and
    training goes on afterwards: no collective of the training group was left waiting."""
    pause, resume = controlled_run["pause"], controlled_run["resume"]
    assert (pause["status"], resume["status"]) == ("applied", "applied"), (pause, resume)
    assert pause["step"] == resume["step"] == controlled_run["paused_at"]
    for rank, history in controlled_run["histories"].items():
        logged = {entry["step"] for entry in history if "loss" in entry}
        assert controlled_run["paused_at"] + 1 in logged, rank


@pytest.mark.integration
def test_each_process_serves_its_own_rank_with_comm_time_measured(controlled_run):
    for rank, page in controlled_run["pages"].items():
        found = samples(page)
        ranks = {dict(labels)["rank"] for name, labels in found if name.startswith("rankscope_")}
        assert ranks == {str(rank)}
        assert sample_value(found, "rankscope_run_info", world_size="2", backend="gloo") == 1
        assert sample_value(found, "rankscope_comm_duration_seconds_count") > 0
        assert sample_value(found, "rankscope_comm_duration_seconds_sum") > 0
        assert promtool_problems(page) == "", rank
        assert contract_violations(page) == [], rank


@pytest.mark.integration
def test_the_stack_rules_and_dashboards_find_every_metric_they_query(controlled_run):
    """Rules and dashboards work unchanged: each contract metric they name that a Trainer run records
    (core, control, host probes; not the reference trainer's model statistics, not GPU probes) is there."""
    sources = sorted(REPO.glob("prometheus/rules/*.yml")) + sorted(REPO.glob("grafana/dashboards/*.json"))
    queried = {word for path in sources for word in re.findall(r"rankscope_[a-z0-9_]+", path.read_text())}
    by_series = {name: spec for spec in METRICS.values() for name in spec.series_names}
    cpu_probes = {"rankscope_host_memory_used_ratio", "rankscope_process_resident_memory_bytes"}
    # A failed save of the Trainer's raises out of train(): there is nothing for the callback to count.
    not_ours = {"rankscope_checkpoint_failures_total"}
    wanted = {
        by_series[word].name
        for word in queried
        if word in by_series and (by_series[word].source in ("core", "control") or by_series[word].name in cpu_probes)
    } - not_ours
    assert wanted, "no rankscope metric found in prometheus/rules or grafana/dashboards"
    pages = controlled_run["pages"]
    assert wanted - contract_families(pages[0]) == set()
    # The channel counts and times its decisions where it makes them, on rank 0 only.
    rank0_only = {"rankscope_control_actions_total", "rankscope_control_last_applied_timestamp_seconds"}
    assert wanted - rank0_only - contract_families(pages[1]) == set()


def test_without_a_control_token_the_run_stops_with_one_line_and_no_traceback(tmp_path):
    """examples/hf_trainer.py asked for control without RANKSCOPE_CONTROL_TOKEN: one line naming the problem and
    exit status 1, before the first step (the documented choice: docs/loop-contract.md)."""
    import os
    import subprocess
    import sys

    from tests.support import REPO, free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANKSCOPE_CONTROL_TOKEN", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    argv = ["--output-dir", str(tmp_path), "--max-steps", "2", "--metrics-host", "127.0.0.1", "--base-port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "examples.hf_trainer", *argv, "--control", "--control-port", str(free_port())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "needs a bearer token" in line]
    assert len(lines) == 1 and lines[0].startswith("rankscope: "), done.stderr[-3000:]
