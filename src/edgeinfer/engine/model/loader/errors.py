"""The one error every checkpoint problem becomes."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be opened or read; the one-line message names the file and the problem."""


def one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line (library messages often span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
