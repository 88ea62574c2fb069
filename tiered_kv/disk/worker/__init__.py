"""The disk tier's worker side: block I/O of one rank. ``DiskStore`` (reads, writes,
checksums, ``fdatasync``, index commits) over the I/O backends (POSIX O_DIRECT, KvikIO),
run in the worker or in a helper process of its own (``io_process``, ``io_server``);
the handlers that move blocks between KV tensors or CPU slots and the slab; the stager
that writes CPU slots to the slab in the background."""
