"""The control app on a real HTTP server: bad requests of every kind get a 4xx, change nothing,
and the server keeps serving (hypothesis throws them over real sockets)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.control.app import AppDeps, create_app
from rankscope.control.endpoint import ControlPortInUse, serve_control
from rankscope.control.state import ActionQueue, RunSnapshot

TOKEN = "server-test-token"
LIMIT = 2048


@pytest.fixture(scope="module")
def server():
    deps = AppDeps(ActionQueue(), RunSnapshot(), TOKEN, run_id="prop", max_body_bytes=LIMIT)
    served = serve_control(create_app(deps), "127.0.0.1", 0)
    yield served, deps
    served.close()


def request(served, method, path, body=None, headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def assert_unchanged_and_serving(served, deps):
    assert deps.queue.snapshot() == {"pending": [], "recent": []}
    assert not deps.queue.stopping
    assert request(served, "GET", "/healthz")[0] == 200


PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
paths = st.sampled_from(["/v1/actions", "/v1/alerts", "/v1/status", "/", "/v1", "/v1/actions/", "/V1/ACTIONS"]) | (
    st.from_regex(r"/[A-Za-z0-9_.~/-]{0,30}", fullmatch=True)
)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
bodies = st.binary(max_size=300) | st.sampled_from(
    [json.dumps({"action": "stop"}).encode(), json.dumps({"version": "4", "alerts": []}).encode()]
)
bad_auth = st.sampled_from([{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}]) | (
    st.builds(lambda v: {"Authorization": v}, header_text.filter(lambda v: v.strip() != f"Bearer {TOKEN}"))
)


@PROPERTY
@given(method=methods, path=paths, body=bodies, auth=bad_auth)
def test_requests_without_the_token_get_a_4xx_and_change_nothing(server, method, path, body, auth):
    served, deps = server
    if path == "/healthz":
        return  # public by design
    status, _ = request(served, method, path, body if method in ("POST", "PUT", "PATCH") else None, auth)
    assert 400 <= status < 500, (method, path, status)
    assert_unchanged_and_serving(served, deps)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
malformed = (
    st.binary(max_size=400)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.sampled_from(
        [
            b"",
            b"{",
            b'{"action": NaN}',
            b'{"action": "stop", "reason": "a\\nb"}',
            b'{"action": "stop", "params": {"lr_factor": 0.5}}',
            b'{"version": "4", "alerts": [{"status": "firing"}]}',
            b'{"version": "4", "alerts": [{"status": "firing", "labels": {"action": "nuke"}, '
            b'"startsAt": "t", "fingerprint": "f"}]}',
            '{"action": "stop", "reason": "\u2028"}'.encode(),
            b"\xef\xbb\xbf{}",
        ]
    )
)


def _would_be_accepted(path, raw):
    """The few random bodies that are in fact valid requests (e.g. a lucky {"action": "pause"})."""
    try:
        value = json.loads(raw)
    except ValueError:
        return False
    if path == "/v1/actions":
        return isinstance(value, dict) and value.get("action") in ("checkpoint", "reduce_lr", "pause", "resume", "stop")
    return isinstance(value, dict) and value.get("version") == "4" and isinstance(value.get("alerts"), list)


@PROPERTY
@given(path=st.sampled_from(["/v1/actions", "/v1/alerts"]), raw=malformed)
def test_malformed_bodies_with_the_token_get_a_4xx_and_change_nothing(server, path, raw):
    served, deps = server
    if _would_be_accepted(path, raw):
        return  # not malformed; the OpenAPI tests cover what is accepted
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, body = request(served, "POST", path, raw, headers)
    assert 400 <= status < 500, (raw, status, body)
    assert "\n" not in json.loads(body)["error"]
    assert_unchanged_and_serving(served, deps)


@PROPERTY
@given(path=st.sampled_from(["/v1/actions", "/v1/alerts"]), size=st.integers(LIMIT + 1, 8 * LIMIT))
def test_oversized_bodies_get_413_and_change_nothing(server, path, size):
    served, deps = server
    raw = json.dumps({"action": "stop", "reason": "x" * size}).encode()[: max(size, LIMIT + 1)]
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, _ = request(served, "POST", path, raw, headers)
    assert status == 413
    assert_unchanged_and_serving(served, deps)


@pytest.mark.parametrize(
    "raw",
    [
        b"THIS IS NOT HTTP\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\n\r\n",
        b"POST /v1/actions HTTP/1.1\r\n" + b"X-Flood: y\r\n" * 200 + b"\r\n",
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
    ],
    ids=["not-http", "bad-version", "too-many-headers", "long-request-line"],
)
def test_requests_that_are_not_valid_http_get_a_4xx(server, raw):
    served, deps = server
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(raw)
        answer = sock.recv(1024)
    status = int(answer.split()[1])
    assert 400 <= status < 500, answer[:100]
    assert_unchanged_and_serving(served, deps)


def test_a_client_that_stalls_mid_body_does_not_block_others(server):
    served, deps = server
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as stalled:
        stalled.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n".encode()
        )
        assert_unchanged_and_serving(served, deps)


def test_a_valid_request_over_http_is_accepted():
    deps = AppDeps(ActionQueue(), RunSnapshot(), TOKEN)
    served = serve_control(create_app(deps), "127.0.0.1", 0)
    try:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        status, body = request(served, "POST", "/v1/actions", json.dumps({"action": "checkpoint"}).encode(), headers)
    finally:
        served.close()
    assert status == 202
    assert [r["id"] for r in deps.queue.snapshot()["pending"]] == [json.loads(body)["id"]]


def test_a_taken_port_is_a_named_error(server):
    served, _ = server
    with pytest.raises(ControlPortInUse, match=f"control port {served.port} on 127.0.0.1 is already in use"):
        serve_control(create_app(AppDeps(ActionQueue(), RunSnapshot(), TOKEN)), "127.0.0.1", served.port)


def test_the_url_names_host_and_port(server):
    served, _ = server
    assert served.url == f"http://127.0.0.1:{served.port}"


def _stall_mid_body(port, headers: bytes) -> tuple[int, dict]:
    """POST 100 declared bytes, send 10, then wait for the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            + headers
            + b'\r\n{"action":'
        )
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def test_a_body_that_stops_arriving_gets_408_and_changes_nothing():
    deps = AppDeps(ActionQueue(), RunSnapshot(), TOKEN)
    served = serve_control(create_app(deps), "127.0.0.1", 0, timeout=0.5)
    try:
        status, body = _stall_mid_body(served.port, f"Authorization: Bearer {TOKEN}\r\n".encode())
        assert status == 408, body
        assert body["error"] == "the body did not arrive within 0.5 s (10 of 100 bytes)"
        assert_unchanged_and_serving(served, deps)
    finally:
        served.close()


def test_a_stalled_body_with_a_wrong_token_gets_the_token_refusal_first():
    deps = AppDeps(ActionQueue(), RunSnapshot(), TOKEN)
    served = serve_control(create_app(deps), "127.0.0.1", 0, timeout=0.5)
    try:
        status, _ = _stall_mid_body(served.port, b"Authorization: Bearer wrong\r\n")
        assert status == 403  # the app's order of checks: the token before the body
        assert_unchanged_and_serving(served, deps)
    finally:
        served.close()
