"""Streaming detokenization: text deltas for tokens as they are generated, at a cost that does not grow with
the length of the output.

Decoding one token alone is wrong for most tokenizers: SentencePiece decoders drop the leading space of the
first token they see, and a character split over byte tokens (byte-fallback `<0xE4>`, or byte-level BPE) only
exists once all its bytes are there. So each step decodes a short window of recent tokens twice -- with and
without the new ones -- and emits the difference (the prefix/read offset scheme of vLLM):

    ids:   ... | prefix_offset ...... read_offset ...... end
                 `- already emitted -´ `- new tokens -´

The window starts at `prefix_offset`, so both decodes see the same first token and strip the same space.
While the window's text ends in U+FFFD (an unfinished UTF-8 character) nothing is emitted and the offsets
stay put; the next complete character releases everything at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first generated one (enough for any leading-space rule).
_CONTEXT_TOKENS = 5
# No UTF-8 character needs more than 4 byte tokens; a tail still unfinished after this many is garbage (the
# model produced invalid bytes) and is emitted as U+FFFD so that the window, and the cost, stay bounded.
_MAX_HELD_TOKENS = 32


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    `add(new_ids)` returns the text those ids complete (possibly ""), never half a character. `flush()`
    returns whatever is still held back (call it when the request finishes). `text` is everything emitted.
    """

    def __init__(
        self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The window: context ids (already emitted) then ids not yet emitted, from `_read_offset` on.
        self._ids = _context(self._decode, list(prompt_ids))
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly completed text."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        window_text = self._decode(self._ids)
        held = len(self._ids) - self._read_offset
        if window_text.endswith(REPLACEMENT_CHAR) and held < _MAX_HELD_TOKENS:
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """Emit text still held back (an unfinished character becomes U+FFFD, as a full decode shows it)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, window_text: str) -> str:
        # The window's text extends the context's text (the decoders are left-to-right); slicing by length
        # keeps the emitted total in step with a full decode even in the rare case where it does not.
        delta = window_text[len(self._prefix_text) :]
        self._slide(window_text)
        if delta:
            self._parts.append(delta)
        return delta

    def _slide(self, window_text: str) -> None:
        """Make what was new the context of the next step, dropping older ids so memory stays bounded too.

        A context that shows no text (only skipped special tokens) is widened instead: SentencePiece
        decoders strip the space of the first *visible* token, which must stay the same in both decodes.
        """
        new_context = self._ids[self._read_offset :]
        context_text = self._decode(new_context)
        if context_text or len(self._ids) >= _MAX_HELD_TOKENS:
            self._ids, self._prefix_text = new_context, context_text
        else:
            self._prefix_text = window_text
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def _context(decode: Callable[[Sequence[int]], str], prompt_ids: list[int]) -> list[int]:
    """The last few prompt ids, widened until their text is visible and does not start mid-character."""
    start = max(len(prompt_ids) - _CONTEXT_TOKENS, 0)
    while start > 0 and len(prompt_ids) - start < _MAX_HELD_TOKENS:
        text = decode(prompt_ids[start:])
        if text and not text.startswith(REPLACEMENT_CHAR):
            break
        start -= 1
    return prompt_ids[start:]
