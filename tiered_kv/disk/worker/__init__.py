"""The disk tier's worker side: what only a worker process runs. The handlers that move
blocks between KV tensors or CPU slots and the slab (``handlers``), the stager that
writes CPU slots to the slab in the background (``stager``), and a worker's
``DiskStore`` run in a helper process of its own (``io_process``, ``io_server``). The
store itself is ``tiered_kv.disk.store``, which other processes open too."""
