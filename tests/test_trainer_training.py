"""rankscope_trainer.loop end to end: real torchrun runs on 2 CPU ranks, and the command line on your own data.

Three launches carry most tests (CPU is scarce):
- the reference run of trainer/rankscope_trainer/configs/demo.yaml (300 steps; start-up costs more
  than training): it must learn, and its per-step losses are the curve every
  resumed run must reproduce;
- an interrupted run: rank 1 crashes at step 25 (first attempt only), torchrun
  restarts the group, which resumes from the step-20 checkpoint; after a later
  checkpoint the whole job is killed with SIGKILL;
- its continuation with `--resume auto`, after the newest checkpoint was truncated.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from PIL import Image
from rankscope_trainer.checkpoint import checkpoint_files

from tests.support import REPO, sample_value

pytestmark = pytest.mark.integration

DEMO = "trainer/rankscope_trainer/configs/demo.yaml"
MAX_STEPS = 300  # demo.yaml
CRASH_AT = 25
EVERY_10 = "checkpoint.every_steps=10"  # the interrupted runs checkpoint often; checkpoints do not change the curve


@pytest.fixture(scope="module")
def reference(trainer_job):
    job = trainer_job("reference", config=DEMO)
    assert job.wait_exit(timeout=420) == 0, job.tail()
    return job


def _same_curve(run: dict[int, float], reference: dict[int, float]) -> None:
    assert run, "no training steps logged"
    for step, loss in run.items():
        assert loss == pytest.approx(reference[step], rel=1e-6, abs=1e-7), f"step {step}: {loss} != {reference[step]}"


def test_the_demo_config_on_two_ranks_learns_loss_falls_and_accuracy_rises_far_above_chance(reference) -> None:
    losses = reference.losses()
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    first = statistics.mean(losses[s] for s in range(1, 21))
    last = statistics.mean(losses[s] for s in range(MAX_STEPS - 19, MAX_STEPS + 1))
    assert last < 0.4 * first, (first, last)
    val = reference.records("val")
    assert [r["step"] for r in val] == [50, 100, 150, 200, 250, 300]
    # In-batch retrieval among 32 samples: chance is 1/32. A model that does not learn stays near it.
    final = val[-1]
    assert final["acc_i2t"] >= 0.4 and final["acc_t2i"] >= 0.4, final
    assert final["loss"] < 0.7 * val[0]["loss"], val


def test_the_run_ends_cleanly_after_a_final_validation_and_checkpoint(reference) -> None:
    output = reference.output.read_text()
    assert f"finished at step {MAX_STEPS}" in output
    assert f"step {MAX_STEPS}/{MAX_STEPS} | loss" in output and "samples/s | ETA 0:00:00" in output
    kept = checkpoint_files(reference.checkpoint_dir)
    assert [f.step for f in kept] == [300, 200, 100]
    assert len({f.lineage for f in kept}) == 1  # one run, one lineage
    finished = reference.records("finished")
    assert [(r["step"], r["stopped"]) for r in finished] == [(MAX_STEPS, None)]
    # The interval checkpoint at the last step is the final one: not written twice.
    assert [r["reason"] for r in reference.records("checkpoint") if r["step"] == MAX_STEPS] == ["interval"]


@pytest.fixture(scope="module")
def interrupted(trainer_job, reference):
    first = trainer_job(
        "interrupted",
        [f"faults.crash.at_step={CRASH_AT}", "faults.crash.rank=1", EVERY_10],
        resume="auto",
        max_restarts=1,
        config=DEMO,
    )
    endpoint_states: list[str] = []  # rank 1's /metrics: "up"/"down", consecutive repeats collapsed

    def restarted_and_checkpointed_again() -> bool:
        try:
            state = "up" if sample_value(first.scrape(1), "rankscope_global_step") is not None else "down"
        except OSError:
            state = "down"
        if not endpoint_states or endpoint_states[-1] != state:
            endpoint_states.append(state)
        records = first.records()
        starts = [i for i, r in enumerate(records) if r["type"] == "start"]
        return len(starts) >= 2 and any(r["type"] == "checkpoint" and r["step"] >= 40 for r in records[starts[1] :])

    first.wait_for(restarted_and_checkpointed_again, "the restarted attempt to checkpoint step 40", timeout=480)
    first.kill_hard()
    saved = checkpoint_files(first.checkpoint_dir)
    assert len(saved) >= 2, saved
    newest = saved[0].path
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    second = trainer_job("resumed", [EVERY_10], resume="auto", checkpoint_dir=first.checkpoint_dir, config=DEMO)
    assert second.wait_exit(timeout=420) == 0, second.tail()
    expected_step = saved[1].step
    return SimpleNamespace(
        first=first, second=second, states=endpoint_states, truncated=newest, expected_step=expected_step
    )


def test_a_crashed_rank_is_restarted_by_torchrun_and_resumes_from_the_last_checkpoint(interrupted, reference) -> None:
    first = interrupted.first
    states = interrupted.states
    up = states.index("up")
    assert states[up : up + 3] == ["up", "down", "up"], states  # served, crashed, served again
    resumes = first.records("resume")
    assert [r["step"] for r in resumes] == [20], resumes  # the checkpoint before the crash at 25
    records = first.records()
    second_start = [i for i, r in enumerate(records) if r["type"] == "start"][1]
    after_restart = {r["step"]: r["loss"] for r in records[second_start:] if r["type"] == "train"}
    assert min(after_restart) == 21
    _same_curve(after_restart, reference.losses())
    assert "crashes at step 25" in first.output.read_text()


def test_a_run_killed_with_sigkill_resumes_at_the_saved_step_with_the_same_loss_curve(interrupted, reference) -> None:
    second = interrupted.second
    assert [r["step"] for r in second.records("resume")] == [interrupted.expected_step]
    losses = second.losses()
    assert sorted(losses) == list(range(interrupted.expected_step + 1, MAX_STEPS + 1))
    _same_curve(losses, reference.losses())
    assert second.records("val")[-1]["loss"] == pytest.approx(reference.records("val")[-1]["loss"], rel=1e-6)


def test_a_truncated_newest_checkpoint_is_reported_in_one_line_and_the_previous_one_used(interrupted) -> None:
    output = interrupted.second.output.read_text()
    line = next(line for line in output.splitlines() if "is unreadable" in line)
    assert f"checkpoint {interrupted.truncated} is unreadable (truncated or corrupt" in line
    assert line.endswith("trying the previous one")


def test_operator_actions_act_on_every_rank_and_stop_ends_the_run_cleanly(trainer_job, free_port, tmp_path) -> None:
    token, port = "trainer-test-token", free_port()
    (tmp_path / "token").write_text(token + "\n")
    job = trainer_job(
        "control",
        # A checkpoint every step: the stop falls on an interval step and must still write only one.
        ["run.max_steps=100000", "checkpoint.every_steps=1", "checkpoint.keep=2", "control.endpoint=true",
         f"control.port={port}", f"control.token_file={tmp_path / 'token'}"],
    )  # fmt: skip
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}

    def post(action: str, reason: str) -> None:
        answer = requests.post(
            f"{url}/v1/actions", json={"action": action, "reason": reason}, headers=headers, timeout=5
        )
        assert answer.status_code == 202, answer.text

    job.wait_for(lambda: requests.get(f"{url}/v1/status", headers=headers, timeout=5).json()["step"] >= 3, "step 3")
    post("checkpoint", "before-upgrade")

    def operator_checkpoints() -> list[dict]:
        return [r for r in job.records("checkpoint") if r["reason"].startswith("operator")]

    saved = job.wait_for(operator_checkpoints, "the operator's checkpoint")
    assert saved[0]["reason"] == "operator:before-upgrade"
    for rank in (0, 1):  # every rank took part and counts it
        assert sample_value(job.scrape(rank), "rankscope_checkpoints_total", reason="operator") == 1
    post("stop", "maintenance")
    assert job.wait_exit(timeout=120) == 0, job.tail()
    stop = job.records("checkpoint")[-1]
    assert stop["reason"] == "stop:operator:maintenance"
    assert job.records("finished")[0]["stopped"] == "operator:maintenance"
    assert job.records("finished")[0]["step"] == stop["step"] < 100000
    assert [r for r in job.records("checkpoint") if r["step"] == stop["step"]] == [stop]  # not interval + stop
    assert checkpoint_files(job.checkpoint_dir)[0].step == stop["step"]


# --- your own data, through the command line (one rank, no torchrun) ---------------------------------


def _manifest(directory: Path, count: int, name: str) -> Path:
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "white": (250, 250, 250)}
    rows = []
    for index in range(count):
        colour = list(colours)[index % len(colours)]
        path = directory / f"{name}{index}.png"
        Image.new("RGB", (40 + index, 30), colours[colour]).save(path)
        rows.append(json.dumps({"image": path.name, "text": f"a {colour} picture"}))
    manifest = directory / f"{name}.jsonl"
    manifest.write_text("\n".join(rows) + "\n")
    return manifest


def _run_cli(
    tmp_path: Path, *settings: str, config: str = "trainer/rankscope_trainer/configs/test.yaml"
) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "rankscope_trainer", "--config", config]
    base = ["metrics.enabled=false", f"checkpoint.dir={tmp_path / 'ck'}", f"run.log_file={tmp_path / 'log.jsonl'}"]
    for setting in [*base, *settings]:
        args += ["--set", setting]
    env = {k: v for k, v in os.environ.items() if k != "RANKSCOPE_CONTROL_TOKEN"}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_manifest_of_your_own_images_trains_and_validates(tmp_path: Path) -> None:
    train, val = _manifest(tmp_path, 16, "train"), _manifest(tmp_path, 8, "val")
    result = _run_cli(
        tmp_path, "data.source=manifest", f"data.manifest={train}", f"data.val_manifest={val}",
        "data.batch_size=4", "data.val_batch_size=4", "data.num_workers=1", "run.max_steps=6", "run.val_every=3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if r["type"] == "val"] == [3, 6]


def test_a_bad_manifest_line_ends_the_run_with_one_line_naming_it(tmp_path: Path) -> None:
    train, val = _manifest(tmp_path, 8, "train"), _manifest(tmp_path, 4, "val")
    with train.open("a") as handle:
        handle.write('{"image": "missing.png", "text": "gone"}\n')
    result = _run_cli(tmp_path, "data.source=manifest", f"data.manifest={train}", f"data.val_manifest={val}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"trainer: error: {train}:9: image file not found: {tmp_path / 'missing.png'}"
    )


def test_the_demo_config_without_a_control_token_stops_at_start_with_one_line(tmp_path: Path, free_port) -> None:
    result = _run_cli(tmp_path, f"control.port={free_port()}", config=DEMO)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: error: the control endpoint needs a bearer token: set control.token_file")


def test_a_run_whose_checkpoints_failed_trains_on_then_exits_3_naming_the_last_failure(
    tmp_path: Path, tiny_disk
) -> None:
    # A 1 MiB disk: the start-up writability check passes, every checkpoint then runs out of space.
    result = _run_cli(tmp_path, f"checkpoint.dir={tiny_disk}", "run.max_steps=4", "checkpoint.every_steps=2")
    assert result.returncode == 3, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4]  # training went on
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: error: 3 checkpoint(s) could not be written; last: "), last
    assert "no space left on device" in last
    assert list(tiny_disk.iterdir()) == []
