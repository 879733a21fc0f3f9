"""fleet room."""
