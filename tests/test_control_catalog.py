"""Every copy of the action list is pinned to its one declaration, exporter/rankscope/control/catalog.py.

The channel's behaviours, the CLI's commands and options, the OpenAPI document, the limits, the
Alertmanager route to the trainer and the rule pack's `action` labels are each checked
against the catalog; the last test shows that a copy that drifts is caught.
"""

from __future__ import annotations

import re

import pytest
import yaml
from rankscope.cli import build_parser
from rankscope.control import ControlChannel, ControlConfig
from rankscope.control.actions import ActionRequest
from rankscope.control.catalog import CATALOG, RESULTS, check_result
from rankscope.control.limits import ActionLimits
from rankscope.control.state import ActionQueue
from rankscope.mixin import config as mixin_config
from rankscope.mixin import rules as mixin_rules

from tests.support import REPO

NAMES = [spec.name for spec in CATALOG]


def route_problems(alertmanager: dict) -> list[str]:
    """How the trainer route's `action` matcher differs from the catalog."""
    routes = [r for r in alertmanager["route"]["routes"] if r["receiver"] == "trainer-control"]
    matchers = [m for r in routes for m in r.get("matchers", []) if m.startswith("action=~")]
    if len(matchers) != 1:
        return [f"expected one action=~ matcher on the trainer route, found {matchers}"]
    listed = re.fullmatch(r'action=~"(.*)"', matchers[0]).group(1).split("|")
    return [] if listed == NAMES else [f"the trainer route matches {listed}, the catalog declares {NAMES}"]


def test_the_channel_has_one_behaviour_per_declared_action():
    channel = ControlChannel(ControlConfig(enabled=False))
    assert list(channel._behaviours) == NAMES


def test_the_cli_has_one_command_per_action_with_its_parameters():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for spec in CATALOG:
        options = {option for a in commands[spec.command]._actions for option in a.option_strings}
        assert {p.option for p in spec.parameters} <= options, spec.name
    assert set(commands) == {spec.command for spec in CATALOG} | {"status", "health", "stacks"}


def test_the_openapi_document_declares_the_actions_parameters_and_results():
    document = yaml.safe_load((REPO / "exporter" / "rankscope" / "control" / "openapi.yaml").read_text())
    schemas = document["components"]["schemas"]
    assert schemas["Action"]["enum"] == NAMES
    assert schemas["Result"]["enum"] == list(RESULTS)
    declared = schemas["ActionRequest"]["properties"]["params"]["properties"]
    for spec in CATALOG:
        for parameter in spec.parameters:
            bounds = declared[parameter.name]
            key = "exclusive" if parameter.exclusive else ""
            assert bounds[f"{key}Minimum" if key else "minimum"] == parameter.minimum
            assert bounds[f"{key}Maximum" if key else "maximum"] == parameter.maximum
            assert bounds["type"] == ("integer" if parameter.integer else "number")
    assert set(declared) == {p.name for spec in CATALOG for p in spec.parameters}


def test_limits_exist_for_exactly_the_actions_that_declare_them():
    limits = ActionLimits.from_config(ControlConfig())
    assert set(limits._limits) == {s.name for s in CATALOG if s.cooldown_steps or s.cooldown_seconds or s.cap}
    for spec in CATALOG:
        for setting in (spec.cooldown_steps, spec.cooldown_seconds, spec.cap):
            assert not setting or hasattr(ControlConfig(), setting), (spec.name, setting)


def test_the_alertmanager_route_to_the_trainer_matches_every_action():
    assert route_problems(yaml.safe_load((REPO / "alertmanager" / "alertmanager.yml").read_text())) == []


def test_every_shipped_alert_carries_only_an_action_the_config_lets_it_ask_for():
    # Which alert asks for which action is the rule pack's config (rankscope.mixin.config), not the catalog's.
    t = mixin_config.Tunables()
    allowed: dict[str, set[str]] = {}
    for name, choice in mixin_config.ACTION_TUNABLES.items():
        assert set(choice.choices) - {""} <= set(NAMES), name
        for alert in choice.alerts:
            allowed.setdefault(alert, set()).update(mixin_config.action_choices(name))
    alerts = mixin_rules.alerts(t)
    carrying = {a.name: a.action for a in alerts if a.action}
    assert {name: action for name, action in carrying.items() if action not in allowed.get(name, ())} == {}
    assert set(allowed) <= {a.name for a in alerts}


def test_the_library_names_no_alert_outside_the_rule_pack():
    # The catalog declares actions; the rule pack (rankscope/mixin/) alone says which alert asks for them.
    names = {a.name for a in mixin_rules.alerts(mixin_config.Tunables())}
    assert "RankscopeRankDown" in names
    library = REPO / "exporter" / "rankscope"
    found = {
        (str(path.relative_to(library)), name)
        for path in library.rglob("*")
        if path.is_file() and path.suffix in (".py", ".yaml", ".json", ".md") and "mixin" not in path.parts
        for name in re.findall(r"\bRankscope[A-Z]\w*", path.read_text())
        if name in names
    }
    assert found == set()


@pytest.mark.parametrize("drift", ["drop", "add"])
def test_a_drifted_copy_is_caught(drift):
    alertmanager = yaml.safe_load((REPO / "alertmanager" / "alertmanager.yml").read_text())
    route = next(r for r in alertmanager["route"]["routes"] if r["receiver"] == "trainer-control")
    listed = NAMES[1:] if drift == "drop" else [*NAMES, "rollback"]
    route["matchers"] = [f'action=~"{"|".join(listed)}"']
    assert route_problems(alertmanager) != []


def test_an_outcome_outside_the_catalog_is_refused_where_outcomes_are_recorded():
    queue = ActionQueue()
    queue.submit([ActionRequest(action="pause", source="operator", reason="operator:r")])
    (taken,) = queue.take()
    with pytest.raises(ValueError, match="'done' is not one of rankscope.control.catalog.RESULTS"):
        queue.settle(taken, "done", 1)
    assert queue.settle(taken, "applied", 1).status == "applied"
    assert {check_result(result) for result in RESULTS} == set(RESULTS)
