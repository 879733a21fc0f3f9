"""Public prefixes: the operator's shared system prompts, as the token ids requests start with.

A plain text is tokenized as a completions prompt is (with the special tokens the model adds, e.g.
BOS). A system prompt becomes its chat preamble: everything the chat template renders before the
user's words, found as the longest common prefix of two renderings that differ only in the user's
message, and tokenized as chat prompts are (the template holds the special tokens). Only whole blocks of
it are shared, so a token merged across the preamble's end costs at most its last block.
"""

from __future__ import annotations

from edgeinfer.engine.tokenizer import Tokenizer


def chat_preamble(tokenizer: Tokenizer, system: str) -> str:
    renders = [
        tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": u}])
        for u in ("\u2460", "\u2461")
    ]
    a, b = renders
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:same]


def public_token_ids(
    tokenizer: Tokenizer, texts: tuple[str, ...], systems: tuple[str, ...]
) -> list[list[int]]:
    out = [tokenizer.encode(text, add_special_tokens=True) for text in texts]
    out += [tokenizer.encode(chat_preamble(tokenizer, s), add_special_tokens=False) for s in systems]
    return out
