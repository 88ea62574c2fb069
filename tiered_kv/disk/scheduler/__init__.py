"""The disk tier's scheduler side: ``DiskOffloadingManager`` (slots, LRU, pins; never
blocks on I/O), its background index flusher, how it folds in the workers' index log,
what it adopts from the index at start-up, and its table of loadable blocks."""
