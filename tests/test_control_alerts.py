"""Alertmanager webhook payloads (version 4) turned into action requests."""

from __future__ import annotations

import pytest
from rankscope.control.actions import RequestError
from rankscope.control.alerts import parse_alert_payload


def alert(status="firing", fingerprint="f1", starts_at="2026-01-01T00:00:00Z", annotations=None, **labels):
    return {
        "status": status,
        "labels": {"alertname": "LossPlateau", **labels},
        "annotations": annotations or {},
        "startsAt": starts_at,
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph",
        "fingerprint": fingerprint,
    }


def payload(*alerts, status="firing", **extra):
    return {
        "version": "4",
        "groupKey": '{}:{alertname="LossPlateau"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "trainer",
        "groupLabels": {"alertname": "LossPlateau"},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
        **extra,
    }


def test_a_firing_alert_with_an_action_label_becomes_a_request_keyed_by_fingerprint_and_start():
    batch = parse_alert_payload(payload(alert(action="reduce_lr")))
    (request,) = batch.requests
    assert (request.action, request.source, request.reason) == ("reduce_lr", "alert", "alert:LossPlateau")
    assert request.key == "f1@2026-01-01T00:00:00Z"
    assert batch.ignored == ()


def test_each_alert_is_judged_by_its_own_status_not_the_groups():
    # The group is "firing" because one alert fires; the resolved one must not act.
    batch = parse_alert_payload(
        payload(alert(action="checkpoint", fingerprint="a"), alert("resolved", action="stop", fingerprint="b"))
    )
    assert [r.action for r in batch.requests] == ["checkpoint"]
    assert batch.ignored == ("stop",)


def test_a_resolved_group_changes_nothing():
    batch = parse_alert_payload(payload(alert("resolved", action="pause"), status="resolved"))
    assert batch.requests == ()


def test_alerts_without_an_action_label_are_acknowledged_and_ignored():
    batch = parse_alert_payload(payload(alert(severity="page")))
    assert batch.requests == ()
    assert batch.ignored == ("none",)


def test_lr_factor_comes_from_a_label_or_an_annotation_and_the_label_wins():
    from_annotation = parse_alert_payload(payload(alert(action="reduce_lr", annotations={"lr_factor": "0.3"})))
    assert from_annotation.requests[0].params == {"lr_factor": 0.3}
    both = parse_alert_payload(payload(alert(action="reduce_lr", lr_factor="0.8", annotations={"lr_factor": "0.3"})))
    assert both.requests[0].params == {"lr_factor": 0.8}


def test_truncated_alerts_are_reported():
    assert parse_alert_payload(payload(alert(action="pause"), truncatedAlerts=3)).truncated == 3


def test_fields_a_newer_alertmanager_might_add_are_allowed():
    batch = parse_alert_payload(payload(alert(action="pause"), somethingNew={"x": 1}))
    assert len(batch.requests) == 1


def test_an_alert_name_with_control_characters_is_cleaned_not_refused():
    batch = parse_alert_payload(payload(alert(action="checkpoint", alertname="bad\nname")))
    assert batch.requests[0].reason == "alert:bad?name"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ("nope", 400, "body must be a JSON object, got string"),
        ({"version": "3", "alerts": []}, 400, "field 'version' must be \"4\""),
        ({"version": "4"}, 400, "field 'alerts' must be an array, got null"),
        ({"version": "4", "alerts": [], "truncatedAlerts": -1}, 400, "'truncatedAlerts' must be an integer >= 0"),
        ({"version": "4", "alerts": [1]}, 400, "alerts[0] must be an object, got number"),
        (payload({**alert(), "status": "pending"}), 400, 'alerts[0].status must be "firing" or "resolved"'),
        (payload({**alert(), "labels": {"action": 1}}), 400, "alerts[0].labels.'action' must be a string"),
        (payload({**alert(), "fingerprint": ""}), 400, "alerts[0].fingerprint must be a non-empty string"),
        (payload({**alert(), "startsAt": None}), 400, "alerts[0].startsAt must be a non-empty string"),
        (payload(alert(action="explode")), 422, "alerts[0] ('LossPlateau'): unknown action 'explode'"),
        (payload(alert(action="reduce_lr", lr_factor="lots")), 422, "lr_factor must be a number, got 'lots'"),
        (payload(alert(action="reduce_lr", lr_factor="1.5")), 422, "lr_factor must be between 0 and 1"),
        (
            payload(alert(action="pause", lr_factor="0.5")),
            422,
            "lr_factor applies only to reduce_lr or rollback, not to pause",
        ),
    ],
)
def test_malformed_payloads_are_refused_with_a_one_line_reason(body, status, message):
    with pytest.raises(RequestError) as caught:
        parse_alert_payload(body)
    assert caught.value.status == status
    assert message in caught.value.message
    assert "\n" not in caught.value.message


def test_an_unknown_action_on_a_resolved_alert_is_not_an_error():
    batch = parse_alert_payload(payload(alert("resolved", action="explode")))
    assert batch.ignored == ("none",)


def test_an_alert_about_another_run_is_acknowledged_and_ignored():
    batch = parse_alert_payload(payload(alert(action="reduce_lr", run_id="old-run")), run_id="new-run")
    assert batch.requests == () and batch.ignored == ("reduce_lr",)
    mine = parse_alert_payload(payload(alert(action="reduce_lr", run_id="new-run")), run_id="new-run")
    assert [r.action for r in mine.requests] == ["reduce_lr"]
    unlabelled = parse_alert_payload(payload(alert(action="checkpoint")), run_id="new-run")
    assert [r.action for r in unlabelled.requests] == ["checkpoint"]
