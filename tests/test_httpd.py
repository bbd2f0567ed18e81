"""rankscope.serving.http_server behind both real servers (/metrics and the control endpoint): real sockets, a real
fork and exec, thousands of real idle connections."""

from __future__ import annotations

import http.client
import multiprocessing
import os
import re
import resource
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry, Counter
from rankscope.control.app import AppDeps, create_app
from rankscope.control.endpoint import MAX_CONNECTIONS as CONTROL_MAX_CONNECTIONS
from rankscope.control.endpoint import serve_control
from rankscope.control.state import ActionQueue, RunSnapshot
from rankscope.serving.http_server import HttpServer, Response, listen
from rankscope.serving.metrics_endpoint import MAX_CONNECTIONS as METRICS_MAX_CONNECTIONS
from rankscope.serving.metrics_endpoint import serve_metrics

from tests.support import wait_for

KINDS = ["metrics", "control"]
#: The path each server answers 200 on without a token.
PATHS = {"metrics": "/metrics", "control": "/healthz"}
CAPS = {"metrics": METRICS_MAX_CONNECTIONS, "control": CONTROL_MAX_CONNECTIONS}


def start(kind: str, port: int = 0, timeout: float = 5.0):
    if kind == "metrics":
        registry = CollectorRegistry()
        Counter("rankscope_test_events", "events", registry=registry).inc()
        return serve_metrics(registry, "127.0.0.1", port, timeout=timeout)
    return serve_control(create_app(AppDeps(ActionQueue(), RunSnapshot(), "t0ken")), "127.0.0.1", port, timeout=timeout)


@contextmanager
def running(kind: str, port: int = 0, timeout: float = 5.0) -> Iterator:
    server = start(kind, port, timeout)
    try:
        yield server
    finally:
        server.close()


def get(port: int, path: str, connection: http.client.HTTPConnection | None = None) -> int:
    conn = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        if connection is None:
            conn.close()


def threads() -> int:
    """Threads of this process, as the kernel counts them (not only Python's)."""
    return len(os.listdir("/proc/self/task"))


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found.add(int(target[len("socket:[") : -1]))
    return found


def server_side_inodes(port: int) -> set[int]:
    """Sockets some process holds whose local port is `port`: the listener and its accepted connections."""
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and int(fields[9]):
                    found.add(int(fields[9]))  # inode 0: no descriptor any more (closed, in FIN_WAIT)
    return found


def _wait_for_release(ready, release) -> None:
    ready.set()
    release.wait(60)


@pytest.mark.parametrize("kind", KINDS)
def test_a_forked_child_holds_none_of_the_sockets_and_the_port_can_be_bound_again(kind):
    server = start(kind)
    port, path = server.port, PATHS[kind]
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    fork = multiprocessing.get_context("fork")  # what a DataLoader uses for its workers
    ready, release = fork.Event(), fork.Event()
    child = fork.Process(target=_wait_for_release, args=(ready, release))
    try:
        assert get(port, path, kept) == 200  # a kept-alive connection: an accepted socket exists
        child.start()
        assert ready.wait(30)
        ours = server_side_inodes(port)
        assert len(ours) >= 2, ours  # the listener and the kept-alive connection
        assert not ours & socket_inodes(child.pid)
        # The parent's server is untouched by the child's closing its copies.
        assert get(port, path, kept) == 200
        assert get(port, path) == 200
        kept.close()
        server.close()
        with running(kind, port) as again:  # what a restarted rank does, while the worker still lives
            assert child.is_alive()
            assert again.port == port and get(port, path) == 200
    finally:
        server.close()
        release.set()
        child.join(30)
    assert child.exitcode == 0


@pytest.mark.parametrize("kind", KINDS)
def test_an_execd_child_holds_none_of_the_sockets(kind):
    with running(kind) as server:
        ours = server_side_inodes(server.port)
        # close_fds=False: only close-on-exec keeps the sockets out of the new program.
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                 close_fds=False)  # fmt: skip
        try:
            assert ours and not ours & socket_inodes(child.pid)
        finally:
            child.stdin.close()
            child.wait(30)


@contextmanager
def file_limit(wanted: int) -> Iterator[int]:
    """Raise this process's soft limit on open files towards `wanted`; yields the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft if soft >= wanted else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    try:
        yield target
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("kind", KINDS)
def test_thousands_of_idle_connections_add_no_thread_and_a_request_still_succeeds(kind):
    with file_limit(8192) as limit, running(kind) as server:
        before = threads()
        idle = []
        try:
            for _ in range(min(3000, limit - 500)):  # both ends are in this process
                idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            assert len(idle) >= 1000, f"only {limit} open files allowed"
            assert get(server.port, PATHS[kind]) == 200  # while every idle connection is still open here
            assert threads() <= before
            # The server sheds the oldest idle connections: it holds at most its cap (and the listener).
            assert len(server_side_inodes(server.port)) <= CAPS[kind] + 1
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize("kind", KINDS)
def test_idle_half_sent_and_kept_alive_connections_are_closed_after_the_read_timeout(kind):
    with running(kind, timeout=0.5) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
            assert silent.recv(100) == b""  # closed, nothing said
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nHost: x")
            assert slow.recv(100).startswith(b"HTTP/1.1 408 ")
        kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            assert get(server.port, PATHS[kind], kept) == 200
            kept.sock.settimeout(10)
            assert kept.sock.recv(100) == b""
        finally:
            kept.close()


@pytest.mark.parametrize("kind", KINDS)
def test_pipelined_requests_on_one_connection_get_their_answers_in_order(kind):
    with running(kind) as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        path = PATHS[kind].encode()
        sock.sendall(
            b"GET "
            + path
            + b" HTTP/1.1\r\nHost: x\r\n\r\nGET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        stream = b""
        while chunk := sock.recv(65536):  # until the server closes, as the second request asked
            stream += chunk
        statuses = [int(code) for code in re.findall(rb"HTTP/1.1 (\d{3}) ", stream)]
        assert statuses == [200, 404]


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"THIS IS NOT HTTP\r\n\r\n", 400),
        (b"GET / HTTP/9.9\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n folded: header\r\nHost: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host: RFC 9112 says 400
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Flood: y\r\n" * 200 + b"\r\n", 431),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    ],
    ids=["not-http", "bad-version", "folded", "no-host", "too-many-headers", "long-request-line"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_broken_requests_get_a_status_line_and_the_server_goes_on(kind, raw, status):
    with running(kind) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(raw)
            answer = sock.recv(1024)
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:100]
        assert get(server.port, PATHS[kind]) == 200


def test_requests_beyond_the_workers_and_their_queue_are_answered_503_at_once():
    entered, release = threading.Event(), threading.Event()

    def slow(request, body):
        entered.set()
        release.wait(30)
        return Response(200, b"done")

    server = HttpServer(listen("127.0.0.1", 0), slow, lambda s, m: Response(s, m.encode()), name="t", workers=1,
                        queue_size=1)  # fmt: skip
    port = server.address[1]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        assert server.threads == 2
        socks[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(10)  # the one worker is busy
        for sock in socks[1:]:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # One of the two waits in the queue; the other is refused without waiting for the worker.
        readable = wait_for(lambda: select.select(socks[1:], [], [], 0.1)[0], 10, "an answer while the worker is busy")
        assert len(readable) == 1 and readable[0].recv(100).startswith(b"HTTP/1.1 503 ")
        release.set()
        waiting = socks[2] if readable[0] is socks[1] else socks[1]
        for sock in (socks[0], waiting):
            assert sock.recv(100).startswith(b"HTTP/1.1 200 ")
    finally:
        release.set()
        for sock in socks:
            sock.close()
        server.close()


# --- issue 24: the defects found by hand and by fuzzing, each failing on the hand-written parser ---


def _exchange(port: int, raw: bytes, wait: float = 5.0) -> bytes:
    """Send `raw`, return what the server answers before it closes (or before `wait` seconds pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(raw)
        stream = b""
        try:
            while chunk := sock.recv(65536):
                stream += chunk
        except TimeoutError:
            pass
        return stream


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_ascii_digit_in_content_length_is_answered_400(kind):
    # `Content-Length: ²` passed str.isdigit() and raised in the I/O thread: the connection dropped unanswered.
    path = PATHS[kind].encode()
    raw = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + "²".encode("latin-1") + b"\r\n\r\n"
    with running(kind, timeout=30) as server:
        assert _exchange(server.port, raw).startswith(b"HTTP/1.1 400 ")
        assert get(server.port, PATHS[kind]) == 200


@pytest.mark.parametrize("kind", KINDS)
def test_an_http_0_9_request_line_is_answered_400_at_once(kind):
    # `GET /` (no version, no head to follow) waited for a head that never comes: no answer at all.
    with running(kind, timeout=30) as server:
        answer = _exchange(server.port, b"GET /\r\n", wait=3.0)  # far below the server's 30 s deadline
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:80]


def test_the_control_apps_reason_phrases_reach_the_wire():
    # The server wrote Python's phrase ("Request Entity Too Large"), not the app's ("Content Too Large").
    with running("control") as server:
        body = b"x" * 2_000_000
        head = (
            b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0ken\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head)
            assert sock.recv(100).startswith(b"HTTP/1.1 413 Content Too Large\r\n")


@pytest.mark.parametrize("kind", KINDS)
def test_both_endpoints_are_wsgi_apps_given_a_pep_3333_environ(kind):
    # The metrics server and the control server were near-copies, the control app got a hand-built environ
    # (its input had no readlines nor iteration): now both are WSGI apps on one loop, checked by wsgiref's validator.
    from wsgiref.validate import validator

    from rankscope.serving.exposition import CachedPage, PageRenderer
    from rankscope.serving.metrics_endpoint import _text, metrics_app
    from rankscope.serving.wsgi import serve_app

    if kind == "metrics":
        registry = CollectorRegistry()
        Counter("rankscope_test_events", "events", registry=registry).inc()
        app, error_page = metrics_app(CachedPage(PageRenderer(registry).render, 0)), _text
    else:
        from rankscope.control.endpoint import _json_error

        app, error_page = create_app(AppDeps(ActionQueue(), RunSnapshot(), "t0ken")), _json_error
    served = serve_app(validator(app), "127.0.0.1", [0], name="t", error_page=error_page)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        for _ in range(2):  # twice on one kept-alive connection
            conn.request("GET", PATHS[kind])
            response = conn.getresponse()
            response.read()
            assert response.status == 200
        conn.close()
    finally:
        served.close()


def head_of(path: str, size: int) -> bytes:
    """A complete request head of exactly `size` bytes: one long header fills it."""
    start, end = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Padding: ".encode(), b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def status_of_head(sock: socket.socket, head: bytes) -> int:
    """Send a whole head in one piece and read the answer's status."""
    sock.sendall(head)
    answer = b""
    while b"\r\n" not in answer and (chunk := sock.recv(4096)):
        answer += chunk
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_over_64_kib_is_refused_431_even_when_it_arrives_complete_in_one_piece(kind):
    with running(kind) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            assert status_of_head(sock, head_of(PATHS[kind], 70_000)) == 431
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            assert status_of_head(sock, head_of(PATHS[kind], 65_536)) == 200  # the bound itself is allowed
        assert get(server.port, PATHS[kind]) == 200
