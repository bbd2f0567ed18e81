"""A light install stays light: `pip install rankscope` brings what the exporter needs, the rest are extras.

"Not installed" is made real in a subprocess whose import system refuses the extras' packages (as a
venv without them would), so the checks run without building a second multi-gigabyte venv.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

#: A first line for `python -c`: imports of these top-level packages fail as if they were not installed.
_BLOCK = """
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _NotInstalled())
"""
EXTRAS_ONLY = ["transformers", "accelerate", "torchvision", "tokenizers", "PIL", "lightning", "matplotlib"]


def _python(code: str, blocked: list[str]) -> subprocess.CompletedProcess[str]:
    script = _BLOCK.format(blocked=set(blocked)) + code
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANKSCOPE_LOG_LEVEL": "warning"}
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)


def test_the_base_install_asks_only_for_what_the_exporter_needs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert names == {"prometheus-client", "torch", "psutil", "nvidia-ml-py", "pyyaml", "requests"}
    extras = project["optional-dependencies"]
    assert {"hf", "trainer", "lightning", "report", "dev"} <= set(extras)
    assert any(dep.startswith("transformers") for dep in extras["hf"])
    assert any(dep.startswith("torchvision") for dep in extras["trainer"])


def test_the_exporter_imports_records_and_serves_without_any_extra():
    code = """
import urllib.request
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope.control import ControlChannel, ControlConfig
config = MonitorConfig(host="127.0.0.1", base_port=0, page_cache_seconds=0)
monitor = Monitor(config, RankIdentity("light", 0, 0, 1, "n"))
monitor.start()
with monitor.step():
    pass
page = urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=10).read().decode()
assert "rankscope_steps_total" in page, page[:300]
ControlChannel(ControlConfig(endpoint=False)).close()
monitor.close()
print("served")
"""
    result = _python(code, EXTRAS_ONLY)
    assert result.returncode == 0 and result.stdout.strip() == "served", result.stderr


def test_rankscope_ctl_needs_no_torch():
    code = """
import sys
from rankscope.cli import main
code = main(["--url", "http://127.0.0.1:1", "status"])
assert "torch" not in sys.modules, "rankscope-ctl imported torch"
sys.exit(code)
"""
    result = _python(code, ["torch", *EXTRAS_ONLY])
    assert result.returncode == 1, result.stderr  # a one-line "cannot reach" error, not an ImportError
    assert result.stderr.strip().splitlines() == [
        "rankscope-ctl: cannot reach http://127.0.0.1:1 (is the job running, and is this its control port?)"
    ]


def test_an_integration_without_its_extra_names_the_extra_in_one_line():
    for module, extra in (
        ("rankscope.integrations.hf.callback", "hf"),
        ("rankscope.integrations.lightning.callback", "lightning"),
        ("rankscope_trainer.loop", "trainer"),
    ):
        result = _python(f"import {module}", EXTRAS_ONLY)
        assert result.returncode == 1, module
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: ") and f"pip install 'rankscope[{extra}]'" in last, (module, last)
