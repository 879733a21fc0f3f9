"""Token log-probabilities as the APIs show them: each token's text beside its value."""

from __future__ import annotations

from typing import Any

from edgeinfer.node.backends.base import LogprobEntry
from edgeinfer.types import TokenLogprob


class Pieces:
    """Token ids → their text, decoded once per id and request."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._pieces[token_id] = piece
        return piece

    def entry(self, lp: TokenLogprob) -> LogprobEntry:
        return LogprobEntry(self.piece(lp.token_id), lp.logprob, [(self.piece(t), v) for t, v in lp.top])

    def entries(self, logprobs: list[TokenLogprob]) -> list[LogprobEntry]:
        return [self.entry(lp) for lp in logprobs]

    def prompt_entries(self, ids: list[int], given: list[TokenLogprob | None]) -> list[LogprobEntry]:
        """The prompt's tokens with the logprobs the engine gave (none for the first token)."""
        return [
            self.entry(given[i])
            if i < len(given) and given[i] is not None
            else LogprobEntry(self.piece(t), None)
            for i, t in enumerate(ids)
        ]
