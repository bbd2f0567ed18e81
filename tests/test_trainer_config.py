"""rankscope_trainer.config: one YAML schema, validated at start, with one-line errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from rankscope_trainer.config import (
    ConfigError,
    TrainConfig,
    apply_override,
    build_section,
    load_config,
    parse_config,
)
from rankscope_trainer.faults import FaultsConfig

from tests.support import REPO


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["demo.yaml", "test.yaml"])
def test_the_shipped_configs_are_valid(name: str) -> None:
    config = load_config(REPO / "trainer" / "rankscope_trainer" / "configs" / name)
    assert config.run.max_steps >= 1
    assert config.data.source == "synthetic"


def test_an_empty_config_means_every_default() -> None:
    assert parse_config({}) == TrainConfig()
    assert parse_config(None) == TrainConfig()


def test_an_unknown_section_is_named() -> None:
    assert "unknown section 'optimizer'" in _error({"optimizer": {"lr": 1.0}})


def test_an_unknown_key_is_named_with_its_section() -> None:
    assert "unknown setting optim.learning_rate" in _error({"optim": {"learning_rate": 0.1}})


def test_an_unknown_nested_key_is_named_with_its_full_path() -> None:
    assert "unknown setting faults.straggler.sleep" in _error({"faults": {"straggler": {"sleep": 1}}})
    assert "unknown setting data.synthetic.colours" in _error({"data": {"synthetic": {"colours": 3}}})


def test_a_wrong_type_is_named() -> None:
    assert "run.max_steps must be of type int, got str 'many'" in _error({"run": {"max_steps": "many"}})
    assert "checkpoint.save_final must be true or false" in _error({"checkpoint": {"save_final": "yes"}})


def test_a_section_that_is_not_a_mapping_is_named() -> None:
    assert "faults.crash must be a mapping" in _error({"faults": {"crash": 3}})
    assert "run must be a mapping" in _error({"run": [1, 2]})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"run": {"max_steps": 0}}, "run.max_steps must be >= 1, got 0"),
        ({"run": {"device": "tpu"}}, "run.device must be one of auto, cpu, cuda, got 'tpu'"),
        ({"optim": {"lr": -1.0}}, "optim.lr must be > 0, got -1.0"),
        ({"data": {"batch_size": 1}}, "data.batch_size must be >= 2"),
        ({"data": {"source": "manifest"}}, "data.manifest must be set when data.source is manifest"),
        ({"data": {"on_bad_sample": "ignore"}}, "data.on_bad_sample must be one of error, skip"),
        ({"model": {"patch_size": 7}}, "model.patch_size (7) must divide model.image_size (48)"),
        ({"faults": {"crash": {"exit_code": 0}}}, "faults.crash.exit_code must be in 1..255, got 0"),
        ({"faults": {"straggler": {"mode": "spin"}}}, "faults.straggler.mode must be sleep or compute"),
        ({"metrics": {"base_port": 70000}}, "metrics.base_port must be an integer between 0 and 65535"),
        ({"run": {"run_id": "my run"}}, "run.run_id must be 1-64 characters of letters, digits and _.:-"),
    ],
)
def test_an_out_of_range_value_is_named(raw: dict, expected: str) -> None:
    assert expected in _error(raw)


def test_control_settings_are_checked_by_the_control_package_at_start() -> None:
    assert "control.port must be an integer between 0 and 65535" in _error({"control": {"port": -1}})
    assert "unknown setting control.tokn_file" in _error({"control": {"tokn_file": "x"}})


def test_overrides_are_read_as_yaml_and_may_create_sections() -> None:
    raw: dict = {"optim": {"lr": 0.1}}
    apply_override(raw, "optim.lr=3e-4")
    apply_override(raw, "faults.straggler.at_step=5")
    apply_override(raw, "metrics.probes=[host]")
    apply_override(raw, "checkpoint.save_final=false")
    config = parse_config(raw)
    assert config.optim.lr == pytest.approx(3e-4)
    assert config.faults.straggler.at_step == 5
    assert config.metrics.probes == ("host",)
    assert config.checkpoint.save_final is False


def test_learning_rates_in_exponent_notation_are_floats_in_files_too(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n")
    assert load_config(path).optim.lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lr", "--set expects section.key=value, got 'optim.lr'"),
        ("optim..lr=1", "--set expects section.key=value"),
        ("optim.lr=[1", "--set optim.lr: value '[1' is not valid YAML"),
        ("optim.lr.x=1", "--set optim.lr.x: optim.lr is a single value, not a section"),
    ],
)
def test_a_malformed_override_is_named(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        apply_override({"optim": {"lr": 0.1}}, override)
    assert expected in str(caught.value)


def test_the_config_hash_changes_with_any_setting() -> None:
    base = parse_config({})
    assert base.hash() == parse_config({}).hash()
    assert base.hash() != parse_config({"optim": {"lr": 0.5}}).hash()


def test_a_missing_or_broken_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- run\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listed)


def test_the_command_line_reports_a_bad_setting_in_one_line_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("optim:\n  lr: fast\n")
    result = subprocess.run(
        [sys.executable, "-m", "rankscope_trainer", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "trainer: error: optim.lr must be of type float, got str 'fast'"


def test_a_control_section_that_names_only_a_port_serves_the_endpoint_there() -> None:
    # Before the typed section, `control: {port: 9300}` silently turned the endpoint off (a second default).
    control = parse_config({"control": {"port": 9300}}).control
    assert control.endpoint is True and control.port == 9300
    assert parse_config({}).control.endpoint is False  # no section: no endpoint (signals still stop cleanly)


def test_a_key_given_twice_is_one_line_naming_both_lines(tmp_path: Path) -> None:
    config = tmp_path / "twice.yaml"
    config.write_text("run:\n  max_steps: 10\n  max_steps: 20\n")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert str(caught.value) == (
        f"{config}: duplicate key 'max_steps' at line 3 (first at line 2); each setting may appear once"
    )


def test_a_binary_file_given_as_config_is_one_line_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "model.pt"
    config.write_bytes(b"PK\x03\x04\x00\xff\xfe binary")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert str(caught.value) == f"config {config} is not a YAML text file (not UTF-8 at byte 5)"


SCHEDULE_YAML = """\
faults:
  state_dir: /tmp/campaign-markers
  schedule:
    - {kind: nonfinite, at_step: 40, steps: 3, rank: 0}
    - {kind: straggler, at_step: 100, until_step: 160, rank: 1, seconds: 0.3}
    - {kind: hang, at_step: 220, rank: 1, where: data}
    - kind: crash
      at_step: 300
      rank: 0
"""


def test_a_fault_schedule_in_a_file_lists_each_fault_with_every_setting_spelled_out(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(SCHEDULE_YAML)
    faults = load_config(path).faults
    assert faults.state_dir == "/tmp/campaign-markers"
    assert [e.name for e in faults.events()] == [
        "nonfinite-step40",
        "straggler-step100",
        "hang-step220",
        "crash-step300",
    ]
    assert faults.schedule[2] == {"kind": "hang", "at_step": 220, "rank": 1, "where": "data"}
    assert faults.schedule[3] == {"kind": "crash", "at_step": 300, "rank": 0, "exit_code": 13}
    # What a checkpoint keeps (plain data) reads back as the same schedule.
    assert build_section(FaultsConfig, asdict(faults), "faults") == faults


def test_a_fault_schedule_can_be_given_on_the_command_line() -> None:
    raw: dict = {}
    apply_override(raw, "faults.schedule=[{kind: crash, at_step: 15, rank: 1}, {kind: crash, at_step: 35, rank: 0}]")
    assert [(e.name, e.rank) for e in parse_config(raw).faults.events()] == [("crash-step15", 1), ("crash-step35", 0)]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ({"kind": "crash"}, "faults.schedule must be a list of faults, got dict"),
        ([3], "faults.schedule[0] must be a mapping with a kind, got int 3"),
        ([{"at_step": 5}], "faults.schedule[0].kind is missing: one of diverge, nonfinite,"),
        ([{"kind": "fire", "at_step": 5}], "faults.schedule[0].kind must be one of diverge, nonfinite,"),
        ([{"kind": "crash", "at_step": 5, "sleep": 1}], "unknown setting faults.schedule[0].sleep; known: at_step,"),
        ([{"kind": "hang", "at_step": 5, "kind_": 1}], "known: at_step, rank, where"),
        ([{"kind": "crash", "at_step": 2}, {"kind": "crash", "at_step": "x"}],
         "faults.schedule[1].at_step must be of type int, got str 'x'"),
        ([{"kind": "crash", "at_step": 5, "exit_code": 0}], "faults.schedule[0].exit_code must be in 1..255, got 0"),
        ([{"kind": "crash"}], "faults.schedule[0].at_step must be >= 1 (a scheduled fault has a step), got 0"),
        ([{"kind": "poison", "batches": 3}], "faults.schedule[0].at_batch must be >= 1"),
        ([{"kind": "straggler", "at_step": 9, "until_step": 9}],
         "faults.schedule[0].until_step must be 0 (never ends) or after at_step (9), got 9"),
        ([{"kind": "hang", "at_step": 5, "where": "disk"}],
         "faults.schedule[0].where must be one of data, compute, collective, got 'disk'"),
        ([{"kind": "hang", "at_step": 5, "rank": 0}, {"kind": "hang", "at_step": 5, "rank": -1, "where": "compute"}],
         "faults.schedule[1] repeats faults.schedule[0] (hang-step5 on every rank): give it another step or rank"),
    ],
)  # fmt: skip
def test_a_bad_fault_schedule_entry_is_named_in_one_line(schedule: object, expected: str) -> None:
    assert expected in _error({"faults": {"schedule": schedule}})


def test_ends_of_lasting_faults_are_checked() -> None:
    assert "faults.memory_balloon.until_step must be 0 (never ends) or after at_step (5), got 4" in _error(
        {"faults": {"memory_balloon": {"at_step": 5, "bytes": 10, "until_step": 4}}}
    )
