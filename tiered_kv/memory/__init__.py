"""Host and device memory: the CPU tier's host cache (pinned or plain, shared between
processes), shared-memory regions, the CUDA device probes, and zero-copy views.

Imported in worker processes (and the disk I/O helper process, which maps the same host
memory); allocation, mapping and registration of memory, no file or network I/O beyond
``/dev/shm`` and ``/proc`` probes.
"""
