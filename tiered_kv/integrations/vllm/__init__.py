"""vLLM 0.33 integrations: out-of-tree plug-ins loaded by vLLM by module path."""
