"""obs room."""
