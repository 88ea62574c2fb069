"""``tiered-kv demo --remote [CONFIG_OR_URL]``: the demo's hierarchy with a shared tier
below the disk tier.

``--remote CONFIG`` takes the ``remote`` settings of a server's config file, ``--remote
http(s)://HOST[:PORT]/BUCKET`` an S3 bucket (credentials from the standard chain), each
used as given. A bare ``--remote`` starts a throwaway server for the demo's duration: a
Mooncake Store (``tiered_kv.testing.mooncake_server``) where Mooncake is installed, else
a single-node Ceph RGW (``tools/rgw_server.sh``, in a checkout) where radosgw is. Either
is stopped, and the scratch directory holding its logs, the disk tiers' directories and
the throwaway fleet key is removed, when the demo ends, fails, or is interrupted (Ctrl-C
or SIGTERM). Operator's process; I/O: the scratch directory, the server's daemons.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from typer.core import TyperCommand

from tiered_kv.config import VLLM_PASSTHROUGH_KEYS, ConfigError, TieredConfig
from tiered_kv.model_identity import read_config_file
from tiered_kv.remote.scheduler.manager import RemoteOffloadingManager
from tiered_kv.sim.driver import EngineDriver

#: ``--remote`` given without a value: start a throwaway server.
THROWAWAY = ""
#: Where the demo's objects live in a bucket or store it is pointed at: the demo's own
#: model id keeps them in a namespace no server reads.
DEMO_PREFIX = "tiered-kv-demo"
RGW_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "rgw_server.sh"
RGW_ACCESS_KEY, RGW_SECRET_KEY = "tieredkvdemo", "tieredkvdemosecret"
EXPECTED = (
    "expected a config file with a 'remote' section, an S3 endpoint http(s)://HOST[:PORT]/BUCKET, "
    "or no value (a throwaway server)"
)


class DemoSharedTierError(Exception):
    """The shared tier cannot be set up: bad ``--remote`` value, or no server to start."""


class DemoCommand(TyperCommand):
    """The demo command: ``--remote`` followed by nothing or by another option means the
    throwaway server (click has no options whose value may be left out)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(args):
            if arg == "--":
                out.extend(args[i:])
                break
            out.append(arg)
            if arg == "--remote" and (i + 1 == len(args) or args[i + 1].startswith("-")):
                out.append(THROWAWAY)
        return super().parse_args(ctx, out)


@dataclass
class DemoSharedTier:
    """The ``remote`` settings of the demo's hierarchy, where they point (for the report),
    and a scratch directory that lives as long as the demo."""

    settings: dict[str, Any]
    where: str
    scratch: Path


def _fleet_key(scratch: Path) -> str:
    """A throwaway fleet key in a file of mode 0600: the demo's objects are sealed under a
    key nobody else holds."""
    path = scratch / "fleet.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return str(path)


def _from_config(value: str) -> dict[str, Any]:
    path = Path(value)
    if not path.is_file():
        raise DemoSharedTierError(f"--remote {value!r}: no such file; {EXPECTED}")
    try:
        extra = read_config_file(path)
        shared = TieredConfig.from_dict(extra, passthrough_keys=VLLM_PASSTHROUGH_KEYS).shared_tier
    except ConfigError as e:
        raise DemoSharedTierError(f"--remote {value!r}: {e}") from None
    if shared is None:
        raise DemoSharedTierError(
            f"--remote {value!r}: the config has no 'remote' section (nor a tiers entry of type remote); {EXPECTED}"
        )
    if shared.key == "remote":
        return dict(extra["remote"])
    # A ``tiers`` entry: its own keys, as written (credentials included), less the entry's.
    (raw,) = (t for t in extra["tiers"] if isinstance(t, dict) and t.get("name", "remote") == shared.name)
    return {k: v for k, v in raw.items() if k not in ("type", "name", "medium")}


def _from_url(value: str, scratch: Path) -> dict[str, Any]:
    url = urlsplit(value)
    bucket = url.path.strip("/")
    if not url.hostname or not bucket or "/" in bucket or url.query or url.fragment:
        raise DemoSharedTierError(f"--remote {value!r}: not an S3 bucket URL; {EXPECTED}")
    return {
        "endpoint": f"{url.scheme}://{url.netloc}",
        "bucket": bucket,
        "prefix": DEMO_PREFIX,
        "key_file": _fleet_key(scratch),
    }


def _install_hint() -> str:
    return (
        "--remote without a value starts a throwaway Mooncake Store or Ceph RGW, and neither is installed here: "
        "pip install 'tiered-kv[mooncake]' and apt-get install libibverbs1 librdmacm1 (`make mooncake`), "
        "or install Ceph RGW (`make rgw`, as root, in a checkout), or pass an endpoint: "
        "--remote CONFIG or --remote http://HOST:PORT/BUCKET"
    )


@contextlib.contextmanager
def _mooncake(scratch: Path) -> Iterator[DemoSharedTier]:
    from tiered_kv.testing.mooncake_server import MooncakeServer

    server_dir = scratch / "mooncake"
    server_dir.mkdir()
    with MooncakeServer(server_dir).start() as server:
        settings = server.settings(prefix=DEMO_PREFIX, key_file=_fleet_key(scratch))
        settings.pop("trusted_bucket")  # sealed under the throwaway key instead
        yield DemoSharedTier(settings, f"throwaway Mooncake Store, master {server.master_address}", scratch)


def _rgw_ready() -> bool:
    if shutil.which("radosgw") is None or not RGW_SCRIPT.is_file():
        return False
    try:
        import botocore  # noqa: F401
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _rgw(scratch: Path) -> Iterator[DemoSharedTier]:
    import botocore.session

    server_dir = scratch / "rgw"
    env = {**os.environ, "RGW_ACCESS_KEY": RGW_ACCESS_KEY, "RGW_SECRET_KEY": RGW_SECRET_KEY}
    # The watcher stops the daemons should this process die before its clean-up runs.
    env["RGW_OWNER_PID"] = str(os.getpid())
    try:
        done = subprocess.run(
            ["bash", str(RGW_SCRIPT), "start", str(server_dir)], capture_output=True, text=True, timeout=300, env=env
        )
        if done.returncode:
            raise DemoSharedTierError(f"the throwaway Ceph RGW did not start: {done.stderr.strip()[-1000:]}")
        endpoint = done.stdout.strip().splitlines()[-1].removeprefix("endpoint=")
        bucket = "tiered-kv-demo"
        botocore.session.get_session().create_client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=RGW_ACCESS_KEY,
            aws_secret_access_key=RGW_SECRET_KEY,
        ).create_bucket(Bucket=bucket)
        # The S3 client takes credentials from the standard chain: the server's fixed
        # keys, for this process and only while the server runs.
        saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")}
        os.environ.update(AWS_ACCESS_KEY_ID=RGW_ACCESS_KEY, AWS_SECRET_ACCESS_KEY=RGW_SECRET_KEY)
        os.environ.pop("AWS_PROFILE", None)
        try:
            settings = {"endpoint": endpoint, "bucket": bucket, "prefix": DEMO_PREFIX, "key_file": _fleet_key(scratch)}
            yield DemoSharedTier(settings, f"throwaway Ceph RGW at {endpoint}", scratch)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        subprocess.run(["bash", str(RGW_SCRIPT), "stop", str(server_dir)], capture_output=True, timeout=120)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM ends the demo through its clean-up, as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shared_tier(value: str) -> Iterator[DemoSharedTier]:
    """The shared tier ``--remote value`` names (``THROWAWAY``: a server started here),
    with a scratch directory; both gone when the block exits, however it exits. Raises
    ``DemoSharedTierError`` naming the value when it is neither a config, a URL nor empty,
    or when no throwaway server can be started here."""
    if value != THROWAWAY and "://" in value and urlsplit(value).scheme not in ("http", "https"):
        raise DemoSharedTierError(f"--remote {value!r}: unsupported scheme; {EXPECTED}")
    settings = None
    if value != THROWAWAY and "://" not in value:
        settings = _from_config(value)  # before anything is created
    if value == THROWAWAY:
        from tiered_kv.testing.mooncake_server import missing_reason

        mooncake = missing_reason() is None
        if not mooncake and not _rgw_ready():
            raise DemoSharedTierError(_install_hint())
    scratch = Path(tempfile.mkdtemp(prefix="tiered-kv-demo-"))
    try:
        with _sigterm_as_exit():
            if value == THROWAWAY:
                with _mooncake(scratch) if mooncake else _rgw(scratch) as shared:
                    yield shared
            elif settings is not None:
                yield DemoSharedTier(settings, f"{value} (its 'remote' section)", scratch)
            else:
                url_settings = _from_url(value, scratch)
                yield DemoSharedTier(url_settings, f"s3://{url_settings['bucket']}/{DEMO_PREFIX} at {value}", scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def shared_manager(driver: EngineDriver) -> RemoteOffloadingManager:
    """The shared tier's manager: the last tier below CPU of the driver's hierarchy."""
    return cast(RemoteOffloadingManager, cast(Any, driver.manager).lower[-1])


class ProbingDriver(EngineDriver):
    """Asks the shared tier about a request's blocks in one batch before looking them up,
    and waits for the answers, as an engine defers a request whose lookup is pending;
    without it the demo would find a chain in the shared tier one block per request."""

    def run_request(self, block_hashes) -> None:
        block_hashes = list(block_hashes)
        remote = shared_manager(self)
        rest = block_hashes[self._pool.lookup(block_hashes) :]
        if rest and remote.expect(rest):
            remote.wait_probes(60)
        super().run_request(block_hashes)


def settle_uploads(spec: Any, driver: EngineDriver, timeout: float = 120) -> None:
    """Until every block handed to the shared tier is uploaded or has failed, so that
    the next pass finds what this one stored."""
    spec.lower_tiers[-1].stager.drain()
    if not shared_manager(driver).settle(timeout):
        raise RuntimeError(f"the shared tier's uploads did not settle within {timeout:g} s")


def pass_dir(shared: DemoSharedTier, n: int) -> str:
    """A fresh disk-tier directory for pass ``n`` in the scratch directory."""
    return str(shared.scratch / f"disk-{n}-{uuid.uuid4().hex[:8]}")
