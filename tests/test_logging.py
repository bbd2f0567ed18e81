"""rankscope's own lines reach stderr whatever logging the loop set up, once, and can be silenced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO

_LOOP = """
import logging, sys
{setup}
from rankscope import Monitor, MonitorConfig, RankIdentity
monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0, probes=()), RankIdentity("log", 0, 0, 1, "n"))
monitor.start()
monitor.close()
"""


def _stderr(setup: str = "", **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "RANKSCOPE_LOG_LEVEL"}
    environment.update(PYTHONPATH=str(REPO), **env)
    result = subprocess.run(
        [sys.executable, "-c", _LOOP.format(setup=setup)], cwd=REPO, env=environment, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_a_loop_that_configures_no_logging_still_sees_the_metrics_url():
    assert "rankscope: rank 0 metrics at http://127.0.0.1:" in _stderr()


def test_a_loop_with_its_own_stderr_logging_sees_each_line_once():
    err = _stderr('logging.basicConfig(level=logging.WARNING, format="app %(message)s")')
    assert err.count("metrics at http://") == 1 and "app rankscope: rank 0 metrics at" in err


def test_a_loop_logging_to_a_file_still_gets_the_line_on_stderr(tmp_path):
    log = tmp_path / "app.log"
    err = _stderr(f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)")
    assert "metrics at http://" in err and "metrics at http://" in log.read_text()


@pytest.mark.parametrize("level", ["off", "warning"])
def test_rankscope_log_level_silences_it(level):
    assert "metrics at" not in _stderr(RANKSCOPE_LOG_LEVEL=level)


def test_a_bad_level_is_named():
    from rankscope import set_log_level

    with pytest.raises(ValueError, match="must be one of debug, info, warning, error, off, got 'loud'"):
        set_log_level("loud")


def test_set_log_rank_changes_the_prefix_read_from_rank_at_import():
    # Lightning's launcher sets no RANK: the callback sets the trainer's global rank.
    err = _stderr("from rankscope._log import set_log_rank; set_log_rank(3)", RANK="0")
    assert "[rank 3] rankscope: rank 0 metrics at" in err
