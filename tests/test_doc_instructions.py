"""Instructions written for a person, followed exactly as written, so they cannot go stale.

The promtool variant's header says which command generates its rules and where to copy it; the test
parses those words, runs the real `rankscope-mixin` and the real `promtool` (Debian package `prometheus`,
installed by scripts/bootstrap.sh; a missing binary is a failure, not a skip).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECOVERY_VARIANT = REPO / "prometheus" / "tests" / "variants" / "recovery_actions_test.yml"


def _header(path: Path) -> str:
    """The comment lines a file starts with, without their '#'."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return "\n".join(lines)


def test_the_recovery_variant_passes_when_generated_and_copied_as_its_header_says(tmp_path: Path):
    header = _header(RECOVERY_VARIANT)
    command = re.search(r"^(rankscope-mixin .*?[^\\])$", header, flags=re.M | re.S)
    assert command, f"{RECOVERY_VARIANT.name}: no rankscope-mixin command in its header"
    argv = shlex.split(command.group(1).replace("\\\n", " "))
    assert "<dir>" in argv, argv
    destination = re.search(r"copied to <dir>/(\S+?)/? ", header)
    assert destination, f"{RECOVERY_VARIANT.name}: its header does not say where to copy it"

    mixin = Path(sys.executable).parent / "rankscope-mixin"
    argv = [str(mixin), *(str(tmp_path) if arg == "<dir>" else arg for arg in argv[1:])]
    generated = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr
    target = tmp_path / destination.group(1)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(RECOVERY_VARIANT, target / RECOVERY_VARIANT.name)

    promtool = shutil.which("promtool") or pytest.fail("promtool is not on PATH: run scripts/bootstrap.sh")
    result = subprocess.run([promtool, "test", "rules", RECOVERY_VARIANT.name], cwd=target,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, f"as {RECOVERY_VARIANT.name} says, promtool fails:\n{result.stdout}{result.stderr}"


def test_a_run_log_written_as_docs_report_md_says_is_read_as_it_says(tmp_path: Path):
    from rankscope.report.incidents import find_incidents
    from rankscope.report.runlog import read_run_log

    page = (REPO / "docs" / "report.md").read_text()
    section = page.split("## A loop of your own", 1)[1]
    example = re.search(r"```jsonl\n(.*?)```", section, flags=re.S)
    assert example, "docs/report.md: no example run log under 'A loop of your own'"
    (tmp_path / "log.jsonl").write_text(example.group(1))
    log = read_run_log(tmp_path / "log.jsonl")

    train = log.train()
    assert list(train["step"]) == [1, 2, 3] and list(train["lr"]) == [0.001, 0.001, 0.0005]
    assert len(log.val()["step"]) == 1
    end = max(r["time"] for r in log.records) + 1
    found = find_incidents([], [], interval=1.0, end=end, log=log)
    assert [step for _, step in found.nonfinite] == [2]  # a null loss is a non-finite step, by number
    # The action record is the exact outcome (the learning rate's drop in the train records is not counted again);
    # the alert's checkpoint is an action of its own.
    actions = {(a.action, a.source, a.result, a.step, a.reason) for a in found.actions}
    assert actions == {
        ("reduce_lr", "operator", "applied", 2, "operator:loss spiking"),
        ("checkpoint", "alert", "applied", 3, "alert:RankscopeHostMemoryHigh"),
    }, actions
    assert [reason for _, reason in found.checkpoints] == ["alert:RankscopeHostMemoryHigh"]
