"""The control app called in-process (no socket): routing, auth, limits, and what a request changes."""

from __future__ import annotations

import pytest
from rankscope.control.app import AppDeps, create_app
from rankscope.control.state import ActionQueue, RunSnapshot

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Counted:
    """Records what the app counts (the real channel passes its metric here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def __call__(self, action: str, source: str, result: str) -> None:
        self.calls.append((action, source, result))


@pytest.fixture
def deps():
    return AppDeps(
        ActionQueue(max_pending=4), RunSnapshot(), TOKEN, run_id="unit", max_body_bytes=1024, count=Counted()
    )


@pytest.fixture
def call(deps, wsgi_call):
    app = create_app(deps)
    return lambda *args, **kwargs: wsgi_call(app, *args, **kwargs)


def firing(action="reduce_lr", fingerprint="f1", **labels):
    return {
        "status": "firing",
        "labels": {"alertname": "LossPlateau", "action": action, **labels},
        "annotations": {},
        "startsAt": "2026-01-01T00:00:00Z",
        "fingerprint": fingerprint,
    }


def notification(*alerts, **extra):
    return {"version": "4", "status": "firing", "truncatedAlerts": 0, "alerts": list(alerts), **extra}


def test_healthz_needs_no_token(call):
    status, _, body = call("GET", "/healthz")
    assert (status, body) == (200, {"status": "ok"})


def test_an_action_is_queued_and_answered_202_with_its_id(call, deps):
    status, _, body = call("POST", "/v1/actions", {"action": "checkpoint", "reason": "before upgrade"}, AUTH)
    assert status == 202
    assert body["action"] == "checkpoint" and body["status"] == "pending"
    (pending,) = deps.queue.snapshot()["pending"]
    assert (pending["id"], pending["reason"], pending["source"]) == (body["id"], "operator:before upgrade", "operator")


def test_status_reports_run_step_rates_pause_and_actions(call, deps):
    deps.snapshot.update(step=42, learning_rates=[0.1, float("nan")], paused=True, paused_since=5.0)
    call("POST", "/v1/actions", {"action": "pause"}, AUTH)
    status, _, body = call("GET", "/v1/status", headers=AUTH)
    assert status == 200
    assert body["run_id"] == "unit" and body["step"] == 42
    assert body["learning_rates"] == [0.1, None]  # an unreadable (device) rate is null, never NaN in JSON
    assert body["paused"] is True and body["paused_since"] == 5.0
    assert [p["action"] for p in body["pending"]] == ["pause"]
    assert body["recent"] == [] and body["stopping"] is False


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Basic dXNlcjpwdw=="}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": "Bearer wrong"}, 403),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403),
        ({"Authorization": "Bearer s3cret-tokén"}, 403),
    ],
)
def test_requests_without_the_right_token_are_refused_and_change_nothing(call, deps, headers, status):
    for method, path in (("GET", "/v1/status"), ("POST", "/v1/actions"), ("POST", "/v1/alerts")):
        got, response_headers, body = call(method, path, {"action": "stop"}, headers)
        assert got == status, (method, path, body)
        if status == 401:
            assert response_headers["WWW-Authenticate"].startswith("Bearer")
    assert deps.queue.snapshot() == {"pending": [], "recent": []}
    assert not deps.queue.stopping


def test_the_scheme_name_is_case_insensitive(call):
    assert call("POST", "/v1/actions", {"action": "pause"}, {"Authorization": f"bearer {TOKEN}"})[0] == 202


def test_an_insecure_app_accepts_requests_without_a_token(wsgi_call):
    app = create_app(AppDeps(ActionQueue(), RunSnapshot(), token=None))
    assert wsgi_call(app, "POST", "/v1/actions", {"action": "pause"})[0] == 202


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/nope", 404, None),
        ("DELETE", "/v1/actions", 405, "POST"),
        ("GET", "/v1/alerts", 405, "POST"),
        ("POST", "/v1/status", 405, "GET"),
        ("PUT", "/healthz", 405, "GET"),
    ],
)
def test_unknown_routes_and_wrong_methods_are_refused_before_auth(call, method, path, status, allow):
    got, headers, body = call(method, path)
    assert got == status
    assert headers.get("Allow") == allow
    assert "\n" not in body["error"]


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b"x" * 1025, {}, 413, "body of 1025 bytes exceeds the limit of 1024 bytes"),
        (b"{}", {"Content-Length": None}, 411, "a Content-Length header is required"),
        (b"{}", {"Content-Length": "-5"}, 400, "Content-Length must be a non-negative integer"),
        (b"{}", {"Content-Length": "10"}, 400, "body ended before Content-Length bytes"),
        (b'{"action": "pause"}', {"Content-Type": "text/plain"}, 415, "Content-Type must be application/json"),
        (b"\xff\xfe", {}, 400, "body is not UTF-8"),
        (b"{nope", {}, 400, "invalid JSON: Expecting property name"),
        (b'{"action": NaN}', {}, 400, "invalid JSON: NaN is not allowed"),
        (b"[" * 100_000, {"Content-Length": "1000"}, 400, "invalid JSON"),
        (b'{"action": "explode"}', {}, 422, "unknown action 'explode'"),
    ],
)
def test_bad_bodies_get_a_4xx_with_one_line_and_change_nothing(call, deps, body, headers, status, message):
    got, _, answer = call("POST", "/v1/actions", body, {**AUTH, **headers})
    assert got == status
    assert message in answer["error"]
    assert "\n" not in answer["error"]
    assert deps.queue.snapshot() == {"pending": [], "recent": []}


def test_deeply_nested_json_within_the_limit_is_a_400(wsgi_call):
    app = create_app(AppDeps(ActionQueue(), RunSnapshot(), TOKEN, max_body_bytes=200_000))
    status, _, body = wsgi_call(app, "POST", "/v1/actions", b"[" * 100_000, AUTH)
    assert status == 400
    assert body["error"].startswith("invalid JSON")


def test_the_content_type_may_carry_a_charset(call):
    headers = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    assert call("POST", "/v1/actions", {"action": "pause"}, headers)[0] == 202


def test_a_full_queue_answers_503_with_retry_after(call):
    for _ in range(4):
        assert call("POST", "/v1/actions", {"action": "checkpoint"}, AUTH)[0] == 202
    status, headers, _ = call("POST", "/v1/actions", {"action": "checkpoint"}, AUTH)
    assert status == 503
    assert headers["Retry-After"] == "1"


def test_after_a_stop_new_actions_get_409(call):
    assert call("POST", "/v1/actions", {"action": "stop"}, AUTH)[0] == 202
    status, _, body = call("POST", "/v1/actions", {"action": "checkpoint"}, AUTH)
    assert status == 409
    assert "stopping" in body["error"]
    assert call("GET", "/v1/status", headers=AUTH)[2]["stopping"] is True


def test_a_firing_alert_is_queued_and_answered_202(call, deps):
    status, _, body = call("POST", "/v1/alerts", notification(firing()), AUTH)
    assert status == 202
    assert [a["action"] for a in body["accepted"]] == ["reduce_lr"]
    assert body["duplicates"] == [] and body["ignored"] == 0
    (pending,) = deps.queue.snapshot()["pending"]
    assert (pending["source"], pending["reason"]) == ("alert", "alert:LossPlateau")


def test_a_repeated_notification_is_acknowledged_200_and_counted_as_duplicate(call, deps):
    first = call("POST", "/v1/alerts", notification(firing()), AUTH)[2]
    status, _, body = call("POST", "/v1/alerts", notification(firing()), AUTH)
    assert status == 200
    assert body["accepted"] == [] and body["duplicates"] == first["accepted"]
    assert len(deps.queue.snapshot()["pending"]) == 1
    assert deps.count.calls == [("reduce_lr", "alert", "duplicate")]


def test_resolved_and_action_less_alerts_are_acknowledged_and_counted_as_ignored(call, deps):
    resolved = {**firing(action="pause"), "status": "resolved"}
    plain = {**firing(), "labels": {"alertname": "RankDown"}, "fingerprint": "f2"}
    status, _, body = call("POST", "/v1/alerts", notification(resolved, plain), AUTH)
    assert status == 200
    assert body["ignored"] == 2
    assert deps.queue.snapshot()["pending"] == []
    assert sorted(deps.count.calls) == [("none", "alert", "ignored"), ("pause", "alert", "ignored")]


def test_truncated_alerts_are_logged_as_a_warning(call, caplog):
    with caplog.at_level("WARNING", logger="rankscope"):
        call("POST", "/v1/alerts", notification(firing(), truncatedAlerts=7), AUTH)
    assert "left 7 alert(s) out" in caplog.text


def test_an_alert_with_an_unknown_action_refuses_the_whole_notification(call, deps):
    body = notification(firing(fingerprint="ok"), firing(action="explode", fingerprint="bad"))
    status, _, answer = call("POST", "/v1/alerts", body, AUTH)
    assert status == 422
    assert "alerts[1]" in answer["error"]
    assert deps.queue.snapshot()["pending"] == []
    # Nothing was remembered either: the good alert, delivered again alone, is new.
    assert call("POST", "/v1/alerts", notification(firing(fingerprint="ok")), AUTH)[0] == 202
