"""The pinned-CPU tier: an LRU manager (scheduler process) and its spec."""

from tiered_kv.cpu.manager import CPUOffloadingManager

__all__ = ["CPUOffloadingManager"]
