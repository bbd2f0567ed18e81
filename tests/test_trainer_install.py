"""`python -m rankscope_trainer` in an install without the trainer extra: one line naming what is missing
and the extra to install, not a traceback.

"Not installed" is made real as tests/test_packaging.py makes it: the subprocess's import system refuses the
trainer extra's packages, as a venv with only `pip install rankscope` would.
"""

from __future__ import annotations

import tomllib

from tests.support import REPO
from tests.test_packaging import _python

#: What the trainer extra adds to the core, by import name (numpy first: it is what the entry point meets first).
TRAINER_ONLY = ["numpy", "torchvision", "transformers", "PIL"]
#: `python -m rankscope_trainer` with no arguments.
RUN_THE_TRAINER = """
import runpy, sys
sys.argv = ["rankscope_trainer"]
runpy.run_module("rankscope_trainer", run_name="__main__", alter_sys=True)
"""


def test_the_trainer_extra_is_what_the_message_names():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {r.split(">")[0] for r in extras["trainer"]} == {"torchvision", "transformers", "pillow", "numpy"}


def test_the_trainer_without_its_extra_says_in_one_line_what_to_install():
    result = _python(RUN_THE_TRAINER, TRAINER_ONLY)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "numpy" in lines[0] and "pip install 'rankscope[trainer]'" in lines[0], lines[0]


def test_numpy_alone_missing_is_named_before_torch_warns_about_it():
    # torch prints a warning at import when numpy is missing: the check comes first, so the line stays alone.
    result = _python(RUN_THE_TRAINER, ["numpy"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "trainer: error: numpy cannot be imported (No module named 'numpy'): pip install 'rankscope[trainer]'"
    ]
