"""Fixtures of the Mooncake shared-tier tests: a real Mooncake Store on 127.0.0.1, once per run.

``mooncake_server`` starts ``mooncake_master`` and a standalone ``mooncake_client``
(``tiered_kv.testing.mooncake_server``) the first time a test asks for it and stops both
at the end of the run; tests may kill and restart either. Without the ``mooncake`` extra
or Debian's ``libibverbs1``/``librdmacm1`` the modules that need it skip themselves
(``skip_module_without_mooncake``), saying how to install them.
"""

from __future__ import annotations

import pytest

from tiered_kv.testing.mooncake_server import MooncakeServer, missing_reason


def skip_module_without_mooncake() -> None:
    """Skip the calling test module when the Mooncake daemons cannot run here."""
    if (reason := missing_reason()) is not None:
        pytest.skip(reason, allow_module_level=True)


@pytest.fixture(scope="session")
def mooncake_server(tmp_path_factory) -> MooncakeServer:
    if (reason := missing_reason()) is not None:
        pytest.skip(reason)
    with MooncakeServer(tmp_path_factory.mktemp("mooncake")).start() as server:
        yield server
