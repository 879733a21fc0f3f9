"""pool room."""
