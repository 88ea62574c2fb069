"""The shared tier's worker side: uploads from CPU slots and verified downloads into CPU
slots or the KV cache (``handlers``), over the worker's own ``RemoteStore``. Runs in each
worker process."""
