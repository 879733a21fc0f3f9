"""engine/model room."""
