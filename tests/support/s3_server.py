"""Fixtures of the shared-tier tests: a real Ceph RGW on 127.0.0.1, started once per test run.

``rgw_server`` runs ``tools/rgw_server.sh`` (one monitor, one memstore OSD, one radosgw,
in a scratch directory) the first time a test asks for it and stops the daemons at the
end of the run. Without the Ceph packages (``make rgw`` installs them as root) or the
``s3`` extra, the modules that need it skip themselves (``skip_module_without_rgw``), in
one line of the summary. ``FaultProxy`` sits
between a store and the server to inject what a healthy server does not do on demand:
503 SlowDown answers, requests that are never answered, and the refusal of conditional
PUTs that servers without ``If-None-Match`` support answer.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "rgw_server.sh"
CEPH_TOOLS = ("monmaptool", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")
ACCESS_KEY = "tieredkvtest"
SECRET_KEY = "tieredkvtestsecret"
BUCKET = "tiered-kv-tests"
#: The fleet key of the tests' shared tiers (a fixed test value), and the variable naming it.
FLEET_KEY_ENV = "TIERED_KV_TEST_FLEET_KEY"
FLEET_KEY = "5f" * 32


def missing_reason() -> str | None:
    """Why the shared-tier tests cannot run here, or None."""
    absent = [t for t in CEPH_TOOLS if shutil.which(t) is None]
    if absent:
        return (
            "needs Ceph RGW (" + ", ".join(absent) + " not found): `make rgw` as root installs "
            "ceph-mon ceph-osd radosgw ceph-common"
        )
    for module in ("obstore", "botocore"):
        try:
            __import__(module)
        except ImportError:
            return f"needs the s3 extra ({module} not importable): pip install -e '.[s3]'"
    return None


def skip_module_without_rgw() -> None:
    """Skip the calling test module when the server cannot run here. Raised from this one
    line, so every such module folds into one line of pytest's summary."""
    if (reason := missing_reason()) is not None:
        pytest.skip(reason, allow_module_level=True)


@dataclass
class RGWServer:
    dir: Path
    endpoint: str

    def _script(self, command: str, timeout: float = 120) -> None:
        done = subprocess.run(
            ["bash", str(SCRIPT), command, str(self.dir)], capture_output=True, text=True, timeout=timeout
        )
        if done.returncode:
            raise RuntimeError(f"rgw_server.sh {command} failed ({done.returncode}): {done.stderr.strip()}")

    def kill_rgw(self) -> None:
        """SIGKILL radosgw: the server is gone mid-run; the cluster keeps the objects."""
        self._script("kill-rgw")

    def start_rgw(self) -> None:
        self._script("start-rgw")

    def admin_client(self):
        """A botocore S3 client with the test user's keys (bucket set-up, raw access)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )


@pytest.fixture(scope="session")
def rgw_server(tmp_path_factory) -> RGWServer:
    if (reason := missing_reason()) is not None:
        pytest.skip(reason)
    scratch = tmp_path_factory.mktemp("rgw")
    done = subprocess.run(
        ["bash", str(SCRIPT), "start", str(scratch)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RGW_OWNER_PID": str(os.getpid())},
    )
    if done.returncode:
        subprocess.run(["bash", str(SCRIPT), "stop", str(scratch)], capture_output=True, timeout=60)
        pytest.fail(f"could not start Ceph RGW: {done.stderr.strip()[-2000:]}", pytrace=False)
    endpoint = done.stdout.strip().splitlines()[-1].removeprefix("endpoint=")
    server = RGWServer(scratch, endpoint)
    try:
        server.admin_client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(scratch)], capture_output=True, timeout=120)


@pytest.fixture
def s3_env(monkeypatch, tmp_path) -> None:
    """The test user's keys in the environment, and nothing else of this machine's AWS
    set-up: no ~/.aws files, no instance-metadata lookups."""
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv(FLEET_KEY_ENV, FLEET_KEY)


@pytest.fixture
def remote_settings(rgw_server, s3_env) -> dict:
    """Settings of a shared tier on the test server, under a prefix of its own."""
    return {
        "endpoint": rgw_server.endpoint,
        "bucket": BUCKET,
        "prefix": f"t-{uuid.uuid4().hex[:12]}",
        "request_timeout": "3s",
        "connect_timeout": "1s",
        "key_env": FLEET_KEY_ENV,
    }


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target`` (``host:port``).

    ``mode``: ``"pass"`` forwards bytes both ways; ``"503"`` answers every request with
    503 SlowDown; ``"stall"`` reads requests and never answers; ``"no-conditional-put"``
    answers a PUT carrying ``If-None-Match`` as a server without conditional writes does
    (501 NotImplemented; ``"no-conditional-put-400"``: 400 InvalidArgument naming the
    header) and forwards every other request to ``target``, one at a time; ``"503-put"``
    answers every PUT with 503 SlowDown and forwards the rest, likewise. Changing the
    mode closes the connections open in the old one, so a client's pooled connections
    see it too. ``requests_refused`` counts the requests answered with a fault. In the
    modes that forward one request at a time, ``get_delay`` seconds pass before each GET
    goes on: a bucket that got slower, which the real server cannot be made on demand.
    """

    #: Status line and S3 error of each conditional-PUT refusal mode.
    CONDITIONAL_REFUSALS = {
        "no-conditional-put": (
            b"501 Not Implemented",
            b"<Code>NotImplemented</Code><Message>A header you provided implies functionality that is not "
            b"implemented</Message><Header>If-None-Match</Header>",
        ),
        "no-conditional-put-400": (
            b"400 Bad Request",
            b"<Code>InvalidArgument</Code><Message>Conditional writes are not supported</Message>"
            b"<ArgumentName>If-None-Match</ArgumentName><ArgumentValue>*</ArgumentValue>",
        ),
    }

    def __init__(self, target: str, mode: str = "pass"):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.mode = mode
        self.requests_refused = 0
        #: ``count`` mode: each request relayed, by (method, path without the query).
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.get_delay = 0.0
        #: In the forwarding modes, every other GET is read and never answered.
        self.stall_every_other_get = False
        self._gets = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def set_mode(self, mode: str) -> None:
        with self._lock:
            self.mode = mode
            conns, self._conns = self._conns, []
        for c in conns:
            _close(c)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
                mode = self.mode
            if mode in self.CONDITIONAL_REFUSALS:
                serve = functools.partial(self._refuse_conditional, refusal=self.CONDITIONAL_REFUSALS[mode])
            elif mode == "count":
                serve = functools.partial(self._refuse_conditional, refusal=None)
            elif mode == "503-put":
                slow_down = (
                    b"503 Slow Down",
                    b"<Code>SlowDown</Code><Message>Please reduce your request rate.</Message>",
                )
                serve = functools.partial(self._refuse_conditional, refusal=slow_down, any_put=True)
            else:
                serve = {"pass": self._forward, "503": self._slow_down, "stall": self._stall}[mode]
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def _forward(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            _close(conn)
            return
        upstream.settimeout(None)
        with self._lock:
            self._conns.append(upstream)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while chunk := src.recv(1 << 16):
                    dst.sendall(chunk)
            except OSError:
                pass
            _close(src)
            _close(dst)

        threading.Thread(target=pump, args=(upstream, conn), daemon=True).start()
        pump(conn, upstream)

    def _read_request(self, conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(1 << 16)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            chunk = conn.recv(1 << 16)
            if not chunk:
                return False
            body += chunk
        return True

    def _slow_down(self, conn: socket.socket) -> None:
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>"
        )
        # One answer a connection, which then closes (``Connection: close``): no connection
        # of this mode stays in a client's pool to fail its first request in the next mode
        # (on a loaded machine the client may not see the close ``set_mode`` makes in time).
        try:
            if self._read_request(conn):
                with self._lock:
                    self.requests_refused += 1
                conn.sendall(
                    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
        except OSError:
            pass
        _close(conn)

    def _refuse_conditional(
        self, conn: socket.socket, refusal: tuple[bytes, bytes] | None, any_put: bool = False
    ) -> None:
        """Request by request: a conditional PUT (``any_put``: every PUT) is refused (with
        ``refusal``; None refuses nothing), anything else goes to the server over one upstream connection
        and its response comes back as sent; each relayed request is counted."""
        status, error = refusal or (b"", b"")
        body = b'<?xml version="1.0" encoding="UTF-8"?><Error>' + error + b"</Error>"
        client = conn.makefile("rb")
        upstream: socket.socket | None = None
        try:
            while (request := _read_message(client)) is not None:
                head, payload = request
                lines = head.split(b"\r\n")
                method = lines[0].split(b" ", 1)[0]
                if (
                    refusal is not None
                    and method == b"PUT"
                    and (any_put or any(n.strip().lower() == b"if-none-match" for n, _ in _fields(lines)))
                ):
                    with self._lock:
                        self.requests_refused += 1
                    conn.sendall(
                        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                    )
                    continue
                path = lines[0].split(b" ")[1].split(b"?", 1)[0].decode()
                with self._lock:
                    self.requests[(method.decode(), path)] += 1
                if method == b"GET" and self.get_delay:
                    time.sleep(self.get_delay)
                if method == b"GET" and self.stall_every_other_get:
                    with self._lock:
                        self._gets += 1
                        stall = self._gets % 2 == 0
                    if stall:  # never answered: the client's request times out
                        self._stall(conn)
                        break
                if upstream is None:
                    upstream = socket.create_connection(self.target, timeout=30)
                    with self._lock:
                        self._conns.append(upstream)
                    server = upstream.makefile("rb")
                upstream.sendall(head + b"\r\n\r\n" + payload)
                if not _relay_response(server, conn, head_only=method == b"HEAD"):
                    break
        except (OSError, ValueError):
            pass
        _close(conn)
        if upstream is not None:
            _close(upstream)

    def _stall(self, conn: socket.socket) -> None:
        try:
            while conn.recv(1 << 16):
                pass  # read everything, answer nothing
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.set_mode("pass")

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    """``(name, value)`` of each header line after the start line."""
    return [(name, value.strip()) for name, _, value in (line.partition(b":") for line in lines[1:])]


def _read_message(src) -> tuple[bytes, bytes] | None:
    """One HTTP request from a buffered reader: its head (without the blank line) and its
    body (``Content-Length`` bytes); None at the end of the connection."""
    lines = []
    while (line := src.readline()) not in (b"\r\n", b"\n"):
        if not line:
            return None
        lines.append(line.rstrip(b"\r\n"))
    length = sum(int(v) for n, v in _fields([b"", *lines]) if n.strip().lower() == b"content-length")
    body = src.read(length) if length else b""
    return (b"\r\n".join(lines), body) if len(body) == length else None


def _relay_response(src, dst: socket.socket, head_only: bool) -> bool:
    """Copy one HTTP response from ``src`` (a buffered reader) to ``dst`` as it came:
    by ``Content-Length``, chunk by chunk, or up to the end of the connection. False when
    the connection ends with it."""
    head = b""
    while (line := src.readline()) not in (b"\r\n", b"\n"):
        if not line:
            return False
        head += line
    dst.sendall(head + b"\r\n")
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    fields = {n.strip().lower(): v.lower() for n, v in _fields(lines)}
    if head_only or status in (204, 304) or 100 <= status < 200:
        return True
    if b"chunked" in fields.get(b"transfer-encoding", b""):
        while True:
            size_line = src.readline()
            dst.sendall(size_line)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (trailer := src.readline()) not in (b"\r\n", b"\n", b""):
                    dst.sendall(trailer)
                dst.sendall(b"\r\n")
                return True
            dst.sendall(src.read(size + 2))
    if b"content-length" in fields:
        dst.sendall(src.read(int(fields[b"content-length"])))
        return fields.get(b"connection") != b"close"
    while chunk := src.read1(1 << 16):
        dst.sendall(chunk)
    return False


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
