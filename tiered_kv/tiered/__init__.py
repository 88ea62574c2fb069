"""The composite hierarchy: CPU tier over disk tier, as one OffloadingManager (scheduler
process) plus the handlers that carry out its cascades (worker processes)."""
