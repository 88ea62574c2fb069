"""A throwaway Mooncake Store on 127.0.0.1: ``mooncake_master`` and a standalone ``mooncake_client``.

Runs in the calling (test or tool) process, which starts both daemons as child processes
on free ports (the master's RPC, HTTP metadata and metrics servers bound to 127.0.0.1
where the master allows it; its metadata server and the client's transfer sockets bind
0.0.0.0 whatever they are told), kills or restarts either on demand, and stops them.
Shared by the tests (tests/support/mooncake_server.py) and ``tools/bench_remote.py --backend
mooncake`` / ``tools/replay_fleet.py``; never used while serving. I/O: the daemons' logs
in the directory given.
"""

from __future__ import annotations

import functools
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

#: Memory the standalone client donates to the pool.
SEGMENT = "512 MB"


@functools.cache
def _binaries() -> tuple[Path, Path] | str:
    try:
        import mooncake
        import mooncake.store  # noqa: F401  (loads libibverbs and librdmacm)
    except ImportError as exc:
        return (
            f"needs Mooncake Store ({type(exc).__name__}: {exc}): pip install -e '.[mooncake]' and, as root, "
            "apt-get install libibverbs1 librdmacm1 (`make mooncake`)"
        )
    root = Path(mooncake.__file__).parent
    master, client = root / "mooncake_master", root / "mooncake_client"
    if not (master.exists() and client.exists()):
        return f"needs mooncake_master and mooncake_client in {root}: reinstall mooncake-transfer-engine-non-cuda"
    return master, client


def _found_binaries() -> tuple[Path, Path]:
    """``_binaries()``, raising ``RuntimeError`` with the reason where they are missing."""
    found = _binaries()
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def missing_reason() -> str | None:
    """Why the Mooncake tests cannot run here, or None."""
    found = _binaries()
    return found if isinstance(found, str) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s: {log.read_text()[-2000:]}")


@dataclass
class MooncakeServer:
    """A master and a standalone client on 127.0.0.1, with their ports; a context manager
    that stops both."""

    dir: Path
    rpc_port: int = field(default_factory=_free_port)
    metadata_port: int = field(default_factory=_free_port)
    metrics_port: int = field(default_factory=_free_port)
    client_port: int = field(default_factory=_free_port)
    master: subprocess.Popen | None = None
    client: subprocess.Popen | None = None
    #: Memory the standalone client donates (mooncake_client's --global_segment_size).
    segment: str = SEGMENT

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def _spawn(self, argv: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        log = self.dir / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log

    def start_master(self) -> None:
        master, _ = _found_binaries()
        self.master, log = self._spawn(
            [
                str(master),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
            ],
            "master",
        )
        _wait_port(self.rpc_port, self.master, "mooncake_master", log)
        _wait_port(self.metadata_port, self.master, "mooncake_master's metadata server", log)

    def start(self) -> MooncakeServer:
        """Master, then client, then until the pool takes a write."""
        try:
            self.start_master()
            self.start_client()
            self.wait_writable()
        except BaseException:
            self.stop()
            raise
        return self

    def start_client(self) -> None:
        _, client = _found_binaries()
        self.client, log = self._spawn(
            [
                str(client),
                "--host=127.0.0.1",
                f"--port={self.client_port}",
                f"--global_segment_size={self.segment}",
                "--protocol=tcp",
                f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_server}",
            ],
            "client",
        )
        _wait_port(self.client_port, self.client, "mooncake_client", log)

    def _kill(self, proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)

    def kill_master(self) -> None:
        """SIGKILL the master: every object's metadata is gone with it."""
        self._kill(self.master)

    def kill_client(self) -> None:
        """SIGKILL the standalone client: the memory holding the objects is gone."""
        self._kill(self.client)

    def stop(self) -> None:
        for proc in (self.client, self.master):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._kill(proc)

    def __enter__(self) -> MooncakeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def settings(self, **more) -> dict:
        """Settings of a shared tier on this store, under a prefix of its own."""
        return {
            "backend": "mooncake",
            "prefix": f"t-{uuid.uuid4().hex[:12]}",
            "mooncake_master": self.master_address,
            "mooncake_metadata_server": self.metadata_server,
            "request_timeout": "3s",
            "connect_timeout": "1s",
            # Loopback only: objects unsealed (header and checksum, no fleet key).
            "trusted_bucket": True,
            **more,
        }

    def raw_client(self):
        """A plain ``MooncakeDistributedStore`` of this store (raw access for the tests)."""
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        rc = raw.setup("127.0.0.1", self.metadata_server, 0, 64 << 20, "tcp", "", self.master_address)
        assert rc == 0, f"mooncake setup returned {rc}"
        return raw

    def wait_writable(self, timeout: float = 60) -> None:
        """Until a put through a fresh client succeeds (the standalone client has mounted
        its memory with the master)."""
        raw = self.raw_client()
        try:
            deadline = time.monotonic() + timeout
            while raw.put(f"probe-{uuid.uuid4().hex}", b"x") != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("the Mooncake store never accepted a write")
                time.sleep(0.5)
        finally:
            raw.close()
