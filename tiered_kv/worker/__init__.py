"""Worker-process side: handlers that move KV bytes between media, and the router."""
