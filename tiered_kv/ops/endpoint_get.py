"""One HTTP GET bounded in time and in size, for reading an endpoint that may be slow,
huge or hostile (``tiered-kv stats``).

Operator's process. I/O: one GET through urllib (redirects followed, the proxy
environment honoured) on a daemon thread. ``timeout`` bounds the whole read (name
resolution, connect, headers and body), not each socket read: the caller waits for the
thread at most that long, then shuts the connection's socket down so that the thread
stops reading too. The body is read in chunks and refused as soon as it passes
``max_bytes``, or before a byte of it when its Content-Length says it would, so memory
stays bounded by the limit whatever the server sends; http.client bounds the headers
(64 KiB a line, 100 lines). A TLS handshake cannot be cut short from outside: the caller
still returns at the deadline, and the thread ends at the socket's own timeout.
"""

from __future__ import annotations

import functools
import http.client
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

#: The body size read when the caller names none.
DEFAULT_MAX_BYTES = 64 * 1024**2
_CHUNK = 64 * 1024
#: Characters of a server's words (reasons, values) kept in a message.
_SHOWN = 200


class EndpointError(RuntimeError):
    """The endpoint could not be read, or did not answer in Prometheus' text format."""


def printable(text: object) -> str:
    """``text`` with each control or other unprintable character written as its escape
    (``\\x1b``): a server's words must not move a terminal's cursor or colour it."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def shorten(text: object, limit: int = _SHOWN) -> str:
    """``text`` cut to ``limit`` characters, ``printable``: what a server sends may be any
    length and hold anything."""
    s = str(text)
    s = s if len(s) <= limit else s[:limit] + f"... ({len(s)} characters)"
    return printable(s)


def endpoint_url(url: str) -> str:
    """``url`` as read: ``http://`` put in front of one without a scheme
    (``HOST:PORT/metrics``). Raises ``EndpointError`` for another scheme or no host."""
    url = url.strip()
    full = url if "://" in url else f"http://{url}"
    expected = "expected HOST:PORT/PATH (read as http://), http://HOST:PORT/PATH or https://HOST:PORT/PATH"
    try:
        parts = urllib.parse.urlsplit(full)
    except ValueError as exc:
        raise EndpointError(f"--url {shorten(url)!r}: {exc}; {expected}, e.g. localhost:8000/metrics") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise EndpointError(f"--url {shorten(url)!r}: {expected}, e.g. localhost:8000/metrics")
    return full


def _shut(sock: socket.socket) -> None:
    # The socket's own method: an SSL socket's would drop its TLS state under the reading
    # thread. Shutting (not closing) wakes that thread without freeing a descriptor it
    # still reads from.
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class _Read:
    """The GET on its thread: the body or the error, and the sockets it opened (one per
    redirect) for ``stop`` to shut."""

    def __init__(self, url: str, timeout: float, max_bytes: int):
        self.url, self.timeout, self.max_bytes = url, timeout, max_bytes
        self.done = threading.Event()
        self.body: bytes | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._stopped = False

    def opened(self, sock: socket.socket) -> None:
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._sockets.append(sock)
        if stopped:  # the caller gave up while this one connected
            _shut(sock)
            raise EndpointError(f"{self.url}: stopped")

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def run(self) -> None:
        try:
            self.body = self._get()
        except BaseException as exc:  # handed to the caller's thread, which reports it
            self.error = exc
        finally:
            self.done.set()

    def _too_large(self, what: str) -> EndpointError:
        return EndpointError(
            f"{self.url} sent a body {what}, larger than the limit of {self.max_bytes} bytes "
            f"({self.max_bytes / 1024**2:g} MiB; --max-bytes)"
        )

    def _get(self) -> bytes:
        opener = urllib.request.build_opener(_HTTPHandler(self), _HTTPSHandler(self))
        with opener.open(self.url, timeout=self.timeout) as response:
            length = (response.headers.get("Content-Length") or "").strip()
            if length.isdigit() and int(length) > self.max_bytes:
                raise self._too_large(f"of {int(length)} bytes (its Content-Length)")
            body = bytearray()
            while chunk := response.read(_CHUNK):
                body += chunk
                if len(body) > self.max_bytes:
                    raise self._too_large(f"of more than {self.max_bytes} bytes")
                if self._stopped:
                    raise EndpointError(f"{self.url}: stopped")
        return bytes(body)


class _HTTPConnection(http.client.HTTPConnection):
    """A connection that hands its socket to ``read`` once open (TLS included, in the
    HTTPS subclass: ``super().connect()`` wraps it first)."""

    def __init__(self, read: _Read, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._read = read

    def connect(self) -> None:
        super().connect()
        self._read.opened(self.sock)


class _HTTPSConnection(_HTTPConnection, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, read: _Read):
        super().__init__()
        self._read = read

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPConnection, self._read), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, read: _Read):
        super().__init__()
        self._read = read

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPSConnection, self._read), req)


def get(url: str, timeout: float, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The body of a GET of ``url`` (``endpoint_url``'s form), read within ``timeout``
    seconds in all and at most ``max_bytes`` long. Raises ``EndpointError`` naming the
    URL and what went wrong."""
    read = _Read(url, timeout, max_bytes)
    threading.Thread(target=read.run, name="tiered-kv-get", daemon=True).start()
    try:
        finished = read.done.wait(timeout)
    finally:
        if not read.done.is_set():  # the deadline, or Ctrl-C: the thread stops reading
            read.stop()
    if not finished:
        raise EndpointError(f"{url} could not be read: timed out after {timeout:g}s (--timeout)")
    exc = read.error
    if exc is None:
        assert read.body is not None
        return read.body
    if isinstance(exc, EndpointError):
        raise exc
    if isinstance(exc, urllib.error.HTTPError):
        exc.close()
        raise EndpointError(f"{url} answered HTTP {exc.code} {shorten(exc.reason)}") from None
    if isinstance(exc, (urllib.error.URLError, OSError, http.client.HTTPException)):
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, (TimeoutError, socket.timeout)):
            reason = f"timed out after {timeout:g}s (--timeout)"
        elif isinstance(reason, http.client.HTTPException):
            reason = f"{type(reason).__name__}: {reason}"
        raise EndpointError(f"{url} could not be read: {shorten(reason)}") from None
    raise exc
