"""One process's block I/O on a disk namespace: ``DiskStore`` (``store``: reads,
writes, checksums, ``fdatasync``, index commits, the crash-safe commit protocol) over the
I/O backends (``io_backends``: POSIX O_DIRECT, KvikIO), its batches (``batch``,
``read_batch``, ``write_batch``), its index commits (``group_commit``) and checksums
(``checksums``); ``block_store`` is what the handlers need of a store here or in a
helper process. Opened by every process that reads or writes blocks: a worker (or its
helper process), the scheduler's read-back check, and the operator's tools."""
