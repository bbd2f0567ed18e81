"""Checks on an operator's /v1/actions body: 400 for shape, 422 for meaning."""

from __future__ import annotations

import pytest
from rankscope.control.actions import ACTIONS, ActionRequest, RequestError, parse_action_body


def test_a_full_request_becomes_an_operator_action():
    request = parse_action_body({"action": "reduce_lr", "params": {"lr_factor": 0.25}, "reason": "plateau"})
    assert request == ActionRequest("reduce_lr", "operator", "operator:plateau", {"lr_factor": 0.25})


@pytest.mark.parametrize("action", ACTIONS)
def test_every_action_needs_only_its_name(action):
    request = parse_action_body({"action": action})
    assert (request.action, request.reason, request.params, request.key) == (
        action,
        "operator:unspecified",
        {},
        None,
    )


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ([], 400, "body must be a JSON object, got array"),
        ({}, 400, "field 'action' is required"),
        ({"action": 3}, 400, "field 'action' must be a string, got number"),
        ({"action": "stop", "extra": 1}, 400, "unknown field 'extra'; known: action, params, reason"),
        ({"action": "stop", "params": []}, 400, "field 'params' must be an object, got array"),
        ({"action": "reduce_lr", "params": {"factor": 0.5}}, 400, "unknown parameter params.factor"),
        ({"action": "reduce_lr", "params": {"lr_factor": "half"}}, 400, "params.lr_factor must be a number"),
        ({"action": "reduce_lr", "params": {"lr_factor": True}}, 400, "params.lr_factor must be a number"),
        ({"action": "stop", "reason": 5}, 400, "field 'reason' must be a string, got number"),
        ({"action": "stop", "reason": "x" * 201}, 400, "at most 200 characters"),
        ({"action": "stop", "reason": "two\nlines"}, 400, "one line of text without control characters"),
        (
            {"action": "explode"},
            422,
            "unknown action 'explode'; known: checkpoint, reduce_lr, rollback, reduce_micro_batch, pause, resume, stop",
        ),
        ({"action": "reduce_lr", "params": {"lr_factor": 1}}, 422, "between 0 and 1 (exclusive), got 1"),
        ({"action": "reduce_lr", "params": {"lr_factor": 0}}, 422, "between 0 and 1 (exclusive), got 0"),
        ({"action": "pause", "params": {"lr_factor": 0.5}}, 422, "params.lr_factor applies only to reduce_lr"),
    ],
)
def test_bad_bodies_are_refused_with_a_one_line_reason(body, status, message):
    with pytest.raises(RequestError) as caught:
        parse_action_body(body)
    assert caught.value.status == status
    assert message in caught.value.message
    assert "\n" not in caught.value.message


def test_a_huge_unknown_action_name_is_not_echoed_in_full():
    with pytest.raises(RequestError) as caught:
        parse_action_body({"action": "x" * 10_000})
    assert len(caught.value.message) < 200
