"""The documented benchmarks still run: each script's smallest setting, end to end, as a user would start it.

A benchmark is a script, not a test of speed (nothing here is timed); but one that crashes measures
nothing, and a change elsewhere (the trainer's metrics leaving the contract, say) breaks it silently.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: (module, smallest arguments, a line its report must print)
SMALLEST = {
    "overhead": (["--steps", "2", "--trials", "1", "--hand-steps", "1"], "rankscope all on"),
    "scrape": (["--renders", "5", "--groups", "2", "--block", "2"], "CPU/scrape"),
    "abuse": (["--connections", "20", "--rate", "5", "--groups", "2", "--block", "2"], "idle + scrapes"),
    "gpu": ([], "no CUDA device"),
    "sharded": (["--groups", "1", "--block", "2", "--layers", "2", "--width", "16", "--batch", "4"], "A/A control"),
}


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_the_benchmark_runs_at_its_smallest_setting(name: str) -> None:
    args, expected = SMALLEST[name]
    if name == "gpu":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: benchmarks.gpu is the device check itself, minutes long")
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert expected in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
