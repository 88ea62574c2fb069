"""``tiered-kv stats`` against endpoints that misbehave: real local HTTP servers on
threads that drip their answer, send an endless body, name tiers in Rich markup, or
export values the view cannot read. Each must give one ``error:`` line (or, for the
labels, the labels as written), in bounded time and memory."""

from __future__ import annotations

import http.server
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import _load_commands, app

_load_commands()

#: A view the tool accepts: one tier with lookups and hits.
GOOD = (
    'tiered_kv_tier_blocks_total{tier="cpu",event="lookups"} 4\n'
    'tiered_kv_tier_blocks_total{tier="cpu",event="hits"} 2\n'
    'tiered_kv_tier_tokens_total{tier="cpu",event="lookups"} 64\n'
    'tiered_kv_tier_tokens_total{tier="cpu",event="hits"} 32\n'
)


def _stats(*args: str):
    return CliRunner().invoke(app, ["stats", *args])


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


class _Raw(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def raw_server() -> Iterator[Callable[[Callable[[socket.socket], None]], int]]:
    """Starts a TCP server whose every connection runs ``answer(conn)`` on its own thread
    (after the request's head is read); returns its port."""
    servers: list[_Raw] = []

    def start(answer: Callable[[socket.socket], None]) -> int:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = self.request.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                answer(self.request)

        server = _Raw(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def metrics_server() -> Iterator[Callable[[str], str]]:
    """Starts an ``http.server`` answering every GET with ``text``; returns its URL."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(text: str) -> str:
        body = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/metrics"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


class _Sender:
    """What a server's answer managed to send, and whether the client went away."""

    def __init__(self) -> None:
        self.sent = 0
        self.gone = threading.Event()

    def send(self, conn: socket.socket, data: bytes) -> bool:
        try:
            conn.sendall(data)
        except OSError:
            self.gone.set()
            return False
        self.sent += len(data)
        return True


_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"


@pytest.mark.parametrize("drip_from", ["status line", "body"])
def test_a_dripping_server_is_cut_off_at_the_timeout(raw_server, drip_from):
    """A byte every 0.5 s never trips a per-read timeout of 1 s; the whole read must
    still end at about 1 s, and the reader must stop reading (the server sees it go)."""
    sender = _Sender()

    def answer(conn: socket.socket) -> None:
        answer_bytes = _HEAD + b"# " + b"x" * 1000
        if drip_from == "body" and not sender.send(conn, _HEAD):
            return
        start = len(_HEAD) if drip_from == "body" else 0
        deadline = time.monotonic() + 20  # a reader that never gives up fails the test, not the run
        for i in range(start, len(answer_bytes)):
            if time.monotonic() > deadline or not sender.send(conn, answer_bytes[i : i + 1]):
                return
            time.sleep(0.5)

    port = raw_server(answer)
    url = f"http://127.0.0.1:{port}/metrics"
    started = time.monotonic()
    result = _stats("--url", url, "--timeout", "1")
    elapsed = time.monotonic() - started
    line = _one_error_line(result)
    assert elapsed < 5, elapsed
    assert line == f"error: {url} could not be read: timed out after 1s (--timeout)"
    assert sender.gone.wait(5), "the reader kept the connection open after giving up"


def test_an_endless_body_stops_at_the_limit(raw_server):
    sender = _Sender()

    def answer(conn: socket.socket) -> None:
        if not sender.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"):
            return
        chunk = b"# " + b"x" * (64 * 1024 - 3) + b"\n"
        while sender.sent < 512 * 1024**2 and sender.send(conn, chunk):  # a reader without a limit fails
            pass

    port = raw_server(answer)
    result = _stats("--url", f"127.0.0.1:{port}/metrics", "--max-bytes", "1MiB")
    line = _one_error_line(result)
    assert f"127.0.0.1:{port}/metrics sent a body of more than 1048576 bytes" in line
    assert "limit of 1048576 bytes (1 MiB; --max-bytes)" in line
    assert sender.gone.wait(10), "the reader kept reading past the limit"
    # What the server got out: the limit, plus what the two sockets' buffers hold.
    assert sender.sent < 64 * 1024**2, sender.sent


def test_the_default_limit_is_64_mib(raw_server):
    sender = _Sender()

    def answer(conn: socket.socket) -> None:
        if not sender.send(conn, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"):
            return
        chunk = b"#" * (1024**2 - 1) + b"\n"
        while sender.sent < 1024**3 and sender.send(conn, chunk):
            pass

    port = raw_server(answer)
    line = _one_error_line(_stats("--url", f"http://127.0.0.1:{port}/metrics"))
    assert "limit of 67108864 bytes (64 MiB; --max-bytes)" in line
    assert sender.gone.wait(10) and sender.sent < 128 * 1024**2, sender.sent


def test_a_huge_content_length_is_refused_before_its_body(raw_server):
    sender = _Sender()

    def answer(conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (3 * 1024**3)
        if sender.send(conn, head):
            sender.send(conn, b"#" * 1024)
            time.sleep(20)  # the body never comes: only its announced size can end the read in time

    port = raw_server(answer)
    started = time.monotonic()
    line = _one_error_line(_stats("--url", f"http://127.0.0.1:{port}/metrics", "--timeout", "10"))
    assert time.monotonic() - started < 5
    assert f"of {3 * 1024**3} bytes (its Content-Length), larger than the limit of 67108864 bytes" in line


def test_labels_are_printed_as_written_never_as_markup(metrics_server):
    text = (
        GOOD
        + 'tiered_kv_tier_blocks_total{tier="[/]",event="lookups"} 1\n'
        + 'tiered_kv_tier_blocks_total{tier="[bold]x[/bold]",event="lookups"} 1\n'
        + 'tiered_kv_transfer_jobs_total{transfer_type="[red]cpu_to_gpu[/]",outcome="ok"} 3\n'
        + 'tiered_kv_transfer_jobs_total{transfer_type="\x1b[2Jgone",outcome="ok"} 1\n'
    )
    result = _stats("--url", metrics_server(text))
    assert result.exit_code == 0, result.output
    assert "[/]" in result.stdout and "[bold]x[/bold]" in result.stdout, result.stdout
    assert "[red]cpu_to_gpu[/]" in result.stdout, result.stdout
    # A terminal control sequence is shown as its escape, never sent to the terminal.
    assert "\\x1b[2Jgone" in result.stdout and "\x1b" not in result.stdout, result.stdout
    header = next(line for line in result.stdout.splitlines() if "[/]" in line and "cpu" in line)
    assert [cell.strip() for cell in header.split("┃")[2:-1]] == ["cpu", "[/]", "[bold]x[/bold]"]


_TIER = 'tiered_kv_tier_blocks_total{tier="cpu",event="lookups"}'


_COUNTER = 'tiered_kv_tier_blocks_total{event="lookups",tier="cpu"}'


@pytest.mark.parametrize(
    "line, words",
    [
        (f"{_TIER} NaN", f"{_COUNTER} is NaN; expected a finite count >= 0"),
        (f"{_TIER} +Inf", f"{_COUNTER} is +Inf; expected a finite count >= 0"),
        (f"{_TIER} -3", f"{_COUNTER} is -3; expected a finite count >= 0"),
        (
            'tiered_kv_tier_used_blocks{tier="cpu"} NaN',
            'tiered_kv_tier_used_blocks{tier="cpu"} is NaN; expected a finite number',
        ),
        (
            'tiered_kv_retention_ttl_seconds{tier="disk"} +Inf',
            'tiered_kv_retention_ttl_seconds{tier="disk"} is +Inf; expected a finite number',
        ),
        ("tiered_kv_leases NaN", "tiered_kv_leases is NaN; expected a finite number"),
        (
            'tiered_kv_canary_checks_total{outcome="passed"} -1',
            'tiered_kv_canary_checks_total{outcome="passed"} is -1; expected a finite count >= 0',
        ),
        (
            'tiered_kv_transfer_seconds_count{transfer_type="disk_to_gpu"} -Inf',
            'tiered_kv_transfer_seconds_count{transfer_type="disk_to_gpu"} is -Inf; expected a finite count >= 0',
        ),
    ],
)
def test_a_value_the_view_cannot_read_is_one_error_line(metrics_server, line, words):
    url = metrics_server(GOOD + line + "\n")
    assert _one_error_line(_stats("--url", url)) == f"error: {url}: {words}"


def test_values_the_view_does_not_read_are_not_judged(metrics_server):
    """vLLM's own series, or a gauge the view does not show, may be NaN."""
    url = metrics_server(GOOD + 'vllm:some_gauge NaN\ntiered_kv_tier_load_latency_seconds{tier="cpu"} +Inf\n')
    result = _stats("--url", url, "--json")
    assert result.exit_code == 0, result.output


_HIST = "tiered_kv_transfer_seconds"


@pytest.mark.parametrize(
    "buckets, words",
    [
        (
            [("0.1", 5), ("1.0", 3), ("+Inf", 5)],
            'histogram tiered_kv_transfer_seconds_bucket{transfer_type="disk_to_gpu"} counts 5 at le="0.1" but 3 at '
            'le="1.0"; expected bucket counts that never decrease as le grows',
        ),
        (  # listed out of order, decreasing once sorted by bound
            [("+Inf", 4), ("0.1", 1), ("10", 6)],
            'counts 6 at le="10" but 4 at le="+Inf"; expected bucket counts that never decrease',
        ),
        (
            [("0.1", 1), ("soon", 2), ("+Inf", 2)],
            'tiered_kv_transfer_seconds_bucket{le="soon",transfer_type="disk_to_gpu"} has le="soon"; expected a '
            "bucket bound such as 0.1 or +Inf",
        ),
    ],
)
def test_malformed_histogram_buckets_are_one_error_line(metrics_server, buckets, words):
    lines = [f'{_HIST}_bucket{{transfer_type="disk_to_gpu",le="{le}"}} {n}' for le, n in buckets]
    lines.append(f'{_HIST}_count{{transfer_type="disk_to_gpu"}} {buckets[-1][1]}')
    result = _stats("--url", metrics_server(GOOD + "\n".join(lines) + "\n"), "--json")
    line = _one_error_line(result)
    assert words in line, line
    assert words in json.loads(result.stdout)["error"]


def test_monotonic_buckets_of_two_series_pass(metrics_server):
    """Buckets are judged per series: two series whose counts differ are not one
    decreasing histogram."""
    lines = [
        f'{_HIST}_bucket{{transfer_type="{t}",le="{le}"}} {n}'
        for t, scale in (("disk_to_gpu", 10), ("cpu_to_gpu", 1))
        for le, n in (("0.1", 1 * scale), ("1.0", 2 * scale), ("+Inf", 2 * scale))
    ]
    lines += [
        f'tiered_kv_transfer_jobs_total{{transfer_type="{t}",outcome="ok"}} 1' for t in ("disk_to_gpu", "cpu_to_gpu")
    ]
    result = _stats("--url", metrics_server(GOOD + "\n".join(lines) + "\n"), "--json")
    assert result.exit_code == 0, result.output
    by_type = {t["transfer_type"]: t for t in json.loads(result.stdout)["transfers"]}
    assert by_type["disk_to_gpu"]["latency"]["p50_seconds"] == pytest.approx(0.1)


def test_host_port_path_without_a_scheme_is_read_as_http(metrics_server):
    bare = metrics_server(GOOD).removeprefix("http://")
    result = _stats("--url", bare, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["url"] == f"http://{bare}"
    assert doc["tiers"][0]["tier"] == "cpu" and doc["tiers"][0]["hits_tokens"] == 32
    table = _stats("--url", bare)
    assert table.exit_code == 0 and f"tiers at http://{bare}" in table.stdout


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/metrics", "http:///metrics", ""])
def test_a_url_that_cannot_be_http_says_what_to_write(url):
    line = _one_error_line(_stats("--url", url))
    assert "expected HOST:PORT/PATH (read as http://), http://HOST:PORT/PATH or https://HOST:PORT/PATH" in line


def test_an_engines_other_metrics_are_passed_over_and_too_many_of_ours_are_one_error_line(metrics_server):
    """Millions of other series (an engine's own, or a hostile answer) are sifted out
    line by line, never parsed; more samples of tiered-kv's metrics than any engine
    exports are refused, naming the bound, before they are parsed."""
    from tiered_kv.ops.metrics_view import MAX_SAMPLES

    result = _stats("--url", metrics_server(GOOD + "a 1\n" * 2_000_000), "--json")
    assert result.exit_code == 0, result.output
    assert [t["tier"] for t in json.loads(result.stdout)["tiers"]] == ["cpu"]
    many = "".join(f'tiered_kv_tier_blocks_total{{tier="t{i}",event="lookups"}} 1\n' for i in range(MAX_SAMPLES))
    line = _one_error_line(_stats("--url", metrics_server(GOOD + many)))
    assert f"more than {MAX_SAMPLES:,} samples of tiered-kv's metrics" in line
