"""The run report of a real run with a fault: built from its Prometheus and run log, read and rendered.

One scenario (tests/e2e/harness.py): the reference trainer on 2 ranks under torchrun, the real
Prometheus and Alertmanager with the repository's rules and routes; rank 0's loss turns NaN for
a few steps, RankscopeNonFiniteSteps fires and its action reduces the learning rate on both
ranks. An operator then asks for another reduce_lr (its outcome, refused or not, is whatever
/v1/status says), and pauses and resumes the run. Then `rankscope-report` (without --run-id: the
newest run there) writes the report, whose HTML is parsed for every section and image, its action
rows checked against /v1/status and the run log, and headless Chromium renders it at 1280 px.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image, ImageStat
from rankscope.report.build import ReportRequest, build_report
from rankscope.report.collect import collect
from rankscope.report.prom import Prometheus
from rankscope.report.run import find_run
from rankscope.report.runlog import read_run_log
from rankscope.report.sections import SECTIONS
from rankscope.report.stops import find_stops

from tests.e2e.harness import UNTIL_STOPPED, Stack, step_started_at
from tests.support import REPO

pytestmark = pytest.mark.e2e

NAN_AT, NAN_STEPS = 31, 3  # after the first validation (step 20), so attention maps exist before the fault


class _Page(HTMLParser):
    """Section ids, and each section's embedded PNGs and table rows."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: dict[str, list[bytes]] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "section":
            self.sections.append(found.get("id") or "")
        elif tag == "img":
            src = found.get("src") or ""
            assert src.startswith("data:image/png;base64,"), f"an image that is not embedded: {src[:80]}"
            self.images.setdefault(self.sections[-1], []).append(base64.b64decode(src.split(",", 1)[1]))
        elif tag == "tr":
            self.rows.setdefault(self.sections[-1], []).append([])
        elif tag == "td":
            self._cell = []

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.rows[self.sections[-1]][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and not self.rows[self.sections[-1]][-1]:
            self.rows[self.sections[-1]].pop()  # a header row: no cells


def _picture(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    image.load()
    return image


@pytest.fixture(scope="module")
def reported(module_stack, tmp_path_factory) -> tuple[Stack, Path, list[dict], Path]:
    st = module_stack("report")
    job = st.start_trainer(
        [f"faults.nonfinite.at_step={NAN_AT}", f"faults.nonfinite.steps={NAN_STEPS}", "faults.nonfinite.rank=0"],
        max_steps=UNTIL_STOPPED,
    )
    (applied,) = st.wait(lambda: st.settled("reduce_lr"), "the alert's reduce_lr", timeout=180)
    assert applied["reason"] == "alert:RankscopeNonFiniteSteps", applied
    st.wait_for_step(applied["step"] + 5)
    st.post_action("reduce_lr", "loss still high")
    st.wait(lambda: st.settled("reduce_lr", None)[1:], "the operator's reduce_lr to settle", timeout=60)
    with st.paused("look at the loss"):
        # Held until Prometheus has scraped the paused gauge on rank 0: a pause the report must place.
        st.wait(lambda: any(float(r["value"][1]) == 1 for r in st.query(f'rankscope_paused{{run_id="{st.run_id}"}}')),
                "a scrape of the paused run", timeout=60)  # fmt: skip
    st.wait_for_step(applied["step"] + 15)
    recent = st.status()["recent"]
    assert st.stop_trainer() == 0
    out = tmp_path_factory.mktemp("report") / "report.html"
    result = subprocess.run(
        [sys.executable, "-m", "rankscope.report", "--prometheus", st.prometheus_url, "--log", str(job.log_file),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"run {st.run_id}," in result.stdout  # the newest run, found without --run-id
    return st, out, recent, Path(job.log_file)


def test_the_report_has_every_section_with_its_pictures_and_names_the_incident_and_its_action(reported) -> None:
    st, out, recent, log_file = reported
    page = _Page()
    page.feed(out.read_text())
    assert page.sections == ["facts", *SECTIONS]
    for section in SECTIONS:
        assert page.images.get(section), f"section {section} has no image"
        for png in page.images[section]:
            image = _picture(png)
            assert image.width <= 1240 and ImageStat.Stat(image.convert("L")).stddev[0] > 10, section
    assert len(page.images["attention"]) == 2  # the first and the latest validation
    # The incident: the alert fired, and the action it caused was applied, with its fault-to-action time.
    alerts = [row for row in page.rows["incidents"] if row[0] == "RankscopeNonFiniteSteps"]
    assert alerts and alerts[0][2] == "page" and alerts[0][3] == "reduce_lr", page.rows["incidents"]
    (action,) = [row for row in page.rows["incidents"] if row[0] == "reduce_lr" and row[1] == "alert"]
    assert action[1:3] == ["alert", "applied"] and action[6] == "RankscopeNonFiniteSteps", action
    seconds = float(re.match(r"([0-9.]+) s", action[7]).group(1))  # type: ignore[union-attr]
    assert 0 < seconds < 20, action
    assert action[8] == "prometheus + run log" and action[5].startswith("alert:RankscopeNonFiniteSteps")
    # Measured from the first NaN step the run log shows, not from the alert.
    assert f"from the first non-finite step (step {NAN_AT})" in action[7], action
    stop = [row for row in page.rows["incidents"] if row[0] == "stop"]
    assert len(stop) == 1 and stop[0][1:3] == ["operator", "applied"] and "operator:scenario-over" in stop[0][5], stop
    text = out.read_text()
    assert "finished (stopped: operator:scenario-over)" in text
    assert "Fault to action: from the fault&#x27;s first sign" in text and "Settled by:" in text
    summary = _picture(out.with_suffix(".png").read_bytes())
    assert summary.width == 1240 and summary.height >= 840


def test_the_reports_actions_agree_with_the_status_and_the_run_log(reported) -> None:
    """Every settled action: the report's step is /v1/status's, its time the run log's settle time, its reason
    the operator's; the pause is logged at its own time, before the resume."""
    st, out, recent, log_file = reported
    page = _Page()
    page.feed(out.read_text())
    rows = page.rows["incidents"]
    logged = {r["id"]: r for r in map(json.loads, log_file.read_text().splitlines()) if r["type"] == "action"}
    for record in recent:
        assert record["id"] in logged, f"{record['action']} {record['status']} is not in the run log"
        entry = logged[record["id"]]
        assert (entry["step"], entry["result"], entry["time"]) == (
            record["step"], record["status"], round(record["settled_at"], 3)
        ), (entry, record)  # fmt: skip
        label = record["action"]
        matching = [r for r in rows if r[0] == label and r[2] == record["status"] and r[4] == str(record["step"])]
        assert matching, f"no row for {label} {record['status']} at step {record['step']}: {rows}"
        assert record["reason"] in matching[0][5] and matching[0][8] == "prometheus + run log", matching[0]
    pause = next(r for r in recent if r["action"] == "pause")
    resume = next(r for r in recent if r["action"] == "resume")
    assert pause["settled_at"] < resume["settled_at"]
    assert logged[pause["id"]]["time"] < logged[resume["id"]]["time"]


def test_the_report_renders_in_headless_chromium_at_1280_px(reported, tmp_path) -> None:
    _, out, _, _ = reported
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not on PATH: install the Debian package chromium (scripts/bootstrap.sh)")
    shot = tmp_path / "shot.png"
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,4000",
         out.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    image = _picture(shot.read_bytes()).convert("L")
    assert image.size == (1280, 4000)
    # Not blank: the page's plots, tables and header make contrast all the way down, not one colour.
    for top in range(0, 4000, 1000):
        band = image.crop((0, top, 1280, top + 1000))
        assert ImageStat.Stat(band).stddev[0] > 20, f"the screenshot is blank from y={top}"
    dark = sum(count for count, value in image.getcolors(256) or [] if value < 128)  # type: ignore[misc]
    assert dark > 0.02 * 1280 * 4000, "too little ink: the plots did not render"


HANG_AT, CHECKPOINT_EVERY = 31, 20  # rank 1 blocks in its data loader at step 31; the newest checkpoint is step 20


def test_a_hang_and_its_restart_are_drawn_as_a_stretch_without_steps(stack, tmp_path) -> None:
    """Issue 34: the real trainer hangs on rank 1, RankscopeRankHung's restart restarts the group from step 20.
    No logged step is placed in the hang or the restart (the restarted group's first flush was spread back
    over them), and the report finds each rank's stop from Prometheus with what the rank was doing."""
    st: Stack = stack("report-hang")
    job = st.start_trainer(
        [f"faults.hang.at_step={HANG_AT}", "faults.hang.rank=1", "faults.hang.kind=data",
         f"checkpoint.every_steps={CHECKPOINT_EVERY}"],
        max_steps=UNTIL_STOPPED, resume="auto", max_restarts=1,
    )  # fmt: skip
    st.wait_for_firing("RankscopeRankHung", timeout=180)
    hung_at = step_started_at(job, HANG_AT)  # before the restarted group logs step 30 again
    st.wait(lambda: st.settled("restart"), "the restart applied by the new incarnation", 240)
    st.wait_for_step(st.status()["step"] + 2 * CHECKPOINT_EVERY, timeout=180)
    assert st.stop_trainer() == 0

    log = read_run_log(job.log_file)
    (restarted,) = [r for r in log.of("start") if r["time"] > hung_at]
    train = log.train()
    inside = (train["time"] > hung_at) & (train["time"] < restarted["time"])
    assert not inside.any(), f"steps {train['step'][inside]} drawn between the hang and the restarted group's start"
    assert train["segment"][train["time"] > restarted["time"]].min() > train["segment"][train["time"] <= hung_at].max()

    prom = Prometheus(st.prometheus_url)
    now = time.time()
    data = collect(prom, find_run(prom, st.run_id, now), now)
    stops = find_stops(data.get("last_step"), data.run.interval, data.get("step_time"), data.get("phase"))
    hung = [s for s in stops if s.rank == 1 and s.start <= hung_at + 1.0 < restarted["time"] <= s.end + 30.0]
    assert hung and hung[0].phase == "data_wait", stops
    assert any(s.rank == 0 and s.start <= hung_at + 1.0 and s.phase == "collective" for s in stops), stops

    out = tmp_path / "report.html"
    build_report(ReportRequest(st.prometheus_url, out, st.run_id, log=Path(job.log_file)))
    print(f"report of the hang: {out}")
