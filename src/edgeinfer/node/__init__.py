"""node room."""
