"""The engine simulator: a driver that runs the hierarchy as a scheduler and a model
runner would (``driver``), and the request workloads it replays (``workloads``).

Used by ``tiered-kv demo``, the replay tools and the tests; one process, no engine needed.
"""
