"""A small HTTP/1.1 server for a rank's endpoints that stays cheap under abuse.

    sock = listen("0.0.0.0", 9400)                                  # close-on-exec, closed in forked children
    server = HttpServer(sock, handler, error_page, name="rankscope-metrics")
    ...
    server.close()

Shape: one I/O thread reads every connection (selectors, non-blocking), and a fixed pool of
worker threads runs the handler. An idle or slow client costs a file descriptor, never a thread,
so the process's thread count is fixed however many connections are open. A server may also have
a `fast` handler, which the I/O thread asks first: what it answers (a cached page, a refusal) is
sent from the I/O thread without waking a worker, which halves what a scrape costs the process.
Bounds:

- **Time.** A request's head must arrive complete within `timeout` seconds of its connection being
  accepted (or of the previous response, on a kept-alive connection); a kept-alive connection that
  stays idle that long is closed, a half-sent head is answered 408. A body gets `timeout` seconds
  from the moment a worker takes the request (`Body.timed_out` tells the handler it ran out).
- **Work.** Complete requests wait for a worker in a queue of `queue_size`; when it is full the
  request is answered 503 at once, never queued without limit.
- **Connections.** At most `max_connections` are open. A new one past the limit closes the oldest
  connection that is waiting for its request, so a flood of idle connections can neither lock a
  scraper out nor use up the training process's file descriptors.
- **Size.** A request line over 8 KiB is refused (414), a head over 64 KiB or more than 100 header
  lines too (431).

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

__all__ = ["Body", "Handler", "HttpServer", "Request", "Response", "listen"]

logger = logging.getLogger("rankscope")

MAX_HEAD_BYTES = 65536
MAX_REQUEST_LINE = 8192
MAX_HEADERS = 100
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSIONS = ("HTTP/1.0", "HTTP/1.1")
_LISTENER, _WAKER = object(), object()
_WAITING, _BUSY, _LINGERING = "waiting", "busy", "lingering"
#: After a refusal or a `Connection: close` answer, what the client still sends is read and dropped
#: for this long (so its unread bytes do not turn our answer into a connection reset).
_LINGER_SECONDS = 2.0


@dataclass
class Request:
    """A parsed request head. Header names are lower-cased; repeated headers are joined with ", "."""

    method: str
    target: str
    version: str
    headers: dict[str, str]
    client: tuple[str, int]

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        return self.version == "HTTP/1.1" and "close" not in tokens


@dataclass
class Response:
    """What a handler answers. Content-Length and Date are added when sending."""

    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    close: bool = False
    """Close the connection after this response."""


Handler = Callable[[Request, "Body"], Response]
ErrorPage = Callable[[int, str], Response]


class _Conn:
    __slots__ = ("sock", "client", "buffer", "scanned", "deadline", "state", "registered", "nodelay")

    def __init__(self, sock: socket.socket, client: tuple[str, int]) -> None:
        self.sock, self.client = sock, client
        self.buffer = bytearray()
        self.scanned = 0  # bytes of `buffer` known to hold no end of head (a dribbling client costs O(n))
        self.deadline = 0.0
        self.state = _WAITING
        self.registered = False
        self.nodelay = False


class Body:
    """A request's body as the handler reads it, from its worker thread: never more than the
    declared Content-Length, and only until the deadline. A file-like `read(size)` (WSGI's input)."""

    def __init__(self, conn: _Conn, length: int, deadline: float, expect_continue: bool = False) -> None:
        self._conn = conn
        self.length = length
        self.received = 0
        self.timed_out = False
        self._deadline = deadline
        self._expect_continue = expect_continue

    @property
    def complete(self) -> bool:
        return self.received == self.length

    def read(self, size: int | None = -1) -> bytes:
        want = self.length - self.received if size is None or size < 0 else min(size, self.length - self.received)
        chunks = []
        buffer = self._conn.buffer
        while want > 0:
            if buffer:
                chunk = bytes(buffer[:want])
                del buffer[:want]
            else:
                chunk = self._recv(want)
                if not chunk:
                    break
            chunks.append(chunk)
            want -= len(chunk)
            self.received += len(chunk)
        return b"".join(chunks)

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

    def _recv(self, want: int) -> bytes:
        sock = self._conn.sock
        try:
            if self._expect_continue:  # the client waits for this before it sends the body
                self._expect_continue = False
                sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            left = self._deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                return b""
            sock.settimeout(left)
            return sock.recv(min(want, 65536))
        except TimeoutError:
            self.timed_out = True
        except OSError:
            pass  # the client went away: a short body
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


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _parse_head(head: bytes, client: tuple[str, int]) -> Request:
    text = head.decode("latin-1")
    lines = text.split("\n")
    parts = lines[0].rstrip("\r").split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]:
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in _VERSIONS:
        raise _BadRequest(400, f"unsupported HTTP version {version[:20]!r}; use HTTP/1.1")
    if len(lines) - 1 > MAX_HEADERS:
        raise _BadRequest(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.rstrip("\r").partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise _BadRequest(400, "malformed header line")
        key, value = name.lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return Request(method, target, version, headers, client)


def _body_length(request: Request) -> tuple[int, bool]:
    """(bytes of body to expect, whether the connection must close after the answer)."""
    if "transfer-encoding" in request.headers:
        return 0, True  # chunked request bodies are not supported: the handler sees no length
    raw = request.headers.get("content-length")
    if raw is None:
        return 0, False
    values = {v.strip() for v in raw.split(",")}
    if len(values) != 1 or not next(iter(values)).isdigit():
        return 0, True  # the handler sees the raw header and refuses it; the stream is unframed
    return int(values.pop()), False


_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    """The Date header's value, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


def _serialize(response: Response, head_only: bool, keep_alive: bool) -> bytes:
    try:
        reason = HTTPStatus(response.status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {response.status} {reason}"]
    names = set()
    for name, value in response.headers:
        names.add(name.lower())
        lines.append(f"{name}: {value}")
    if "content-length" not in names:
        lines.append(f"Content-Length: {len(response.body)}")
    lines.append(f"Date: {_date()}")
    if not keep_alive:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body


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
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._sock = sock
        self._handler, self._error_page, self._fast = handler, error_page, fast
        self._timeout = timeout
        self._max_connections = max_connections
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
            conn = _Conn(sock, client)
            self._conns.add(conn)
            self._wait(conn)

    def _evict(self) -> bool:
        """Close the connection that matters least: a lingering one, else the longest-waiting one."""
        for pool in (self._lingering, self._waiting):
            if pool:
                self._drop(next(iter(pool)))
                return True
        return False

    def _register(self, conn: _Conn) -> None:
        if not conn.registered:
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            conn.registered = True

    def _unregister(self, conn: _Conn) -> None:
        if conn.registered:
            self._selector.unregister(conn.sock)
            conn.registered = False

    def _wait(self, conn: _Conn) -> None:
        conn.state, conn.deadline = _WAITING, time.monotonic() + self._timeout
        self._waiting[conn] = None
        self._register(conn)

    def _linger(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn)
            return
        conn.state, conn.deadline = _LINGERING, time.monotonic() + min(self._timeout, _LINGER_SECONDS)
        conn.buffer.clear()
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
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
        elif conn.state is _WAITING:
            conn.buffer += data
            self._dispatch(conn)
        # _LINGERING: what the client still sends is dropped

    def _dispatch(self, conn: _Conn) -> None:
        """Handle every complete request in the buffer (a client may pipeline several): inline when
        `fast` answers it, else through a worker (then the rest waits until the worker is done)."""
        while conn.state is _WAITING and conn.buffer:
            request = self._next_request(conn)
            if request is None:
                return
            response = self._fast(request) if self._fast is not None and _body_length(request) == (0, False) else None
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

    def _next_request(self, conn: _Conn) -> Request | None:
        """The next complete request head, parsed; None while incomplete or when refused."""
        buffer = conn.buffer
        if buffer[:1] in (b"\r", b"\n"):  # empty lines before a request line are allowed
            del buffer[: len(buffer) - len(buffer.lstrip(b"\r\n"))]
            conn.scanned = 0
        end = _HEAD_END.search(buffer, max(0, conn.scanned - 3))
        line_end = buffer.find(b"\n", 0, MAX_REQUEST_LINE + 2)
        if line_end < 0 and len(buffer) > MAX_REQUEST_LINE + 1:  # + 1: the line's CR
            self._refuse(conn, 414, f"request line longer than {MAX_REQUEST_LINE} bytes")
            return None
        if (end.start() if end else len(buffer)) > MAX_HEAD_BYTES:
            self._refuse(conn, 431, f"request head larger than {MAX_HEAD_BYTES} bytes")
            return None
        if end is None:
            conn.scanned = len(buffer)
            return None
        head = bytes(buffer[: end.start()])
        del buffer[: end.end()]
        conn.scanned = 0
        try:
            return _parse_head(head, conn.client)
        except _BadRequest as bad:
            self._refuse(conn, bad.status, bad.message)
            return None

    def _answer_inline(self, conn: _Conn, request: Request, response: Response) -> None:
        """Send from the I/O thread without blocking; what the socket does not take at once, a worker sends."""
        keep = request.keep_alive and not response.close and not self._closing
        data = _serialize(response, request.method == "HEAD", keep)
        try:
            sent = conn.sock.send(data)
        except BlockingIOError:
            sent = 0
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
            conn.sock.send(_serialize(response, head_only=False, keep_alive=False))
        except OSError:
            self._drop(conn)
            return
        self._linger(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting:
            conn = next(iter(self._waiting))
            if conn.deadline > now:
                break
            if conn.buffer:  # part of a request came, the rest did not
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
        length, unframed = _body_length(request)
        expect = request.headers.get("expect", "").lower() == "100-continue" and length > 0
        body = Body(conn, length, time.monotonic() + self._timeout, expect)
        try:
            response = self._handler(request, body)
        except Exception:
            logger.exception("rankscope: %s: handler failed on %s %s", self.name, request.method, request.path)
            response = self._error_page(500, "internal error; see the process's log")
        keep = request.keep_alive and not (unframed or response.close or self._closing) and body.complete
        if not conn.nodelay and conn.sock.family in (socket.AF_INET, socket.AF_INET6):
            # An answer is one write: send it now. Set here, not on accept: most of a flood never gets this far.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.nodelay = True
        conn.sock.settimeout(self._timeout)  # a client that does not read its answer is given up on
        conn.sock.sendall(_serialize(response, request.method == "HEAD", keep))
        return keep

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
                sock.close()
        with contextlib.suppress(Exception):  # best effort: the child must go on whatever happens here
            server._selector.close()
    _LIVE.clear()


os.register_at_fork(after_in_child=_close_in_child)
