"""ControlConfig: defaults, named errors, and where the bearer token comes from."""

from __future__ import annotations

import pytest
from rankscope import config_from_mapping
from rankscope.control import ControlConfig, load_token


def test_defaults_bind_loopback_and_need_a_token():
    config = ControlConfig()
    assert config.host == "127.0.0.1"
    assert config.port == 9300
    assert config.insecure is False
    assert config.check_every_n_steps == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"port": 70000}, "control.port must be an integer between 0 and 65535, got 70000"),
        ({"host": "not a host"}, "control.host must be an IP address or host name"),
        ({"check_every_n_steps": 0}, "control.check_every_n_steps must be an integer >= 1, got 0"),
        ({"lr_factor": 1.0}, "control.lr_factor must be between 0 and 1 (exclusive), got 1.0"),
        ({"pause_heartbeat_seconds": 0.0}, "control.pause_heartbeat_seconds must be in (0, 10]"),
        ({"lr_floor": -1.0}, "control.lr_floor must be >= 0, got -1.0"),
        ({"lr_cooldown_seconds": float("nan")}, "control.lr_cooldown_seconds must be >= 0, got nan"),
        ({"max_body_bytes": 10}, "control.max_body_bytes must be an integer >= 256, got 10"),
        ({"token_env": "NOT A NAME"}, "control.token_env must be an environment variable name"),
    ],
)
def test_bad_settings_fail_with_the_setting_named(settings, message):
    with pytest.raises(ValueError) as caught:
        ControlConfig(**settings)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_yaml_section_with_a_typo_names_the_key():
    with pytest.raises(ValueError, match=r"unknown setting control\.tokenfile"):
        config_from_mapping(ControlConfig, {"tokenfile": "/x"}, "control")


def test_a_yaml_section_with_a_wrong_type_names_the_key():
    with pytest.raises(ValueError, match=r"control\.insecure must be true or false"):
        config_from_mapping(ControlConfig, {"insecure": "yes"}, "control")


def test_the_token_file_wins_over_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("  from-file\n")
    config = ControlConfig(token_file=str(token_file))
    assert load_token(config, {"RANKSCOPE_CONTROL_TOKEN": "from-env"}) == "from-file"


def test_the_token_comes_from_the_named_environment_variable():
    assert load_token(ControlConfig(token_env="MY_TOKEN"), {"MY_TOKEN": "abc"}) == "abc"
    assert load_token(ControlConfig(), {"RANKSCOPE_CONTROL_TOKEN": "def"}) == "def"


def test_no_token_anywhere_is_none():
    assert load_token(ControlConfig(), {}) is None
    assert load_token(ControlConfig(), {"RANKSCOPE_CONTROL_TOKEN": "   "}) is None


def test_a_missing_token_file_is_an_error_not_a_fallback(tmp_path):
    config = ControlConfig(token_file=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match=r"control\.token_file .*absent: cannot read it \(No such file"):
        load_token(config, {"RANKSCOPE_CONTROL_TOKEN": "from-env"})


def test_an_empty_token_file_is_an_error(tmp_path):
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_token(ControlConfig(token_file=str(tmp_path / "token")), {})


def test_a_token_with_spaces_inside_is_refused():
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        load_token(ControlConfig(), {"RANKSCOPE_CONTROL_TOKEN": "two words"})
