"""Errors the engine raises for bad input (the node maps them to 4xx)."""


class EngineInputError(ValueError):
    """A request the engine refuses: the message says why in one line."""
