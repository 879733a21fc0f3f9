"""router room."""
