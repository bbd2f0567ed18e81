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
