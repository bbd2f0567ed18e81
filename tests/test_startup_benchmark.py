"""benchmarks.startup: its summary pairs each trial of the tree with the baseline's, and bad flags fail in one line."""

from __future__ import annotations

import pytest

from benchmarks.startup import TREE, _summary, main


def test_the_summary_gives_each_variants_medians_and_the_per_trial_ratios() -> None:
    results = {
        TREE: [{"first": 6.0, "relaunch": 5.0}, {"first": 9.0, "relaunch": 4.0}, {"first": 7.0, "relaunch": 6.0}],
        "abc123": [{"first": 8.0, "relaunch": 5.0}, {"first": 9.0, "relaunch": 8.0}, {"first": 7.0, "relaunch": 6.0}],
    }
    summary = _summary(results, "abc123")
    assert summary["medians"] == {TREE: {"first": 7.0, "relaunch": 5.0}, "abc123": {"first": 8.0, "relaunch": 6.0}}
    assert summary["ratios"] == {"first": [0.75, 1.0, 1.0], "relaunch": [1.0, 0.5, 1.0]}
    assert "ratio this tree / abc123, relaunch: 1.000 (0.500..1.000)" in summary["text"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trials", "0"], "--trials must be at least 1, got 0"),
        (["--baseline", "no-such-rev"], "--baseline no-such-rev:"),
    ],
)
def test_a_bad_flag_fails_in_one_line_naming_it(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
