"""The cheaper rules raise the same alerts as the rules of revision 46d348f, on the same data.

Issue 32 made the rules cheaper at thousands of ranks (per-rank reductions recorded once, state carried
forward instead of re-read over 30 minutes, rank-0-only series read on rank 0). The alerts must keep their
meaning: the same alerts, with the same labels, pending and firing at the same evaluations.

The data is every input series of the promtool unit tests (prometheus/tests/*_test.yml), which were written
to walk each alert across its edges: a straggler, hung ranks in every phase, a paused run, a rank down, a
finished run, restarts, checkpoint failures, non-finite bursts and the trainer's actions. For each test
group, the rules of 46d348f (renamed: ``old_`` before every recorded series, ``Old`` before every alert) and
the current rules are evaluated side by side by the real `promtool` over the same series, and at every
evaluation the two sets of ``ALERTS`` (pending and firing, every label) must be equal.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.alert_comparison import alert_names, comparison_file, renamed, run_comparison
from tests.support import REPO

#: The revision whose rules the cheaper ones are compared with (before issue 32's rule changes).
OLD_REVISION = "46d348f"
RULES = REPO / "prometheus" / "rules"
UNIT_TESTS = sorted((REPO / "prometheus" / "tests").glob("*_test.yml"))


def _old_rule_files() -> dict[str, str]:
    """File name -> text of every rule file of OLD_REVISION."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{OLD_REVISION}:prometheus/rules"],
                            capture_output=True, text=True, check=False)  # fmt: skip
    if listed.returncode != 0:
        pytest.fail(f"git cannot read revision {OLD_REVISION} (a shallow clone?): {listed.stderr.strip()}")
    texts = {}
    for name in listed.stdout.split():
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{OLD_REVISION}:prometheus/rules/{name}"],
                               capture_output=True, text=True, check=True)  # fmt: skip
        texts[name] = shown.stdout
    return texts


#: Alerts whose meaning was changed on purpose since OLD_REVISION, and by which commit: left out of the comparison
#: (their own promtool tests pin the new meaning).
CHANGED_ON_PURPOSE = {
    "RankscopeLossDiverging": "smoothed with the median, not the mean (12d1d52); compared with its 30m median, not "
    "its minimum, for 15s (a missed learning-rate spike; a sooner rollback)",
    "RankscopeRankImbalance": "the slowest rank over the other ranks' median, not all's (2 ranks: 2x read 1.33x)",
    "RankscopeRankHung": "the last step's age when scraped, not at evaluation (15 s scrapes paged healthy runs)",
    "RankscopeRunStalled": "also a first step that never ends (no phase change for stall_seconds; nothing fired)",
    "RankscopeSlowSteps": "local rank 0 of each node stands for its ranks (DDP: every rank's step is as long)",
    "RankscopeLossPlateau": "not over a window a rollback cut into (the loop-off campaign arm at 757ef18), a "
    "restarted process's rollback too (the loop-off arm at 03deed7)",
}


def _rules_dirs(tmp_path: Path, new_texts: dict[str, str] | None = None) -> tuple[Path, Path]:
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old_dir.mkdir()
    new_dir.mkdir()
    for name, text in _old_rule_files().items():
        (old_dir / name).write_text(renamed(text, "old."))
    for path in sorted(RULES.glob("*.yml")):
        text = path.read_text()
        (new_dir / path.name).write_text(new_texts.get(path.name, text) if new_texts else text)
    return old_dir, new_dir


def _compare(tmp_path: Path, unit_test: Path, new_texts: dict[str, str] | None = None) -> tuple[int, str]:
    old_dir, new_dir = _rules_dirs(tmp_path, new_texts)
    old_files, new_files = sorted(old_dir.glob("*.yml")), sorted(new_dir.glob("*.yml"))
    # Only the alerts both revisions have (an alert added since has its own tests).
    compared = alert_names(old_files) - set(CHANGED_ON_PURPOSE)
    return run_comparison(comparison_file(unit_test, tmp_path, old_files, new_files, compared))


@pytest.mark.parametrize("unit_test", UNIT_TESTS, ids=[p.stem for p in UNIT_TESTS])
def test_the_rules_raise_the_same_alerts_as_the_old_ones(tmp_path, unit_test):
    code, said = _compare(tmp_path, unit_test)
    assert code == 0, f"old and new alerts differ on {unit_test.name}:\n{said[-6000:]}"


def test_the_comparison_fails_when_an_alert_changes(tmp_path):
    # The slow-batch share's line 10 % -> 99 %: the data-loader alerts of performance_test.yml no longer fire.
    performance = (RULES / "performance.yml").read_text()
    changed = performance.replace(') > 0.1, "signal", "p90_wait"', ') > 0.99, "signal", "p90_wait"')
    assert changed != performance, "the p90 line is no longer written as '> 0.1' in performance.yml: update this test"
    unit_test = REPO / "prometheus" / "tests" / "performance_test.yml"
    code, said = _compare(tmp_path, unit_test, {"performance.yml": changed})
    assert code != 0 and "RankscopeDataLoaderBottleneck" in said, said[-3000:]
