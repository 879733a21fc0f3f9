"""Synthetic workloads that need no tokenizer, so they run against any model.

Prompts are built from a list of short, common English words. Each such word (with its leading space) is a
single token in the BPE/SentencePiece vocabularies of current LLMs, so "N words" approximates "N tokens"; the
server's usage report gives the exact count afterwards. Every workload is a list of sessions: a one-turn
session is a plain request, a multi-turn session is a conversation whose next turn is sent after the previous
answer arrives.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Short high-frequency words: single tokens in Gemma, Llama, Qwen and GPT vocabularies.
_WORD_TEXT = """
    the of and to in is was for on that with as by at from his her it an are were be this which or have
    has had not but all one two three new first more other some time year people way day man woman work
    life world state city school house water land family name part place case point group number fact
    night hand eye home room book word side head back end line kind car road tree river light sun moon
    star sea fire air game food music story idea money power study war law art field king child friend
    team open red blue green black white old young long short big small good high low great little early
    late last next right left best free full real sure clear close hard easy dark warm cold north south
    east west after before under over between into through during again also only very just still even
    often never always here there now then today soon later once while since make take give find tell
    ask call keep hold bring begin show hear play run move live write read learn change turn stand leave
    grow walk watch talk meet build send lose pay sit speak stay fall cut reach kill raise pass sell
    serve die report decide pull drive break carry eat rise
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Turn:
    """One user message and how many tokens to ask for in the answer."""

    text: str
    max_tokens: int
    approx_tokens: int  # words in `text`: the input-token estimate used when the server reports no usage


@dataclass(frozen=True)
class Session:
    """A conversation: turns sent one after another; a single-turn session is an independent request."""

    session_id: str
    turns: tuple[Turn, ...]

    @property
    def multi_turn(self) -> bool:
        return len(self.turns) > 1


def parse_range(text: str | int) -> tuple[int, int]:
    """Parse a length "N" or an inclusive range "LO:HI" (both >= 1) into (lo, hi)."""
    parts = str(text).split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"length must be N or LO:HI with integers, got {text!r}") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or values[0] < 1 or values[1] < values[0]:
        raise ValueError(f"length must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return values[0], values[1]


def random_words(rng: random.Random, n: int) -> str:
    """`n` words drawn uniformly with replacement from WORDS, space-separated."""
    return " ".join(rng.choices(WORDS, k=n))


def random_dataset(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[Session]:
    """Independent prompts with input and output lengths drawn uniformly from the given inclusive ranges."""
    _check_count(num_prompts)
    rng = random.Random(seed)
    sessions = []
    for i in range(num_prompts):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        turn = Turn(text=random_words(rng, n_in), max_tokens=n_out, approx_tokens=n_in)
        sessions.append(Session(session_id=f"random-{seed}-{i}", turns=(turn,)))
    return sessions


def shared_prefix_dataset(
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[Session]:
    """Prompts in `num_groups` groups; each group shares one `prefix_len`-word prefix (a system prompt, a
    document).

    The prompts are shuffled so members of one group arrive spread out, as they would from many users.
    """
    _check_count(num_prompts)
    if not 1 <= num_groups <= num_prompts:
        raise ValueError(f"num_groups must be in [1, num_prompts={num_prompts}], got {num_groups}")
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
    rng = random.Random(seed)
    prefixes = [random_words(rng, prefix_len) for _ in range(num_groups)]
    sessions = []
    for i in range(num_prompts):
        n_suffix, n_out = rng.randint(*suffix_len), rng.randint(*output_len)
        text = prefixes[i % num_groups] + " " + random_words(rng, n_suffix)
        turn = Turn(text=text, max_tokens=n_out, approx_tokens=prefix_len + n_suffix)
        sessions.append(Session(session_id=f"prefix-{seed}-g{i % num_groups}-{i}", turns=(turn,)))
    rng.shuffle(sessions)
    return sessions


def multi_turn_dataset(
    num_prompts: int,
    turns_per_session: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[Session]:
    """Agent-like conversations: `num_prompts` turns in total, `turns_per_session` per session (the last may
    be shorter). Each turn adds a new user message; the client resends the whole history with the previous
    answers.
    """
    _check_count(num_prompts)
    if turns_per_session < 1:
        raise ValueError(f"turns_per_session must be >= 1, got {turns_per_session}")
    rng = random.Random(seed)
    sessions = []
    for s in range(math.ceil(num_prompts / turns_per_session)):
        n_turns = min(turns_per_session, num_prompts - s * turns_per_session)
        turns = []
        for _ in range(n_turns):
            n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
            turns.append(Turn(text=random_words(rng, n_in), max_tokens=n_out, approx_tokens=n_in))
        sessions.append(Session(session_id=f"session-{seed}-{s}", turns=tuple(turns)))
    return sessions


def _check_count(num_prompts: int) -> None:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
