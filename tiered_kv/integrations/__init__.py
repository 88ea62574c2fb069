"""Adapters that plug the hierarchy into inference engines. Each needs its engine
installed; importing ``tiered_kv`` itself never does."""
