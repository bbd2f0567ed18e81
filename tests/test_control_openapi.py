"""exporter/rankscope/control/openapi.yaml checked against the app: routes, status codes, schemas.

Every documented (route, method, status) is produced by a request below, and
every request below is documented; the app answers no status the document
does not name (404 and 500 are route-independent and said in its description).
Request bodies: hypothesis generates near-valid ones, and the app accepts
exactly those the document's schema accepts.
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import rankscope.control
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.control.actions import ACTIONS, RESULTS, ActionRequest
from rankscope.control.app import _REASONS, ROUTES, AppDeps, create_app
from rankscope.control.state import ActionQueue, ActionRecord, RunSnapshot

SPEC = yaml.safe_load((Path(rankscope.control.__file__).parent / "openapi.yaml").read_text())
TOKEN = "spec-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for components/schemas/<name>, resolving the document's $refs."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": SPEC["components"]})


def response_validator(path: str, method: str, status: int) -> jsonschema.Draft202012Validator:
    response = SPEC["paths"][path][method.lower()]["responses"][str(status)]
    if "$ref" in response:
        response = SPEC["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    schema = response["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": SPEC["components"]})


def documented() -> set[tuple[str, str, int]]:
    return {
        (path, method.upper(), int(status))
        for path, operations in SPEC["paths"].items()
        for method, operation in operations.items()
        for status in operation["responses"]
    }


def _stacks(local: bool) -> dict:
    return {"summary": "rank 0: main in x.py:1", "groups": [{"ranks": [0], "headline": "main in x.py:1", "stacks": ""}]}


def _immediate(request):
    record = ActionRecord("r-1", request.action, request.source, request.reason, {}, 0.0)
    return record, False


def fresh_app(max_pending: int = 64):
    deps = AppDeps(
        ActionQueue(max_pending=max_pending), RunSnapshot(), TOKEN, max_body_bytes=2048, stacks=_stacks,
        immediate=_immediate,
    )  # fmt: skip
    return create_app(deps), deps


ALERT = {
    "status": "firing",
    "labels": {"alertname": "LossPlateau", "action": "reduce_lr"},
    "annotations": {},
    "startsAt": "2026-01-01T00:00:00Z",
    "fingerprint": "abc",
}
NOTIFICATION = {"version": "4", "status": "firing", "alerts": [ALERT]}


def _wrong_method(path: str) -> dict:
    return {"method": "DELETE", "path": path}


def _stop_first(deps) -> None:
    deps.queue.submit([ActionRequest("stop", "operator", "operator:first")])


def _fill(deps) -> None:
    deps.queue.submit([ActionRequest("checkpoint", "operator", "operator:first")])


# (path, method, status) -> how to make the app answer it. `before` prepares the app's state.
RECIPES: dict[tuple[str, str, int], dict] = {
    ("/healthz", "GET", 200): {"headers": {}},
    ("/healthz", "GET", 405): _wrong_method("/healthz"),
    ("/v1/status", "GET", 200): {},
    ("/v1/status", "GET", 401): {"headers": {}},
    ("/v1/status", "GET", 403): {"headers": {"Authorization": "Bearer nope"}},
    ("/v1/status", "GET", 405): _wrong_method("/v1/status"),
    ("/v1/stacks", "GET", 200): {},
    ("/v1/stacks", "GET", 401): {"headers": {}},
    ("/v1/stacks", "GET", 403): {"headers": {"Authorization": "Bearer nope"}},
    ("/v1/stacks", "GET", 405): _wrong_method("/v1/stacks"),
}
for _path, _good, _status, _meaning in (
    ("/v1/actions", {"action": "pause"}, 202, {"action": "explode"}),
    ("/v1/alerts", NOTIFICATION, 202, {**NOTIFICATION, "alerts": [{**ALERT, "labels": {"action": "explode"}}]}),
):
    RECIPES.update(
        {
            (_path, "POST", _status): {"body": _good},
            (_path, "POST", 400): {"body": b"{not json"},
            (_path, "POST", 401): {"body": _good, "headers": {}},
            (_path, "POST", 403): {"body": _good, "headers": {"Authorization": "Bearer nope"}},
            (_path, "POST", 405): _wrong_method(_path),
            (_path, "POST", 409): {"body": _good, "before": _stop_first},
            (_path, "POST", 411): {"body": _good, "headers": {**AUTH, "Content-Length": None}},
            (_path, "POST", 413): {"body": b" " * 2049},
            (_path, "POST", 415): {"body": _good, "headers": {**AUTH, "Content-Type": "text/plain"}},
            (_path, "POST", 422): {"body": _meaning},
            (_path, "POST", 503): {"body": _good, "before": _fill, "max_pending": 1},
        }
    )
RECIPES[("/v1/alerts", "POST", 200)] = {"body": {**NOTIFICATION, "alerts": [{**ALERT, "status": "resolved"}]}}


def test_the_spec_lists_exactly_the_served_routes_and_methods():
    spec_routes = {path: tuple(m.upper() for m in operations) for path, operations in SPEC["paths"].items()}
    assert spec_routes == ROUTES


def test_every_recipe_is_documented_and_every_documented_status_has_a_recipe():
    assert set(RECIPES) == documented()


def test_the_app_answers_no_status_the_spec_does_not_name():
    spec_statuses = {status for _, _, status in documented()} | {404, 500}
    assert set(_REASONS) == spec_statuses


def test_the_spec_enums_match_the_code():
    assert tuple(SPEC["components"]["schemas"]["Action"]["enum"]) == ACTIONS
    assert tuple(SPEC["components"]["schemas"]["Result"]["enum"]) == tuple(RESULTS)


def test_the_spec_is_valid_openapi_shaped_json_schema():
    for name in SPEC["components"]["schemas"]:
        jsonschema.Draft202012Validator.check_schema(SPEC["components"]["schemas"][name])
    example = SPEC["paths"]["/v1/actions"]["post"]["requestBody"]["content"]["application/json"]["example"]
    validator("ActionRequest").validate(example)


@pytest.mark.parametrize(("path", "method", "status"), sorted(documented()), ids=lambda v: str(v))
def test_every_documented_status_is_served_with_a_body_matching_its_schema(wsgi_call, path, method, status):
    recipe = RECIPES[(path, method, status)]
    app, deps = fresh_app(recipe.get("max_pending", 64))
    if "before" in recipe:
        recipe["before"](deps)
    got, headers, body = wsgi_call(
        app, recipe.get("method", method), recipe.get("path", path), recipe.get("body"), recipe.get("headers", AUTH)
    )
    assert got == status, body
    response_validator(path, method, status).validate(body)
    documented_headers = _response(path, method, status).get("headers", {})
    for header in documented_headers:
        assert header in headers, f"{status} must carry {header}"


def _response(path: str, method: str, status: int) -> dict:
    response = SPEC["paths"][path][method.lower()]["responses"][str(status)]
    if "$ref" in response:
        return SPEC["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    return response


def test_status_with_settled_actions_matches_its_schema(wsgi_call):
    app, deps = fresh_app()
    wsgi_call(app, "POST", "/v1/actions", {"action": "reduce_lr", "params": {"lr_factor": 0.5}}, AUTH)
    wsgi_call(app, "POST", "/v1/actions", {"action": "checkpoint"}, AUTH)
    first, _ = deps.queue.take()
    deps.queue.settle(first, "refused_cooldown", step=3, detail="too soon")
    deps.snapshot.update(step=3, learning_rates=[0.1], paused=True, paused_since=1.0)
    status, _, body = wsgi_call(app, "GET", "/v1/status", headers=AUTH)
    assert status == 200
    validator("Status").validate(body)


# --- request bodies: the app accepts exactly what the schema accepts ------------------------------

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
reasons = st.text(max_size=210) | st.sampled_from(["", "ok", "x" * 200, "x" * 201, "line\nbreak", "tab\there"])
action_bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "action": st.sampled_from([*ACTIONS, "explode"]) | json_any,
            "params": st.fixed_dictionaries({}, optional={"lr_factor": st.floats(-0.5, 1.5) | json_any}) | json_any,
            "reason": reasons | json_any,
            "extra": json_any,
        },
    )
    | json_any
)
string_maps = st.dictionaries(
    st.sampled_from(["alertname", "action", "lr_factor", "severity"]) | st.text(max_size=6),
    st.sampled_from([*ACTIONS, "explode", "0.5", "2", "x"]) | json_any,
    max_size=4,
)
alerts = st.fixed_dictionaries(
    {},
    optional={
        "status": st.sampled_from(["firing", "resolved", "pending"]) | json_any,
        "labels": string_maps | json_any,
        "annotations": string_maps,
        "startsAt": st.sampled_from(["2026-01-01T00:00:00Z", ""]) | json_any,
        "fingerprint": st.sampled_from(["f1", "f2", "", "f" * 201]) | json_any,
        "endsAt": st.text(max_size=5),
    },
)
notifications = (
    st.fixed_dictionaries(
        {},
        optional={
            "version": st.sampled_from(["4", "3", 4]) | json_any,
            "alerts": st.lists(alerts, max_size=3) | json_any,
            "truncatedAlerts": st.integers(-2, 3) | st.floats(0, 3) | json_any,
            "status": st.sampled_from(["firing", "resolved"]),
            "groupLabels": string_maps,
        },
    )
    | json_any
)

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(body=action_bodies)
def test_an_action_body_is_accepted_exactly_when_the_schema_accepts_it(wsgi_call, body):
    app, deps = fresh_app()
    status, _, answer = wsgi_call(app, "POST", "/v1/actions", body, AUTH)
    if status == 413:  # a generated body past control.max_body_bytes: refused before it is read as JSON
        assert "exceeds the limit" in answer["error"], answer
        assert deps.queue.snapshot()["pending"] == []
    elif validator("ActionRequest").is_valid(body):
        assert status == 202, (body, answer)
    else:
        assert status in (400, 422), (body, answer)
        assert deps.queue.snapshot()["pending"] == []
    response_validator("/v1/actions", "POST", status).validate(answer)


@PROPERTY
@given(body=notifications)
def test_a_notification_the_schema_refuses_is_refused_and_one_it_accepts_is_never_a_400(wsgi_call, body):
    app, deps = fresh_app()
    status, _, answer = wsgi_call(app, "POST", "/v1/alerts", body, AUTH)
    if status == 413:  # a generated body past control.max_body_bytes: refused before it is read as JSON
        assert "exceeds the limit" in answer["error"], answer
    elif validator("AlertmanagerPayload").is_valid(body):
        assert status in (200, 202, 422), (body, answer)  # 422: an action label the trainer does not know
    else:
        assert status in (400, 422), (body, answer)
    if status >= 400:
        assert deps.queue.snapshot()["pending"] == []
    response_validator("/v1/alerts", "POST", status).validate(answer)
