"""The demo's scenarios (the narrator itself is exercised end to end in tests/e2e/test_scenarios.py)."""

from __future__ import annotations

from trainer.config import load_config
from trainer.narrator import SCENARIOS


def test_every_scenario_switches_on_a_fault_the_trainer_accepts():
    for name, scenario in SCENARIOS.items():
        config = load_config("trainer/configs/demo.yaml", list(scenario.settings))
        assert (config.faults.active() != []) == (name != "none"), name
