"""Test support: the real servers the tests start (Ceph RGW, Mooncake), the vLLM
scheduler/worker harness, engine nodes of the shared-tier tests, and the disk fixtures
and cache-directory checks several areas share. Imported as ``support.<module>`` (the
tests root is on ``sys.path``: its conftest lives there)."""
