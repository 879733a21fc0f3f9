"""engine/runner room."""
