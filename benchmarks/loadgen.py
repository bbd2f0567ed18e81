"""A scrape load generator: GET a /metrics URL at a fixed rate, switched on and off from stdin.

    python -m benchmarks.loadgen http://127.0.0.1:9400/metrics --rate 20
    python -m benchmarks.loadgen http://127.0.0.1:9400/metrics --rate 200 --hold 3000   # an abusive client

Runs in its own process (as Prometheus would), on a fixed schedule (a late
request does not shift the ones after it), over a fresh connection per
scrape (the costlier case for the server: an accept per scrape). With
`--hold N`, switching on first opens N idle connections that send nothing
and are held until switched off (the server may close them; that is its
defence). After one scrape that
proves the URL works it prints `ready`. Commands on stdin, one per line:
`on` and `off`, each answered with the state once it is in effect (after
`off`, no scrape is in flight any more), also when it changes nothing, and
the starting state is announced the same way. End of stdin (or SIGTERM/SIGINT) stops it; it
then prints one JSON line: scrapes, errors, the most idle connections held,
median and p99 latency in seconds. An https URL is scraped with the client certificate named by
RANKSCOPE_CONTROL_CA/_CERT/_KEY (`use_tls`), each scrape a full handshake; held connections then
stall before their handshake (the slow-handshake abuse).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import resource
import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from .timing import percentile

__all__ = ["main", "scrape_once", "use_tls"]


def use_tls(folder: Path) -> None:
    """Serve /metrics over TLS with client certificates in this process and its children (a throwaway CA
    in `folder`): the monitor reads RANKSCOPE_METRICS_WEB_CONFIG_FILE, the load generators present the
    client certificate named by RANKSCOPE_CONTROL_CA/_CERT/_KEY."""
    from devstack.certs import make_certs, write_web_config

    certs = make_certs(folder)
    os.environ.update(
        RANKSCOPE_METRICS_WEB_CONFIG_FILE=str(write_web_config(certs, folder / "web.yml")),
        RANKSCOPE_CONTROL_CA=str(certs.ca),
        RANKSCOPE_CONTROL_CERT=str(certs.client_cert()),
        RANKSCOPE_CONTROL_KEY=str(certs.client_key()),
    )


def _connection(scheme: str, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
    if scheme != "https":
        return http.client.HTTPConnection(host, port, timeout=timeout)
    global _context
    if _context is None:
        from rankscope.control.client import ClientTls

        _context = ClientTls.from_env().ssl_context()
    return http.client.HTTPSConnection(host, port, timeout=timeout, context=_context)


_context: ssl.SSLContext | None = None


def scrape_once(host: str, port: int, path: str, timeout: float = 5.0, scheme: str = "http") -> int:
    """One GET of the whole page on a fresh connection (over https: a full handshake); the page's size in bytes."""
    connection = _connection(scheme, host, port, timeout)
    try:
        connection.request("GET", path, headers={"Accept": "text/plain"})
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"HTTP {response.status}")
        return len(body)
    finally:
        connection.close()


class Switch:
    """On/off as the command thread last set it; locked because the scrape loop reads it."""

    def __init__(self, on: bool) -> None:
        self.changed = threading.Condition()
        self.wanted = on
        self.commands = 1  # the initial state counts as a command: it is acknowledged too
        self.stopped = False

    def set(self, on: bool | None = None, stop: bool = False) -> None:
        with self.changed:
            if on is not None:
                self.wanted = on
                self.commands += 1
            self.stopped = self.stopped or stop
            self.changed.notify_all()


def hold_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` open connections that say nothing (as many as the open-files limit allows)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            break  # out of descriptors or refused: hold what we have
    return held


def release(held: list[socket.socket]) -> None:
    for sock in held:
        with contextlib.suppress(OSError):
            sock.close()
    held.clear()


def _read_commands(switch: Switch) -> None:
    for line in sys.stdin:
        command = line.strip()
        if command in ("on", "off"):
            switch.set(on=command == "on")
        elif command:
            print(f"error: unknown command {command!r} (on, off)", flush=True)
    switch.set(stop=True)  # stdin closed: the parent is done (or gone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the /metrics URL to scrape (loopback)")
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes per second while on (0: only --hold)")
    parser.add_argument("--off", action="store_true", help="start switched off (wait for `on`)")
    parser.add_argument("--hold", type=int, default=0, help="idle connections to open and hold while on")
    args = parser.parse_args(argv)
    if args.rate < 0 or args.hold < 0 or args.rate == 0 and not args.hold:
        parser.error(f"--rate must be > 0 (or 0 with --hold) and --hold >= 0, got {args.rate} and {args.hold}")
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        parser.error(f"url must look like http(s)://HOST:PORT/metrics, got {args.url!r}")
    host, port, path, scheme = parts.hostname, parts.port, parts.path or "/metrics", parts.scheme
    try:
        scrape_once(host, port, path, scheme=scheme)
    except OSError as exc:
        print(f"error: cannot scrape {args.url}: {exc}", flush=True)
        return 1
    print("ready", flush=True)

    switch = Switch(on=not args.off)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: switch.set(stop=True))
    threading.Thread(target=_read_commands, args=(switch,), daemon=True).start()
    latencies: list[float] = []
    errors = 0
    interval = 1.0 / args.rate if args.rate else 0.0
    acknowledged = 0  # commands answered so far: every command is, even one that changes nothing
    on = False
    held: list[socket.socket] = []
    most_held = 0
    next_at = time.monotonic()
    while True:
        with switch.changed:
            if switch.stopped:
                break
            if switch.commands != acknowledged:
                acknowledged, was_on, on = switch.commands, on, switch.wanted
                if on and not was_on and args.hold:
                    held = hold_connections(host, port, args.hold)
                    most_held = max(most_held, len(held))
                elif was_on and not on:
                    release(held)
                print("on" if on else "off", flush=True)  # no scrape is in flight here
                if on and not was_on:
                    next_at = time.monotonic()
            if not on or not args.rate:
                switch.changed.wait()  # until a command arrives
                continue
            remaining = next_at - time.monotonic()
            if remaining > 0:
                switch.changed.wait(remaining)  # the schedule's pause, cut short by a command
                continue  # look at the switch and the clock again
        started = time.perf_counter()
        try:
            scrape_once(host, port, path, scheme=scheme)
            latencies.append(time.perf_counter() - started)
        except OSError:
            errors += 1
        next_at += interval
    release(held)
    summary = {
        "scrapes": len(latencies),
        "errors": errors,
        "held": most_held,
        "median_seconds": percentile(latencies, 50),
        "p99_seconds": percentile(latencies, 99),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
