"""A small HTTP/1.1 server for a rank's endpoints that stays cheap under abuse; h11 parses and frames.

    sock = listen("0.0.0.0", 9400)                                  # close-on-exec, closed in forked children
    server = HttpServer(sock, handler, error_page, name="rankscope-metrics", tls=web.tls)
    ...
    server.close()

Shape: one I/O thread reads every connection (selectors, non-blocking), and a fixed pool of
worker threads runs the handler. An idle or slow client costs a file descriptor, never a thread,
so the process's thread count is fixed however many connections are open. A server may also have
a `fast` handler, which the I/O thread asks first: what it answers (a cached page, a refusal) is
sent from the I/O thread without waking a worker, which halves what a scrape costs the process.

Every byte of a request is parsed by h11 (one `h11.Connection` per connection); this module only
adds the bounds below, and answers what h11 refuses with the status h11 suggests.

- **Time.** The TLS handshake (if any) and the request's head must arrive complete within `timeout`
  seconds of the connection being accepted (or of the previous response, on a kept-alive
  connection); a kept-alive connection that stays idle that long is closed, a half-sent head is
  answered 408, a half-done handshake is cut. A body gets `timeout` seconds from the moment a
  worker takes the request (`Body.timed_out` tells the handler it ran out).
- **Work.** Complete requests wait for a worker in a queue of `queue_size`; when it is full the
  request is answered 503 at once, never queued without limit.
- **Connections.** At most `max_connections` are open. A new one past the limit closes the oldest
  connection that is waiting for its request (or its handshake), so a flood of idle connections can
  neither lock a scraper out nor use up the training process's file descriptors.
- **Size.** A request line over 8 KiB is refused (414), a head over 64 KiB or more than 100 header
  lines too (431). A request line that is not `METHOD target HTTP/1.x` (HTTP/0.9's `GET /`, say) is
  answered 400 as soon as its line ends, not when a head that will never come times out.

TLS: the handshake runs in the I/O thread, non-blocking, under the head's deadline, so a client that
opens a handshake and stalls costs what an idle connection costs (no worker waits on it). A client
that speaks plain HTTP to a TLS port is answered a plain-text 400, as Go's servers do. The context
comes from `tls.context()` per connection, so certificates replaced on disk serve the next connection.

Sockets are not inherited: Python opens them close-on-exec (so an exec'd child never holds them),
and right after a fork the child closes its copies of every live server's sockets
(`os.register_at_fork`), without shutting them down, so the parent keeps serving. That matters
for DataLoader workers, which are forked from the rank and outlive it by seconds: a restarted rank
could not bind its port while one held it.
"""

from __future__ import annotations

import collections
import contextlib
import email.utils
import errno
import logging
import os
import queue
import re
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

import h11

__all__ = ["Body", "Handler", "HttpServer", "Request", "Response", "listen"]

logger = logging.getLogger("rankscope")

MAX_HEAD_BYTES = 65536
MAX_REQUEST_LINE = 8192
MAX_HEADERS = 100
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [^\x00-\x20\x7f]+ HTTP/(?P<version>[0-9]\.[0-9])\r?")
_LISTENER, _WAKER = object(), object()
_HANDSHAKE, _WAITING, _BUSY, _LINGERING = "handshake", "waiting", "busy", "lingering"
#: After a refusal or a `Connection: close` answer, what the client still sends is read and dropped
#: for this long (so its unread bytes do not turn our answer into a connection reset).
_LINGER_SECONDS = 2.0
_TLS_RECORD = 0x16  # the first byte of a TLS handshake record


class TlsSource(Protocol):
    def context(self) -> ssl.SSLContext: ...


@dataclass
class Request:
    """A parsed request head. Header names are lower-cased; repeated headers are joined with ", "."""

    method: str
    target: str
    version: str
    headers: dict[str, str]
    client: tuple[str, int]
    tls: bool = False
    peer_cert: dict[str, Any] | None = None
    """The client's verified certificate (ssl.getpeercert()), when it sent one."""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""

    @property
    def has_body(self) -> bool:
        return "transfer-encoding" in self.headers or self.headers.get("content-length", "0") != "0"


@dataclass
class Response:
    """What a handler answers. Content-Length and Date are added when sending."""

    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    close: bool = False
    """Close the connection after this response."""
    reason: str = ""
    """The reason phrase; "" takes the standard one for the status."""


Handler = Callable[[Request, "Body"], Response]
ErrorPage = Callable[[int, str], Response]


class _Conn:
    __slots__ = (
        "sock", "client", "h11", "line", "line_ok", "fed", "deadline", "state", "registered", "nodelay", "tls",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, client: tuple[str, int], tls: bool) -> None:
        self.sock, self.client, self.tls = sock, client, tls
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.line = bytearray()  # the current request's bytes until its first line ends (checked early)
        self.line_ok = False
        self.fed = 0  # bytes given to h11 since the current request began: bounds its head (see _head_too_long)
        self.deadline = 0.0
        self.state = _HANDSHAKE if tls else _WAITING
        self.registered = False
        self.nodelay = False

    def feed(self, data: bytes) -> None:
        if not self.line_ok and len(self.line) <= MAX_REQUEST_LINE + 2:
            self.line += data[: MAX_REQUEST_LINE + 3 - len(self.line)]
        self.fed += len(data)
        self.h11.receive_data(data)

    def head_too_long(self) -> bool:
        """Whether the request head h11 has just parsed is over MAX_HEAD_BYTES. h11's own bound
        (max_incomplete_event_size) holds only while a head is incomplete: a longer one that arrives whole in
        one read passes it. The head is what was fed less what h11 left unparsed (its body, the next request)."""
        return self.fed > MAX_HEAD_BYTES and self.fed - len(self.h11.trailing_data[0]) > MAX_HEAD_BYTES


class Body:
    """A request's body as the handler reads it, from its worker thread: what h11 frames (Content-Length
    or chunked), and only until the deadline. A file-like `read(size)` (WSGI's input)."""

    def __init__(self, conn: _Conn, length: int | None, deadline: float) -> None:
        self._conn = conn
        self.length = length
        """The declared Content-Length (None for a chunked body)."""
        self.received = 0
        self.timed_out = False
        self._deadline = deadline
        self._pending = bytearray()
        self._done = conn.h11.their_state is not h11.SEND_BODY

    @property
    def complete(self) -> bool:
        return self._done and not self._pending

    def read(self, size: int | None = -1) -> bytes:
        want = -1 if size is None or size < 0 else size
        while (want < 0 or len(self._pending) < want) and not self._done:
            self._next()
        cut = len(self._pending) if want < 0 else min(want, len(self._pending))
        chunk = bytes(self._pending[:cut])
        del self._pending[:cut]
        return chunk

    def readline(self, size: int | None = -1) -> bytes:
        line = bytearray()
        while size is None or size < 0 or len(line) < size:
            byte = self.read(1)
            if not byte:
                break
            line += byte
            if byte == b"\n":
                break
        return bytes(line)

    def readlines(self, hint: int = -1) -> list[bytes]:
        lines: list[bytes] = []
        while line := self.readline():
            lines.append(line)
            if 0 < hint <= sum(map(len, lines)):
                break
        return lines

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def _next(self) -> None:
        connection = self._conn.h11
        try:
            event = connection.next_event()
        except h11.RemoteProtocolError:
            self._done = True  # a broken body: short, and the connection closes after the answer
            return
        if event is h11.NEED_DATA:
            if connection.they_are_waiting_for_100_continue:
                self._send(connection.send(h11.InformationalResponse(status_code=100, headers=[])))
            connection.receive_data(self._recv())
        elif isinstance(event, h11.Data):
            self._pending += event.data
            self.received += len(event.data)
        else:  # EndOfMessage, ConnectionClosed
            self._done = True

    def _send(self, data: bytes | None) -> None:
        with contextlib.suppress(OSError):
            self._conn.sock.settimeout(max(0.001, self._deadline - time.monotonic()))
            self._conn.sock.sendall(data or b"")

    def _recv(self) -> bytes:
        sock = self._conn.sock
        try:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                self._done = True
                return b""
            sock.settimeout(left)
            return sock.recv(65536)
        except TimeoutError:
            self.timed_out = True
        except OSError:
            pass  # the client went away: a short body
        self._done = True
        return b""


def listen(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on host:port (a name, IPv4 or IPv6 address); port 0 picks a free port.

    Raises OSError with the errno of the failure (EADDRINUSE when the port is taken)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)  # close-on-exec, as every socket Python opens
    try:
        # A restarted rank may bind while its old connections sit in TIME_WAIT (never while one listens).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    """The Date header's value, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


def _reason(response: Response) -> str:
    if response.reason:
        return response.reason
    try:
        return HTTPStatus(response.status).phrase
    except ValueError:
        return "Unknown"


def _head_fields(response: Response, close: bool) -> list[tuple[str, str]]:
    headers = [(k, v) for k, v in response.headers if k.lower() not in ("content-length", "date", "connection")]
    headers += [("Content-Length", str(len(response.body))), ("Date", _date())]
    return headers + [("Connection", "close")] if close else headers


def _encode(connection: h11.Connection, response: Response, head_only: bool, close: bool) -> bytes:
    """The whole answer, framed by h11 (which also decides keep-alive from the request and ours)."""
    event = h11.Response(status_code=response.status, headers=_head_fields(response, close), reason=_reason(response))
    data = connection.send(event) or b""
    if not head_only and response.body:
        data += connection.send(h11.Data(data=response.body)) or b""
    return data + (connection.send(h11.EndOfMessage()) or b"")


def _raw(response: Response) -> bytes:
    """A closing answer to a request h11 refused (so h11 cannot frame it): ours alone, always well-formed."""
    lines = [f"HTTP/1.1 {response.status} {_reason(response)}"]
    lines += [f"{name}: {value}" for name, value in _head_fields(response, close=True)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body


class HttpServer:
    """Serves `handler` on a listening socket until `close()`; see the module docstring."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        error_page: ErrorPage,
        *,
        name: str,
        fast: Callable[[Request], Response | None] | None = None,
        workers: int = 2,
        queue_size: int = 8,
        max_connections: int = 64,
        timeout: float = 5.0,
        tls: TlsSource | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._sock = sock
        self._handler, self._error_page, self._fast = handler, error_page, fast
        self._timeout = timeout
        self._max_connections = max_connections
        self._tls = tls
        self.name = name
        self._pid = os.getpid()
        sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKER)
        # Deadlines are "now + a constant", so insertion order is deadline order: the oldest is first.
        self._waiting: collections.OrderedDict[_Conn, None] = collections.OrderedDict()
        self._lingering: collections.OrderedDict[_Conn, None] = collections.OrderedDict()
        self._conns: set[_Conn] = set()
        self._accept_paused_until: float | None = None
        self._queue: queue.Queue[tuple[_Conn, Request, tuple[bytes, bool] | None] | None] = queue.Queue(
            maxsize=queue_size
        )
        self._returned: collections.deque[tuple[_Conn, bool]] = collections.deque()
        self._handback = threading.Lock()
        self._loop_done = False
        self._closing = False
        self.handshake_failures = 0
        """TLS handshakes refused or cut off (a wrong certificate, plain HTTP, a stalled client)."""
        _LIVE.add(self)
        self._io = threading.Thread(target=self._run, name=name, daemon=True)
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}-worker-{i}", daemon=True) for i in range(workers)
        ]
        for thread in (self._io, *self._workers):
            thread.start()

    @property
    def address(self) -> tuple:
        return self._sock.getsockname()

    @property
    def threads(self) -> int:
        """Threads this server runs (fixed: the I/O thread and the workers)."""
        return 1 + len(self._workers)

    def close(self) -> None:
        """Stop serving and free the port; idempotent. In a forked child, a no-op (its copies are closed)."""
        if os.getpid() != self._pid or self._closing:
            return
        self._closing = True
        self._wake()
        self._io.join(timeout=5)
        for _ in self._workers:
            try:
                self._queue.put(None, timeout=5)
            except queue.Full:
                break
        for thread in self._workers:
            thread.join(timeout=5)
        _LIVE.discard(self)

    # --- the I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                for key, _ in self._selector.select(self._wait_time()):
                    try:
                        if key.data is _LISTENER:
                            self._accept()
                        elif key.data is _WAKER:
                            self._take_back()
                        else:
                            self._readable(key.data)
                    except Exception:  # one bad connection must not stop the server
                        logger.debug("rankscope: %s: connection failed", self.name, exc_info=True)
                        if isinstance(key.data, _Conn):
                            self._drop(key.data)
                self._expire()
        except Exception:
            logger.exception("rankscope: %s stopped serving", self.name)
        finally:
            self._shut_down()

    def _wait_time(self) -> float | None:
        deadlines = [next(iter(d)).deadline for d in (self._waiting, self._lingering) if d]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self) -> None:
        for _ in range(64):  # then let the other connections have their turn
            try:
                sock, client = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors (ours or the process's): free one, or stop accepting a moment.
                    if not self._evict():
                        self._selector.unregister(self._sock)
                        self._accept_paused_until = time.monotonic() + 0.1
                    return
                raise
            if len(self._conns) >= self._max_connections:
                self._evict()
            sock.setblocking(False)
            conn = _Conn(sock, client, self._tls is not None)
            self._conns.add(conn)
            self._wait(conn, conn.state)

    def _evict(self) -> bool:
        """Close the connection that matters least: a lingering one, else the longest-waiting one."""
        for pool in (self._lingering, self._waiting):
            if pool:
                self._drop(next(iter(pool)))
                return True
        return False

    def _register(self, conn: _Conn, events: int = selectors.EVENT_READ) -> None:
        if not conn.registered:
            self._selector.register(conn.sock, events, conn)
            conn.registered = True
        elif self._selector.get_key(conn.sock).events != events:
            self._selector.modify(conn.sock, events, conn)

    def _unregister(self, conn: _Conn) -> None:
        if conn.registered:
            self._selector.unregister(conn.sock)
            conn.registered = False

    def _wait(self, conn: _Conn, state: str = _WAITING) -> None:
        """The connection waits for its handshake or its next request, under a new deadline."""
        if state is _WAITING and conn.h11.our_state is h11.DONE:
            conn.h11.start_next_cycle()  # only when both sides are done: the caller checked
            rest = conn.h11.trailing_data[0]  # what the client sent after the last request: the next one's start
            conn.line, conn.fed = bytearray(rest[: MAX_REQUEST_LINE + 3]), len(rest)
            conn.line_ok = False
        conn.state, conn.deadline = state, time.monotonic() + self._timeout
        self._waiting.pop(conn, None)
        self._waiting[conn] = None
        self._register(conn)

    def _linger(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        try:
            conn.sock.shutdown(socket.SHUT_WR)  # on TLS, also drops the session: what follows is discarded raw
        except OSError:
            self._drop(conn)
            return
        conn.state, conn.deadline = _LINGERING, time.monotonic() + min(self._timeout, _LINGER_SECONDS)
        self._lingering[conn] = None
        self._register(conn)

    def _drop(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        self._lingering.pop(conn, None)
        self._conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._unregister(conn)
        conn.sock.close()

    def _readable(self, conn: _Conn) -> None:
        if conn.state is _HANDSHAKE:
            if not self._handshake(conn):
                return
        elif conn.state is _LINGERING:
            self._discard_input(conn)
            return
        while conn.state is _WAITING:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError:  # ssl.SSLError included: a broken record
                self._drop(conn)
                return
            if not data:
                self._drop(conn)
                return
            conn.feed(data)
            if not _pending(conn.sock):  # TLS may hold decrypted bytes select() cannot see
                break
        self._dispatch(conn)

    def _discard_input(self, conn: _Conn) -> None:
        try:
            if not conn.sock.recv(65536):
                self._drop(conn)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except OSError:
            self._drop(conn)

    def _handshake(self, conn: _Conn) -> bool:
        """Advance a TLS handshake without blocking; whether the connection is ready for its request."""
        assert self._tls is not None
        if not isinstance(conn.sock, ssl.SSLSocket):
            try:
                first = conn.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                self._drop(conn)
                return False
            if not first:
                self._drop(conn)
                return False
            if first[0] != _TLS_RECORD:  # plain HTTP (or anything else) on the TLS port
                self.handshake_failures += 1
                self._refuse(conn, 400, "this port speaks TLS: use https://")
                return False
            self._unregister(conn)
            # The handshake and TLS 1.3's session tickets are several small writes: without NODELAY, Nagle
            # holds each behind the client's delayed ACK (40 ms a scrape, measured).
            _no_delay(conn)
            try:
                conn.sock = self._tls.context().wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as exc:
                logger.warning("rankscope: %s: no TLS context: %s", self.name, exc)
                conn.sock.close()
                self._drop(conn)
                return False
            self._register(conn)
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._register(conn, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            self._register(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
            return False
        except (ssl.SSLError, OSError) as exc:  # no certificate, another CA's, a protocol we refuse
            self.handshake_failures += 1
            logger.debug("rankscope: %s: TLS handshake with %s failed: %s", self.name, conn.client, exc)
            self._drop(conn)
            return False
        self._register(conn, selectors.EVENT_READ)
        conn.state = _WAITING  # the deadline set at accept still holds: handshake and head share it
        return True

    def _dispatch(self, conn: _Conn) -> None:
        """Handle every complete request h11 has (a client may pipeline several): inline when `fast`
        answers it, else through a worker (then the rest waits until the worker is done)."""
        while conn.state is _WAITING:
            request = self._next_request(conn)
            if request is None:
                return
            response = None
            if self._fast is not None and conn.h11.their_state is h11.DONE:
                response = self._fast(request)
            if response is not None:
                self._answer_inline(conn, request, response)
                continue
            self._waiting.pop(conn, None)
            self._unregister(conn)
            conn.state = _BUSY
            try:
                self._queue.put_nowait((conn, request, None))
            except queue.Full:
                self._refuse(conn, 503, "too many requests at once; retry")

    def _check_line(self, conn: _Conn) -> bool:
        """Whether the request line is complete and well-formed; refuses (and returns False) when it
        is not: a line that is not `METHOD target HTTP/1.x` is answered once it ends, not at the deadline."""
        if conn.line_ok:
            return True
        end = conn.line.find(b"\n")
        if (end < 0 and len(conn.line) > MAX_REQUEST_LINE + 1) or end > MAX_REQUEST_LINE + 1:
            self._refuse(conn, 414, f"request line longer than {MAX_REQUEST_LINE} bytes")
            return False
        if end < 0:
            return False
        match = _REQUEST_LINE.fullmatch(conn.line, 0, end)
        if match is None:
            self._refuse(conn, 400, "malformed request line; send 'METHOD /path HTTP/1.1' (HTTP/0.9 is not spoken)")
            return False
        if match["version"] not in (b"1.0", b"1.1"):
            self._refuse(conn, 400, f"unsupported HTTP version {match['version'].decode()}; use HTTP/1.1")
            return False
        conn.line_ok, conn.line = True, bytearray()
        return True

    def _next_request(self, conn: _Conn) -> Request | None:
        """The next complete request head, parsed (and its body, when it has none, read); None while
        incomplete or when refused."""
        if not self._check_line(conn):
            return None
        try:
            event = conn.h11.next_event()
            if isinstance(event, h11.Request) and conn.head_too_long():
                self._refuse(conn, 431, f"request head longer than {MAX_HEAD_BYTES} bytes")
                return None
            if isinstance(event, h11.Request) and not _declares_body(event):
                conn.h11.next_event()  # its EndOfMessage: the request is complete
        except h11.RemoteProtocolError as exc:
            self._refuse(conn, exc.error_status_hint, f"bad request: {exc}")
            return None
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return None
        if not isinstance(event, h11.Request):  # ConnectionClosed: the client half-closed
            self._linger(conn)
            return None
        if len(event.headers) > MAX_HEADERS:
            self._refuse(conn, 431, f"more than {MAX_HEADERS} header lines")
            return None
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        peer = conn.sock.getpeercert() if isinstance(conn.sock, ssl.SSLSocket) else None
        return Request(
            event.method.decode("latin-1"),
            event.target.decode("latin-1"),
            "HTTP/" + event.http_version.decode("latin-1"),
            headers,
            conn.client,
            conn.tls,
            peer or None,
        )

    def _answer_inline(self, conn: _Conn, request: Request, response: Response) -> None:
        """Send from the I/O thread without blocking; what the socket does not take at once, a worker sends."""
        data = _encode(conn.h11, response, request.method == "HEAD", response.close or self._closing)
        keep = conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE
        _no_delay(conn)
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0  # TLS: the worker retries with the same bytes, as OpenSSL wants
        except OSError:
            self._drop(conn)
            return
        self._waiting.pop(conn, None)
        if sent < len(data):
            self._unregister(conn)
            conn.state = _BUSY
            try:
                self._queue.put_nowait((conn, request, (data[sent:], keep)))
            except queue.Full:
                self._drop(conn)
        elif keep:
            self._wait(conn)  # the next request's deadline starts now
        else:
            self._linger(conn)

    def _refuse(self, conn: _Conn, status: int, message: str) -> None:
        """Answer from the I/O thread (best effort, never blocking), then close gracefully."""
        response = self._error_page(status, message)
        try:
            conn.sock.send(_raw(response))
        except (OSError, ssl.SSLError):
            self._drop(conn)
            return
        self._linger(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting:
            conn = next(iter(self._waiting))
            if conn.deadline > now:
                break
            if conn.state is _HANDSHAKE:
                self.handshake_failures += 1
                self._drop(conn)  # a handshake that did not finish in time: nothing can be said
            elif conn.line or conn.h11.trailing_data[0]:  # part of a request came, the rest did not
                self._refuse(conn, 408, f"request not complete within {self._timeout:g} s")
            else:
                self._drop(conn)  # idle: nothing to answer
        while self._lingering:
            conn = next(iter(self._lingering))
            if conn.deadline > now:
                break
            self._drop(conn)
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._sock, selectors.EVENT_READ, _LISTENER)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # already full (a wake-up is pending) or closed
            self._wake_w.send(b"x")

    def _take_back(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._returned:
            conn, keep = self._returned.popleft()
            if keep:
                self._wait(conn)
                if _pending(conn.sock):
                    self._readable(conn)  # decrypted bytes a worker left in the TLS buffer
                else:
                    self._dispatch(conn)  # a pipelined request may be here already
            else:
                self._linger(conn)

    def _shut_down(self) -> None:
        with self._handback:
            self._loop_done = True
        self._selector.close()
        self._sock.close()
        for conn in list(self._conns):
            if conn.state is _BUSY:
                with contextlib.suppress(OSError):  # wakes the worker blocked on it; the worker closes it
                    conn.sock.shutdown(socket.SHUT_RDWR)
            else:
                conn.sock.close()
        while self._returned:
            self._returned.popleft()[0].sock.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the workers --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            conn, request, unsent = item
            if self._closing:
                self._hand_back(conn, keep=False)
                continue
            try:
                if unsent is None:
                    keep = self._serve(conn, request)
                else:  # the rest of an answer the I/O thread began
                    data, keep = unsent
                    conn.sock.settimeout(self._timeout)
                    conn.sock.sendall(data)
            except Exception:
                logger.debug("rankscope: %s: serving %s failed", self.name, conn.client, exc_info=True)
                keep = False
            self._hand_back(conn, keep)

    def _serve(self, conn: _Conn, request: Request) -> bool:
        """Runs the handler and sends its answer; whether the connection stays open."""
        raw = request.headers.get("content-length")
        body = Body(conn, int(raw) if raw is not None else None, time.monotonic() + self._timeout)
        try:
            response = self._handler(request, body)
        except Exception:
            logger.exception("rankscope: %s: handler failed on %s %s", self.name, request.method, request.path)
            response = self._error_page(500, "internal error; see the process's log")
        close = response.close or self._closing or not body.complete
        _no_delay(conn)
        conn.sock.settimeout(self._timeout)  # a client that does not read its answer is given up on
        if conn.h11.our_state is h11.SEND_RESPONSE:
            data = _encode(conn.h11, response, request.method == "HEAD", close)
        else:  # h11 refused the body mid-way (their side is in ERROR): a closing answer of our own
            data, close = _raw(response), True
        conn.sock.sendall(data)
        return not close and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE

    def _hand_back(self, conn: _Conn, keep: bool) -> None:
        try:
            conn.sock.setblocking(False)
        except OSError:
            keep = False
        with self._handback:
            if not self._loop_done:
                self._returned.append((conn, keep))
                self._wake()
                return
        conn.sock.close()  # the I/O thread is gone: nobody else will


def _no_delay(conn: _Conn) -> None:
    """An answer is one write (over TLS, a few records): send it now. Set when a connection first has
    something to say, not on accept: most of a flood never gets this far."""
    if not conn.nodelay and conn.sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.nodelay = True


def _pending(sock: socket.socket) -> bool:
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


def _declares_body(event: h11.Request) -> bool:
    for name, value in event.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


# Every live server in this process, so that a forked child can close its copies of their sockets.
_LIVE: set[HttpServer] = set()


def _close_in_child() -> None:
    """After fork, in the child: close the inherited sockets of every server, without shutting
    them down (a shutdown would act on the parent's connections too). The child runs none of the
    server's threads, so nothing else touches them. The selector is closed, never unregistered
    from: its epoll instance is shared with the parent."""
    for server in list(_LIVE):
        server._closing = True
        sockets = [server._sock, server._wake_r, server._wake_w, *(c.sock for c in list(server._conns))]
        sockets += [conn.sock for conn, _ in list(server._returned)]
        for sock in sockets:
            with contextlib.suppress(OSError):
                socket.socket.close(sock)  # never an SSL close_notify: the parent owns the session
        with contextlib.suppress(Exception):  # best effort: the child must go on whatever happens here
            server._selector.close()
    _LIVE.clear()


os.register_at_fork(after_in_child=_close_in_child)
