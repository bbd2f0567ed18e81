"""Property-based fuzzing of both endpoints over real sockets: whatever bytes a client sends, it gets
well-formed HTTP/1.1 answers (or a clean close), never an exception in the server's I/O thread, and on
the control endpoint only statuses that exporter/rankscope/control/openapi.yaml allows, with its
Error body. Requests are built from parts that reach every corner of h11 and of our bounds: odd
methods, targets and versions (HTTP/0.9 included), Content-Length as Unicode digits, negative, huge or
repeated, chunked and unknown transfer codings, Expect, folded and oversized headers, pipelining.
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import socket
from pathlib import Path

import jsonschema
import pytest
import rankscope.control
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from rankscope.control.app import AppDeps, create_app
from rankscope.control.endpoint import serve_control
from rankscope.control.state import ActionQueue, RunSnapshot
from rankscope.serving.metrics_endpoint import serve_metrics

SPEC = yaml.safe_load((Path(rankscope.control.__file__).parent / "openapi.yaml").read_text())
TOKEN = "fuzz-token"
ERROR = jsonschema.Draft202012Validator(SPEC["components"]["schemas"]["Error"])


def allowed(path: str, method: str) -> set[int]:
    """What the spec lets the control endpoint answer this request: its operation's statuses, the server's
    refusals, 404 off the routes, 405 for another method, 500 anywhere."""
    statuses = {int(s) for s in SPEC["x-server-responses"]} | {404, 405, 500}
    operation = SPEC["paths"].get(path, {}).get(method.lower(), {})
    return statuses | {int(s) for s in operation.get("responses", {})}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "stopped serving" in record.getMessage():
            self.failures.append(self.format(record))


@pytest.fixture(scope="module")
def servers():
    capture = _Capture()
    logger = logging.getLogger("rankscope")
    level = logger.level
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)
    registry = CollectorRegistry()
    Counter("rankscope_fuzz_events", "events", registry=registry).inc()
    queue = ActionQueue(max_pending=10_000)
    started = {
        "control": serve_control(
            create_app(AppDeps(queue, RunSnapshot(), TOKEN, max_body_bytes=4096)), "127.0.0.1", 0, timeout=0.5
        ),  # fmt: skip
        "metrics": serve_metrics(registry, "127.0.0.1", 0, timeout=0.5),
    }
    yield started, capture
    for server in started.values():
        server.close()
    logger.removeHandler(capture)
    logger.setLevel(level)


TOKENS = st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "get", "PRI", "X" * 50])
TARGETS = st.sampled_from(["/", "/metrics", "/-/healthy", "/healthz", "/v1/status", "/v1/actions", "/v1/alerts",
                           "/v1/stacks", "/nowhere", "*", "http://x/v1/status", "/%00", "/v1/status?x=1"])  # fmt: skip
VERSIONS = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "http/1.1", "HTTP/1.1 ", ""])
DIGITS = st.sampled_from(["0", "5", "17", "4096", "4097", "-1", "²", "١٢", " 5", "5, 5", "5, 6", "0x10", "9" * 25, ""])
HEADER = st.one_of(
    st.tuples(st.just("Content-Length"), DIGITS),
    st.tuples(st.just("Transfer-Encoding"), st.sampled_from(["chunked", "gzip", "gzip, chunked", "identity"])),
    st.tuples(st.just("Content-Type"), st.sampled_from(["application/json", "text/plain", "application/json; x=ü"])),
    st.tuples(st.just("Authorization"), st.sampled_from([f"Bearer {TOKEN}", "Bearer nope", "Basic eDp5", ""])),
    st.tuples(st.just("Expect"), st.just("100-continue")),
    st.tuples(st.just("Connection"), st.sampled_from(["close", "keep-alive", "upgrade"])),
    st.tuples(st.just("Accept-Encoding"), st.sampled_from(["gzip", "gzip;q=0", "br"])),
    st.tuples(st.text(st.characters(codec="latin-1"), max_size=12),
              st.text(st.characters(codec="latin-1"), max_size=30)),
)  # fmt: skip
BODIES = st.one_of(
    st.just(b""),
    st.sampled_from([b'{"action": "pause"}', b"{not json", b"5\r\nhello\r\n0\r\n\r\n", b"\xff\xfe"]),
    st.binary(max_size=200),
)


@st.composite
def requests(draw) -> tuple[bytes, str, str]:
    """(the raw bytes, the path and method they name, for the spec's answer)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=300)), "", ""
    method, target, version = draw(TOKENS), draw(TARGETS), draw(VERSIONS)
    line = f"{method} {target} {version}".rstrip() if version else f"{method} {target}"
    headers = [("Host", "x")] if draw(st.booleans()) or version != "HTTP/1.1" else []
    headers += draw(st.lists(HEADER, max_size=5))
    head = line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    if draw(st.integers(0, 19)) == 0:
        head += " folded\r\n"
    if draw(st.integers(0, 29)) == 0:
        head += "X-Big: " + "y" * 70_000 + "\r\n"
    try:  # as a client on the wire would: latin-1 bytes (so "²" is the single byte 0xb2), else UTF-8
        raw = (head + "\r\n").encode("latin-1")
    except UnicodeEncodeError:
        raw = (head + "\r\n").encode("utf-8")
    raw += draw(BODIES)
    if draw(st.integers(0, 9)) == 0:
        raw += b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"  # pipelined
    return raw, target.split("?")[0], method


def exchange(port: int, raw: bytes) -> bytes:
    """Send everything, half-close, read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered and closed before taking it all: read what it said
        stream = b""
        try:
            while chunk := sock.recv(65536):
                stream += chunk
        except ConnectionResetError:
            pass
        return stream


class _Unclosable(io.BytesIO):
    def close(self) -> None:  # http.client closes its file after a closing answer; the next must be read too
        pass


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.file = _Unclosable(data)

    def makefile(self, *args, **kwargs):
        return self.file


def answers(stream: bytes, head_request: bool) -> list[tuple[int, str, dict[str, str], bytes]]:
    """Every response in `stream`, parsed strictly (status line, headers, Content-Length framing); nothing
    may follow an answer that closes the connection."""
    found = []
    source = _Bytes(stream)
    while source.file.tell() < len(stream):
        response = http.client.HTTPResponse(source, method="HEAD" if head_request and not found else "GET")
        response.begin()  # raises on anything that is not a well-formed status line and head
        assert response.version == 11 and response.reason, (response.version, response.reason)
        assert response.getheader("Content-Length") is not None
        body = response.read()
        closing = response.getheader("Connection", "").lower() == "close"
        if head_request and not found and closing and response.status >= 400:
            # A refusal the server made before knowing the method (h11 refused the head): it carries its body.
            body = source.file.read(int(response.getheader("Content-Length")))
        found.append((response.status, response.reason, dict(response.getheaders()), body))
        if closing:
            assert source.file.tell() == len(stream), "bytes after an answer that closed the connection"
    return found


@pytest.mark.parametrize("kind", ["control", "metrics"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests())
def test_every_request_gets_well_formed_answers_the_spec_allows_or_a_clean_close(servers, kind, request):
    started, capture = servers
    raw, path, method = request
    stream = exchange(started[kind].port, raw)
    for status, _reason, _headers, body in answers(stream, method == "HEAD"):
        assert 100 <= status < 600
        if kind == "control":
            assert status in allowed(path, method) | {200, 202}, (status, path, method)
            if status >= 400 and method != "HEAD":
                ERROR.validate(json.loads(body))
    assert not capture.failures, capture.failures[0]
    # ... and the server still serves:
    with socket.create_connection(("127.0.0.1", started[kind].port), timeout=10) as probe:
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert probe.recv(16).startswith(b"HTTP/1.1 ")
