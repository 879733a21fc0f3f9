"""engine/kv_cache room."""
