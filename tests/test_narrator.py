"""The demo's scenarios (the narrator itself is exercised end to end in tests/e2e/test_scenarios.py)."""

from __future__ import annotations

import re
from pathlib import Path

from rankscope_trainer.config import load_config

from devstack.narrator import SCENARIOS

REPO = Path(__file__).resolve().parents[1]


def test_every_scenario_switches_on_a_fault_the_trainer_accepts():
    for name, scenario in SCENARIOS.items():
        config = load_config("trainer/rankscope_trainer/configs/demo.yaml", list(scenario.settings))
        assert (config.faults.active() != []) == (name != "none"), name


def test_the_demos_default_run_reaches_every_scenarios_fault_with_half_the_run_left_for_its_alert():
    demo_steps = int(re.search(r"^DEMO_STEPS \?= (\d+)$", (REPO / "Makefile").read_text(), re.M).group(1))
    for name, scenario in SCENARIOS.items():
        assert scenario.fault_step is None or scenario.fault_step < demo_steps // 2, name
