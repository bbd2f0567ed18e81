"""The fault campaign's table in the run report (rankscope.report.campaign): the same rows the campaign prints in a
terminal, from the file its --json writes, and a file that is not one named in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rankscope.report.campaign import campaign_section, read_campaign
from rankscope.report.errors import ReportError
from rankscope.report.html import render_page

from benchmarks.campaign.__main__ import goals, table
from benchmarks.campaign.results import summarise
from benchmarks.campaign.schedule import build_schedule
from tests.support import REPO, free_port
from tests.test_campaign import _arm, _train


def _campaign() -> tuple[str, dict]:
    """A fault-free arm and a loop-on arm whose hang stopped it for 20 steps on a machine 1.5 times slower: the
    campaign's terminal table and the --json payload the report reads."""
    schedule = build_schedule(("hang_data",), step_seconds=1.0, operator_delay=0, seed=1, warmup_steps=19)
    at = schedule[0].at_step
    reached = {"type": "val", "step": 40, "loss": 0.5}
    ff = _arm("fault-free", [{"type": "start", "time": 0.0}, *[_train(s, float(s)) for s in range(1, 41)],
                             {**reached, "time": 40.5}])  # fmt: skip
    slow, records = 1.5, [{"type": "start", "time": 0.0}]
    records += [_train(s, slow * s) for s in range(1, at)] + [_train(s, slow * (s + 20)) for s in range(at, 41)]
    on = _arm("on", [*records, {**reached, "time": slow * 60.5}], ended=slow * 61)
    summaries = [summarise(ff, [], None, 0.5), summarise(on, schedule, ff, 0.5)]
    payload = {
        "target_loss": 0.5, "operator_delay": 30.0, "arms": [s.to_json() for s in summaries],
        "goals": [{"goal": g, "met": m, "figure": f} for g, m, f in goals(summaries)],
        "failed": ["on: hang_data @ 21: not named by RankscopeRankHung"],
    }  # fmt: skip
    return table(summaries, schedule, 0.5, 30.0), json.loads(json.dumps(payload, default=str))


class _Tables(HTMLParser):
    """Every table's caption and rows of cells (header row first)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[str]]]] = []
        self._cell: list[str] | None = None
        self._caption: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append(("", []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "caption":
            self._caption = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "caption" and self._caption is not None:
            self.tables[-1] = ("".join(self._caption), self.tables[-1][1])
            self._caption = None

    def handle_data(self, data: str) -> None:
        for part in (self._cell, self._caption):
            if part is not None:
                part.append(data)


def test_the_reports_campaign_section_holds_the_terminals_table_row_for_row(tmp_path: Path) -> None:
    text, payload = _campaign()
    path = tmp_path / "campaign.json"
    path.write_text(json.dumps(payload))
    page = render_page("t", "s", [], [campaign_section(path)])
    parsed = _Tables()
    parsed.feed(page)
    tables = dict(parsed.tables)
    lines = text.splitlines()
    arms = next(rows for caption, rows in parsed.tables if rows[0][0] == "arm" and len(rows[0]) == 9)
    start = lines.index(next(line for line in lines if line.startswith("arm ")))
    for row, line in zip(arms, lines[start : start + 3], strict=True):  # the header and both arms
        assert " ".join(row).split() == line.split(), (row, line)
    faults = tables["loop on: per fault"]
    start = lines.index("loop on: per fault") + 1
    for row, line in zip(faults, lines[start : start + 2], strict=True):
        assert " ".join(row).split() == line.split(), (row, line)
    equal = tables["time to target at equal step time (its wall time over the arm's median step)"]
    assert equal[1:] == [["fault-free", "1000.0 ms", "40", "", "40"], ["on", "1500.0 ms", "60", "+49.4%", "40"]]
    figure = "+49.4% at equal step time (wall +124.1%; median step 1500 ms against 1000 ms)"
    assert ["NOT met", "loop-on time to target within 10% of fault-free", figure] in tables["goals"]
    assert "FAILED on: hang_data @ 21: not named by RankscopeRankHung" in page
    assert "Target validation loss 0.5000" in page and "Operator delay (loop off) 30 s" in page


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read the campaign {path}: No such file or directory"),
        ("{not json", "the campaign {path} is not JSON: "),
        ('{"arms": []}', "the campaign {path} has no arms: not the file `python -m benchmarks.campaign --json` wrote"),
        ('{"arms": [{"name": "on"}]}', "the campaign {path}: an arm without a name or a wall time: "),
    ],
)
def test_a_file_that_is_not_a_campaign_is_named_in_one_line(tmp_path: Path, content: str | None, problem: str) -> None:
    path = tmp_path / "campaign.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReportError) as raised:
        read_campaign(path)
    assert str(raised.value).startswith(problem.format(path=path)), raised.value
    assert "\n" not in str(raised.value)


def test_a_campaign_whose_figures_cannot_be_shown_is_named_in_one_line(tmp_path: Path) -> None:
    # Arms the first check lets through, a fault without its kind and a wall time that is not a number: the
    # section is drawn before Prometheus is asked, so the command says so in one line instead of a traceback.
    _, payload = _campaign()
    for broken, problem in (({"faults": [{"at_step": 3}]}, "'kind'"), ({"wall_seconds": "long"}, "")):
        payload["arms"][1].update(broken)
        path = tmp_path / "campaign.json"
        path.write_text(json.dumps(payload))
        with pytest.raises(ReportError) as raised:
            campaign_section(path)
        assert str(raised.value).startswith(f"the campaign {path}: cannot show its figures ("), raised.value
        assert problem in str(raised.value) and "\n" not in str(raised.value)


def test_the_command_names_a_bad_campaign_before_it_asks_prometheus(tmp_path: Path) -> None:
    bad = tmp_path / "campaign.json"
    bad.write_text('{"arms": []}')
    port = free_port()  # nothing listens there: the campaign is read first
    result = subprocess.run([sys.executable, "-m", "rankscope.report", "--prometheus", f"http://127.0.0.1:{port}",
                             "--campaign", str(bad), "--out", str(tmp_path / "r.html")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines() == [
        f"rankscope-report: the campaign {bad} has no arms: not the file `python -m benchmarks.campaign --json` wrote"
    ]
    assert not (tmp_path / "r.html").exists()
