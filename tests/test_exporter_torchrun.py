"""Integration: a real 2-rank torchrun job, each rank scraped over real HTTP."""

import json
import subprocess

import pytest

from tests.support import fetch, sample_value, samples, stop_process, tail, torchrun, wait_for

pytestmark = pytest.mark.integration


#: Rank 1's extra time per step: large against the noise of a loaded machine (issue 13 saw 30 ms drown).
SLOW_SECONDS = 0.1


@pytest.fixture(scope="module")
def straggler_job(tmp_path_factory):
    """Rank 1 sleeps SLOW_SECONDS inside each step; both ranks serve /metrics when done."""
    from tests.support import free_port, free_port_block

    out = tmp_path_factory.mktemp("exporter_job")
    base = free_port_block(2)
    log = out / "torchrun.log"
    proc = torchrun(
        2,
        [
            "tests/jobs/exporter_job.py",
            "--base-port",
            str(base),
            "--out",
            str(out),
            "--steps",
            "40",
            "--slow-rank",
            "1",
            "--slow-seconds",
            str(SLOW_SECONDS),
        ],
        master_port=free_port(),
        log=log,
    )
    try:
        wait_for(
            lambda: all((out / f"rank{r}.ready").exists() for r in (0, 1)) or proc.poll() is not None,
            timeout=180,
            what="both ranks to finish their steps",
            diagnose=lambda: tail(log),
        )
        assert proc.poll() is None, f"job exited early:\n{tail(log)}"
        pages = {r: fetch(f"http://127.0.0.1:{base + r}/metrics") for r in (0, 1)}
        yield out, base, pages
    finally:
        (out / "stop").touch()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = stop_process(proc)
        assert code == 0, f"torchrun exited {code}:\n{tail(log)}"


def test_each_rank_page_passes_promtool_check_metrics(straggler_job):
    _, _, pages = straggler_job
    for rank, page in pages.items():
        result = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (rank, result.stderr)


def test_each_rank_page_carries_its_own_rank_label(straggler_job):
    _, _, pages = straggler_job
    for rank, page in pages.items():
        page_samples = samples(page)
        ranks = {dict(labels).get("rank") for (name, labels) in page_samples if name.startswith("rankscope_")}
        assert ranks == {str(rank)}
        assert sample_value(page_samples, "rankscope_steps_total") == 40
        assert sample_value(page_samples, "rankscope_run_info", world_size="2", backend="gloo") == 1


def test_the_straggler_shows_in_its_compute_time_and_in_the_fast_rank_comm_time(straggler_job):
    _, _, pages = straggler_job
    compute = {r: sample_value(samples(p), "rankscope_compute_duration_seconds_sum") for r, p in pages.items()}
    comm = {r: sample_value(samples(p), "rankscope_comm_duration_seconds_sum") for r, p in pages.items()}
    step = {r: sample_value(samples(p), "rankscope_step_duration_seconds_sum") for r, p in pages.items()}
    # Margins of half the sleep per step: scheduling noise on a loaded 2-core machine stays well under them.
    assert compute[1] > compute[0] + 40 * SLOW_SECONDS / 2, (compute, comm)
    assert comm[0] > comm[1] + 40 * SLOW_SECONDS / 2, (compute, comm)
    # Step wall time is the same on both ranks (the all-reduce synchronises them): it does not name the straggler.
    assert abs(step[0] - step[1]) < 0.25 * max(step.values()), step


def test_rank_zero_writes_a_file_sd_target_list_naming_every_rank(straggler_job):
    out, base, _ = straggler_job
    groups = json.loads((out / "targets.json").read_text())
    assert [g["targets"] for g in groups] == [[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]
    assert [g["labels"]["rank"] for g in groups] == ["0", "1"]
