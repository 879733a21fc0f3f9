"""A job's usage: the engine's counts, summed over its choices."""

from __future__ import annotations

from collections.abc import Sequence

from edgeinfer.node.backends.local.choice import Choice
from edgeinfer.types import Usage


def total_usage(choices: Sequence[Choice], n: int) -> Usage:
    total = Usage()
    for index, choice in enumerate(choices):
        if choice.usage is None:
            continue
        if index % n == 0:
            # The n choices of a prompt share it: its tokens are counted once, from the first choice.
            total.prompt_tokens += choice.usage.prompt_tokens
            total.cached_tokens += choice.usage.cached_tokens
        total.completion_tokens += choice.usage.completion_tokens
    return total
