"""Rules the whole project keeps, checked over every tracked file."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.support import REPO

#: Stopping processes by name would stop a user's own Prometheus too; we stop only what we started, by PID.
#: Looking a process up by name (pgrep, pidof, psutil.process_iter, `ps ... | grep`) is the first half of the
#: same mistake, and so is killing whoever holds a port (`lsof -t`, `fuser -k`): that may be the user's server.
#: Spelled so that the command names themselves appear in no tracked script: a plain search for them (the
#: pre-stop check) then finds an offender, never this rule.
_BY_NAME = re.compile(r"\b(p(?:kill|grep|idof)|kil{2}all|process_iter)\b|\bps\b[^|\n]*\|\s*grep|lsof\s+-t|fuser\s+-k")


def _tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [path for path in listed.splitlines() if not path.endswith((".png", ".json"))]


def test_no_script_test_or_benchmark_stops_a_process_by_name():
    offenders = []
    for path in _tracked_text_files():
        if path == "tests/test_project_rules.py":
            continue
        try:
            text = (REPO / path).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        offenders += [f"{path}:{n}" for n, line in enumerate(text.splitlines(), 1) if _BY_NAME.search(line)]
    assert offenders == []


@pytest.mark.parametrize(
    "line",
    [
        "p" + "kill -f prometheus",
        "kil" + "lall alertmanager",
        "p" + "grep -f vmagent",
        "pid" + "of prometheus",
        "for proc in psutil.process_iter():",
        "ps aux | grep prometheus",
        "kill $(lsof -t -i :9090)",
        "fuser -k 9090/tcp",
    ],
)
def test_the_rule_finds_every_way_of_stopping_a_process_by_name(line: str) -> None:
    assert _BY_NAME.search(line)


@pytest.mark.parametrize("line", ["os.kill(proc.pid, signal.SIGTERM)", "kill -- -$(cat job.pid)", "skill = 3"])
def test_the_rule_leaves_stopping_by_pid_alone(line: str) -> None:
    assert not _BY_NAME.search(line)


def test_nothing_outside_the_tests_imports_from_them():
    # Launching jobs and servers lives in devstack.jobs and devstack.monitoring: the demo and the benchmarks
    # use the same code as the tests, and a package built from the repository does not need tests/.
    importing = re.compile(r"^\s*(from tests[ .]|import tests\b)", re.M)
    offenders = [
        path
        for path in _tracked_text_files()
        if path.endswith(".py") and not path.startswith("tests/") and importing.search((REPO / path).read_text())
    ]
    assert offenders == []
