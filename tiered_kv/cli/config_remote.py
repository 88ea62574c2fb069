"""``tiered-kv config``'s shared tier: the ``remote`` key from the ``--remote-*`` options
and ``--trusted-bucket`` (``_remote``), and the warnings about its fleet key
(``_key_warnings``).

Operator's process. I/O: ``_key_warnings`` reads the fleet key the config names
(``--remote-key-file``'s file or ``--remote-key-env``'s variable) once, to warn where it
cannot be loaded on this host; the key never goes in the output. ``_remote`` reads
nothing: a shared tier is written only with the fleet key's place or
``--trusted-bucket``, as the server starts only with one.
"""

from __future__ import annotations

from typing import Any, Optional

from tiered_kv.config import ConfigError


def _remote(
    endpoint: Optional[str],
    bucket: Optional[str],
    prefix: Optional[str],
    region: Optional[str],
    key_file: Optional[str] = None,
    key_env: Optional[str] = None,
    trusted: bool = False,
) -> dict[str, Any] | None:
    """The ``remote`` key from the ``--remote-*`` options and ``--trusted-bucket`` (None
    without any). A shared tier needs the fleet key's place (``--remote-key-file`` or
    ``--remote-key-env``) or ``--trusted-bucket``: without either the server refuses to
    start (``tiered_kv.remote.format.keys.load_keyring``), so no such config is written."""
    given = {
        "endpoint": endpoint,
        "bucket": bucket,
        "prefix": prefix,
        "region": region,
        "key_file": key_file,
        "key_env": key_env,
    }
    remote: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if trusted:
        remote["trusted_bucket"] = True
    if not remote:
        return None
    if bucket is None:
        named = ["--remote-" + k.replace("_", "-") for k in remote if k != "trusted_bucket"]
        named += ["--trusted-bucket"] if trusted else []
        raise ConfigError(f"--remote-bucket: required with {', '.join(named)}")
    if key_file is not None and key_env is not None:
        raise ConfigError("--remote-key-file and --remote-key-env: name one place for the fleet key, not both")
    if trusted and (key_file is not None or key_env is not None):
        raise ConfigError(
            "--trusted-bucket: with a fleet key (--remote-key-file or --remote-key-env) every block is sealed "
            "anyway; give the key or --trusted-bucket, not both"
        )
    if key_file is None and key_env is None and not trusted:
        raise ConfigError(
            "--remote-bucket: the shared tier needs the fleet key, or the server refuses to start; add "
            "--remote-key-file PATH (a file on the server holding it, mode 600) or --remote-key-env NAME "
            "(a variable of the server's environment holding it), the same key on every node; generate one "
            "with: openssl rand -hex 32. Or add --trusted-bucket to store blocks unencrypted and "
            "unauthenticated, where everyone who can write the bucket is trusted with every tenant's KV"
        )
    return remote


def _key_warnings(remote: dict[str, Any] | None) -> list[str]:
    """Where the fleet key the config names cannot be loaded on this host (the server
    reads it at start-up, maybe on another machine), or the bucket is keyless."""
    from tiered_kv.remote.config import RemoteConfig
    from tiered_kv.remote.format.keys import FleetKeyError, load_keyring

    if remote is None:
        return []
    if remote.get("trusted_bucket"):
        return [
            "--trusted-bucket: blocks go to the bucket unencrypted and unauthenticated; anyone who can write "
            "it can make a server serve KV of their choosing"
        ]
    try:
        load_keyring(RemoteConfig.from_dict(remote, key_prefix="remote."))
    except FleetKeyError as e:
        return [f"{e} here; the server loads it at start-up (tiered-kv doctor --config checks it on the server)"]
    except ConfigError:
        pass  # the config's own validation names it
    return []
