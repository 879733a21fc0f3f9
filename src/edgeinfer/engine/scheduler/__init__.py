"""engine/scheduler room."""
