"""Both endpoints over TLS with client certificates and basic auth, configured by an exporter-toolkit web
config file; real sockets and real certificates made by openssl for each test module (devstack/certs.py)."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import ssl
import time
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Counter
from rankscope.control.app import AppDeps, create_app
from rankscope.control.client import ClientTls, session_for
from rankscope.control.endpoint import serve_control
from rankscope.control.state import ActionQueue, RunSnapshot
from rankscope.serving import wsgi
from rankscope.serving.metrics_endpoint import serve_metrics
from rankscope.serving.webconfig import WebConfigError, load_web_config, web_config_for

from devstack.certs import Certs, make_certs, write_web_config

TOKEN = "t0ken"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"), clients=("client", "prometheus"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> Certs:
    """Another CA, with a client certificate of its own: one the server must not trust."""
    return make_certs(tmp_path_factory.mktemp("other"), cn="some other CA")


def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("rankscope_test_events", "events", registry=reg).inc()
    return reg


def client_context(certs: Certs, cert_from: Certs | None = None, name: str = "client") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert_from is not None:
        context.load_cert_chain(cert_from.client_cert(name), cert_from.client_key(name))
    return context


def fetch(port: int, context: ssl.SSLContext, path: str = "/metrics", headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture
def mtls_metrics(certs, tmp_path):
    web = load_web_config(write_web_config(certs, tmp_path / "web.yml"))
    server = serve_metrics(registry(), "127.0.0.1", 0, web=web, timeout=1.0)
    yield server
    server.close()


def test_metrics_over_mtls_serve_a_client_with_a_certificate_of_the_ca(certs, mtls_metrics):
    assert mtls_metrics.url.startswith("https://127.0.0.1:")
    status, page = fetch(mtls_metrics.port, client_context(certs, certs))
    assert status == 200 and b"rankscope_test_events_total 1.0" in page


def test_clients_without_a_certificate_or_with_another_cas_are_refused_at_the_handshake(certs, stranger, mtls_metrics):
    for context in (client_context(certs), client_context(certs, stranger)):
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            fetch(mtls_metrics.port, context)
    # OpenSSL sends its alert inside do_handshake, so the client can see the refusal a moment before the
    # server's I/O thread counts it: wait for the count (CI once read 1 of 2).
    deadline = time.monotonic() + 10
    while mtls_metrics.server.handshake_failures < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mtls_metrics.server.handshake_failures == 2
    assert fetch(mtls_metrics.port, client_context(certs, certs))[0] == 200  # and the server goes on


def test_plain_http_to_the_tls_port_gets_a_400_in_plain_text(certs, mtls_metrics):
    conn = http.client.HTTPConnection("127.0.0.1", mtls_metrics.port, timeout=10)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 400 and b"https" in response.read()


def test_a_stalled_handshake_is_cut_off_at_the_heads_deadline_without_a_thread(certs, mtls_metrics):
    before = len(list(Path("/proc/self/task").iterdir()))
    stalled = [socket.create_connection(("127.0.0.1", mtls_metrics.port), timeout=10) for _ in range(20)]
    try:
        for sock in stalled:
            sock.sendall(b"\x16\x03\x01")  # the start of a ClientHello, and nothing more
        started = time.monotonic()
        for sock in stalled:
            assert sock.recv(100) == b""  # closed by the server
        assert time.monotonic() - started < 5  # the deadline is 1 s
        assert len(list(Path("/proc/self/task").iterdir())) <= before
    finally:
        for sock in stalled:
            sock.close()
    assert fetch(mtls_metrics.port, client_context(certs, certs))[0] == 200


def test_a_certificate_replaced_on_disk_serves_the_next_connection(certs, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(certs.folder, live)
    web = load_web_config(write_web_config(Certs(live), tmp_path / "web.yml", client_auth="NoClientCert"))
    server = serve_metrics(registry(), "127.0.0.1", 0, web=web)
    try:
        assert fetch(server.port, client_context(certs))[0] == 200
        renewed = make_certs(tmp_path / "renewed", clients=(), cn="renewed CA")
        for name in ("server.crt", "server.key"):  # as cert-manager does: new files in place
            shutil.copy(renewed.folder / name, live / name)
        with pytest.raises(ssl.SSLCertVerificationError):
            fetch(server.port, client_context(certs))  # the old CA no longer matches: the new cert is served
        assert fetch(server.port, client_context(renewed))[0] == 200
    finally:
        server.close()


def test_basic_auth_guards_the_page_but_not_the_health_check(certs, tmp_path):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    path = write_web_config(certs, tmp_path / "web.yml", "NoClientCert", f"basic_auth_users:\n  prom: {hashed}\n")
    server = serve_metrics(registry(), "127.0.0.1", 0, web=load_web_config(path))
    try:
        context = client_context(certs)
        assert fetch(server.port, context)[0] == 401
        assert fetch(server.port, context, headers={"Authorization": "Basic cHJvbTp3cm9uZw=="})[0] == 401  # prom:wrong
        right = {"Authorization": "Basic cHJvbTpzM2NyZXQ="}  # prom:s3cret
        assert fetch(server.port, context, headers=right)[0] == 200
        assert fetch(server.port, context, headers=right)[0] == 200  # the second from the verified cache
        assert fetch(server.port, context, "/-/healthy")[0] == 200
    finally:
        server.close()


def test_the_control_endpoint_over_mtls_takes_an_action_only_with_cert_and_token(certs, stranger, tmp_path):
    queue = ActionQueue()
    web = load_web_config(write_web_config(certs, tmp_path / "web.yml"))
    server = serve_control(create_app(AppDeps(queue, RunSnapshot(), TOKEN)), "127.0.0.1", 0, web=web)
    body = json.dumps({"action": "checkpoint", "reason": "tls test"})
    try:
        session = session_for(ClientTls(str(certs.ca), str(certs.client_cert()), str(certs.client_key())), TOKEN)
        assert session.get(f"{server.url}/v1/status", timeout=10).status_code == 200
        for tls in (ClientTls(str(certs.ca)), ClientTls(str(certs.ca), str(stranger.client_cert()),
                                                        str(stranger.client_key()))):  # fmt: skip
            with pytest.raises(Exception, match="(?i)ssl|certificate|handshake|reset|aborted|EOF"):
                session_for(tls, TOKEN).post(f"{server.url}/v1/actions", data=body,
                                             headers={"Content-Type": "application/json"}, timeout=10)  # fmt: skip
        assert queue.snapshot()["pending"] == []  # nothing changed
        answer = session.post(f"{server.url}/v1/actions", data=body, headers={"Content-Type": "application/json"},
                              timeout=10)  # fmt: skip
        assert answer.status_code == 202 and answer.reason == "Accepted"
        assert len(queue.snapshot()["pending"]) == 1
    finally:
        server.close()


@pytest.mark.parametrize(
    ("document", "key"),
    [
        ("tls_server_config:\n  key_file: k\n", "tls_server_config.cert_file"),
        ("tls_server_config:\n  cert_file: c\n  key_file: k\n  client_auth_type: Sometimes\n",
         "tls_server_config.client_auth_type"),
        ("tls_server_config:\n  cert_file: c\n  key_file: k\n  min_version: TLS14\n", "tls_server_config.min_version"),
        ("tls_server_config:\n  cert_file: c\n  key_file: k\n  client_auth_type: RequireAndVerifyClientCert\n",
         "tls_server_config.client_ca_file"),
        ("tls_server_config:\n  cert_file: nowhere.crt\n  key_file: nowhere.key\n", "tls_server_config.cert_file"),
        ("tls_server_config:\n  cert_file: c\n  key_file: k\n  cipher_suites: [RC4]\n",
         "tls_server_config.cipher_suites"),
        ("tls_server_config:\n  cert_fil: c\n", "tls_server_config.cert_fil"),
        ("basic_auth_users:\n  prom: plaintext\n", "basic_auth_users.prom"),
        ("basic_auth_user:\n  prom: x\n", "basic_auth_user"),
        ("tls_server_config: [\n", "not valid YAML"),
    ],
)  # fmt: skip
def test_a_malformed_web_config_fails_the_start_in_one_line_naming_the_key(tmp_path, document, key):
    path = tmp_path / "web.yml"
    path.write_text(document)
    with pytest.raises(WebConfigError) as failure:
        load_web_config(path)
    message = str(failure.value)
    assert key in message and "\n" not in message and str(path) in message, message


def test_a_malformed_web_config_fails_the_monitors_start_in_one_line(tmp_path, monkeypatch):
    from rankscope import Monitor, MonitorConfig, RankIdentity

    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: c\n  key_file: k\n  min_version: SSL3\n")
    monkeypatch.setenv("RANKSCOPE_WEB_CONFIG_FILE", str(path))
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0, probes=()), RankIdentity("t", 0, 0, 1, "n"),
                      device="cpu")  # fmt: skip
    with pytest.raises(WebConfigError, match=r"tls_server_config\.min_version") as failure:
        monitor.start()
    assert "\n" not in str(failure.value)
    monitor.close()


def test_each_endpoint_reads_its_own_variable_before_the_shared_one(certs, tmp_path):
    own = write_web_config(certs, tmp_path / "own.yml")
    env = {"RANKSCOPE_WEB_CONFIG_FILE": "/nonexistent", "RANKSCOPE_CONTROL_WEB_CONFIG_FILE": str(own)}
    assert web_config_for("control", env=env).path == str(own)
    with pytest.raises(WebConfigError, match="/nonexistent"):
        web_config_for("metrics", env=env)
    assert web_config_for("metrics", str(own), env=env).scheme == "https"
    assert web_config_for("metrics", env={}).scheme == "http"


def test_a_plain_endpoint_beyond_loopback_warns_once_per_process(caplog):
    wsgi._warned.clear()
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        servers = [serve_metrics(registry(), "0.0.0.0", 0) for _ in range(3)]
        servers.append(serve_metrics(registry(), "127.0.0.1", 0))
    for server in servers:
        server.close()
    lines = [r.getMessage() for r in caplog.records if "plain HTTP without authentication" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]


def test_rankscope_ctl_reaches_an_mtls_endpoint_with_its_ca_cert_and_key(certs, tmp_path, monkeypatch, capsys):
    from rankscope.cli import main

    web = load_web_config(write_web_config(certs, tmp_path / "web.yml"))
    server = serve_control(create_app(AppDeps(ActionQueue(), RunSnapshot(), TOKEN)), "127.0.0.1", 0, web=web)
    monkeypatch.setenv("RANKSCOPE_CONTROL_TOKEN", TOKEN)
    try:
        assert main(["--url", server.url, "--ca", str(certs.ca), "status"]) == 1  # no client certificate
        capsys.readouterr()
        monkeypatch.setenv("RANKSCOPE_CONTROL_CERT", str(certs.client_cert()))
        monkeypatch.setenv("RANKSCOPE_CONTROL_KEY", str(certs.client_key()))
        assert main(["--url", server.url, "--ca", str(certs.ca), "status"]) == 0
        assert json.loads(capsys.readouterr().out)["run_id"] == "local"
    finally:
        server.close()


def test_a_page_larger_than_the_socket_buffer_arrives_whole_over_tls(certs, tmp_path):
    # The I/O thread begins a cached page without blocking; over TLS a worker must finish it with the same bytes.
    from prometheus_client import Gauge

    reg = CollectorRegistry()
    gauge = Gauge("rankscope_test_wide", "many series", ["i"], registry=reg)
    for i in range(40_000):
        gauge.labels(i=f"{i:08d}" * 4).set(i)
    web = load_web_config(write_web_config(certs, tmp_path / "web.yml"))
    server = serve_metrics(reg, "127.0.0.1", 0, web=web, page_cache_seconds=60)
    try:
        context = client_context(certs, certs)
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=30)
        pages = []
        for _ in range(3):  # rendered by a worker, then twice from the cache on one kept-alive connection
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            pages.append(response.read())
        conn.close()
    finally:
        server.close()
    assert len(pages[0]) > 2_000_000 and pages[0] == pages[1] == pages[2]


@pytest.mark.parametrize("kind", ["metrics", "control"])
def test_a_head_over_64_kib_is_refused_431_over_tls_on_both_endpoints(certs, tmp_path, kind):
    from tests.test_httpd import head_of, status_of_head

    web = load_web_config(write_web_config(certs, tmp_path / "web.yml"))
    if kind == "metrics":
        server, path = serve_metrics(registry(), "127.0.0.1", 0, web=web), "/metrics"
    else:
        app = create_app(AppDeps(ActionQueue(), RunSnapshot(), TOKEN))
        server, path = serve_control(app, "127.0.0.1", 0, web=web), "/healthz"
    context = client_context(certs, certs)
    try:
        for size, status in ((70_000, 431), (65_536, 200)):
            with context.wrap_socket(socket.create_connection(("127.0.0.1", server.port), timeout=10),
                                     server_hostname="127.0.0.1") as sock:  # fmt: skip
                assert status_of_head(sock, head_of(path, size)) == status, size
    finally:
        server.close()
