import re

import pytest
from rankscope import MonitorConfig, config_from_mapping


def test_defaults_are_valid():
    config = MonitorConfig()
    assert config.base_port == 9400 and config.enabled


def test_mapping_builds_a_config_and_coerces_ints_to_floats():
    config = config_from_mapping(MonitorConfig, {"base_port": 9500, "spike_ratio": 3, "probes": ["host"]}, "metrics")
    assert config.base_port == 9500 and config.spike_ratio == 3.0 and config.probes == ("host",)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"base_prot": 1}, "unknown setting metrics.base_prot"),
        (
            {"hang_seconds": 20},
            "metrics.hang_seconds was replaced by metrics.hang_floor_seconds and metrics.hang_step_multiple "
            "(a hang is no step for longer than max(floor, multiple x the recent step time): docs/hangs.md)",
        ),
        ({"base_port": "9400"}, "metrics.base_port must be of type int"),
        ({"enabled": "yes"}, "metrics.enabled must be true or false"),
        ({"base_port": 70000}, "metrics.base_port must be an integer between 0 and 65535, got 70000"),
        ({"spike_ratio": 0.5}, "metrics.spike_ratio must be > 1"),
        ({"resolve_every_n_steps": 0}, "metrics.resolve_every_n_steps must be an integer >= 1"),
        ({"probes": ["host", "disk"]}, "unknown probe"),
        ({"host": "not a host"}, "metrics.host must be"),
    ],
)
def test_bad_settings_fail_with_one_line_naming_the_key(mapping, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        config_from_mapping(MonitorConfig, mapping, "metrics")
    assert "\n" not in str(info.value)
