"""The report's goodput section: the breakdown, each incident with its time and GPU-hours, in Chromium."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image, ImageStat
from rankscope.report import plots
from rankscope.report.goodput import breakdown, incidents, query, render_section
from rankscope.report.html import Figure, Table, render_page
from rankscope.report.series import Series

T0 = 1_800_000_000.0


def _series(bucket: str, values: list[float]) -> Series:
    return Series({"bucket": bucket}, T0 + 10.0 * np.arange(len(values)), np.asarray(values, dtype=float))


def _job() -> list[Series]:
    # Ten samples 10 s apart: start-up 5 s, a 20 s checkpoint between samples 3 and 5, a restart (a jump of
    # 30 s of start-up and 12 s of lost work at sample 7), training otherwise.
    return [
        _series("startup", [5, 5, 5, 5, 5, 5, 5, 35, 35, 35]),
        _series("training", [0, 10, 20, 30, 30, 30, 40, 40, 50, 60]),
        _series("lost", [0, 0, 0, 0, 0, 0, 0, 12, 12, 12]),
        _series("checkpoint", [0, 0, 0, 0, 10, 20, 20, 20, 20, 20]),
        _series("validation", [0] * 10),
        _series("paused", [0] * 10),
        _series("hang", [0] * 10),
    ]


def test_the_query_is_built_from_the_contract() -> None:
    assert query('run_id="r"') == 'max by (bucket) (rankscope_goodput_seconds_total{run_id="r"})'


def test_breakdown_and_incidents() -> None:
    job = _job()
    assert breakdown(job)["lost"] == 12 and breakdown(job)["startup"] == 35
    found = [(i.bucket, i.start - T0, i.seconds) for i in incidents(job)]
    assert found == [("checkpoint", 30.0, 20.0), ("startup", 60.0, 30.0), ("lost", 60.0, 12.0)]


def test_costs_are_world_size_times_seconds_and_the_price_shows_money() -> None:
    section = render_section(_job(), world_size=8, price=2.5)
    tables = [b for b in section.blocks if isinstance(b, Table)]
    where, each = tables
    rows = {row[0]: row for row in where.rows}
    assert rows["productive"][1] == "48.0" and rows["checkpoint"][3] == f"{20 * 8 / 3600:.3f}"
    assert rows["lost"][4] == f"{12 * 8 / 3600 * 2.5:,.2f}"
    assert [row[1] for row in each.rows] == [
        "checkpoint save",
        "start-up or restart",
        "work thrown away (resume or rollback)",
    ]
    assert "Goodput 41.7%: 48 s of the job's 115 s" in section.blocks[0].text  # type: ignore[union-attr]
    assert "cost" not in render_section(_job(), world_size=8, price=None).blocks[2].headers  # type: ignore[union-attr]


def test_a_run_without_goodput_gets_a_note() -> None:
    section = render_section([], world_size=2, price=None)
    assert "No rankscope_goodput_seconds_total" in section.blocks[0].text  # type: ignore[union-attr]


def test_the_section_renders_in_headless_chromium(tmp_path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not on PATH: install the Debian package chromium (scripts/bootstrap.sh)")
    section = render_section(_job(), world_size=8, price=2.5)
    figure = next(b for b in section.blocks if isinstance(b, Figure))
    assert ImageStat.Stat(Image.open(__import__("io").BytesIO(figure.png)).convert("L")).stddev[0] > 10
    out = tmp_path / "report.html"
    out.write_text(render_page("goodput", "test", [("run", "r")], [section]))
    shot = tmp_path / "shot.png"
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,1200",
         out.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    image = Image.open(shot).convert("L")
    assert image.size == (1280, 1200)
    assert ImageStat.Stat(image.crop((0, 0, 1280, 900))).stddev[0] > 20, "the section did not render"


def test_badput_that_grew_in_small_amounts_is_named_not_denied() -> None:
    # Each bucket grows by less than an incident's 0.5 s between two samples: no incident, but the badput grew.
    job = [
        _series("startup", [5, 5.3, 5.6, 5.6, 5.6, 5.6, 5.6, 5.6, 5.6, 5.6]),
        _series("training", [0, 9, 18, 28, 38, 48, 58, 68, 78, 88]),
        _series("lost", [0, 0, 0, 0, 0, 0, 0.4, 0.4, 0.4, 0.4]),
        _series("checkpoint", [0, 0, 0, 0.2, 0.4, 0.4, 0.4, 0.4, 0.6, 0.6]),
        _series("validation", [0, 0, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4]),
        _series("paused", [0] * 10),
        _series("hang", [0] * 10),
    ]
    assert incidents(job) == []
    text = " ".join(getattr(b, "text", "") for b in render_section(job, world_size=2, price=None).blocks)
    assert "no badput bucket grew" not in text
    for grown in ("start-up or restart 0.6 s", "work thrown away (resume or rollback) 0.4 s", "checkpoint save 0.6 s",
                  "validation 0.4 s"):  # fmt: skip
        assert grown in text, f"{grown!r} is not said: {text}"
    quiet = [_series(bucket, [1.0] * 10) for bucket in ("startup", "lost", "checkpoint")]
    quiet.append(_series("training", [float(10 * i) for i in range(10)]))
    assert "No badput bucket grew during the run's window" in " ".join(
        getattr(b, "text", "") for b in render_section(quiet, world_size=2, price=None).blocks
    )


def test_the_time_figure_reads_m_ss_like_every_other_plot_of_the_report() -> None:
    from matplotlib.figure import Figure as MplFigure
    from rankscope.report.goodput import time_axes

    axes = time_axes(_job(), plots.TimeAxis(T0 - 30.0, T0 + 90.0))
    assert isinstance(axes.figure, MplFigure)
    axes.figure.canvas.draw()
    shown = [t.get_text() for t in axes.get_xticklabels() if t.get_text()]
    assert shown and all(":" in label for label in shown), shown  # m:ss, not decimal minutes
    assert "0:30" in shown and axes.get_xlabel() == "time since the run's first sample (m:ss)"
    assert axes.get_xlim() == (0.0, 120.0)  # the report's own axis: the run's first sample is 0:00


def test_a_cpu_run_counts_rank_hours_not_gpu_hours() -> None:
    section = render_section(_job(), world_size=8, price=2.5, on_gpu=False)
    said = " ".join(getattr(b, "text", "") + " ".join(getattr(b, "headers", [])) for b in section.blocks)
    assert "GPU" not in said and "rank-hours" in said
    gpu = render_section(_job(), world_size=8, price=2.5)
    assert "GPU-hours" in [b for b in gpu.blocks if isinstance(b, Table)][0].headers


def test_a_hang_stretch_starts_at_its_last_activity_not_when_it_passed_the_threshold() -> None:
    # The ledger counts a hang whole once past its threshold: the bucket jumps by the gap so far (12 s at once
    # here), so the stretch began 12 s before that sample, as the alert and the ledger say (issue 34).
    found = [
        (i.bucket, i.start - T0, i.end - T0, i.seconds)
        for i in incidents([_series("hang", [0, 0, 0, 0, 12, 22, 32, 32])])
    ]
    assert found == [("hang", 28.0, 60.0, 32.0)]
