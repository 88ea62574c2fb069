"""The shared tier's scheduler side: the composite's lower tier (``manager``), what it
knows of the bucket without waiting (``membership``), and the check before a hit under
vLLM (``hit_check``). Runs in the scheduler process."""
