"""Workload generators: deterministic by seed, lengths inside the requested ranges, documented shape."""

from __future__ import annotations

import pytest

from edgeinfer.bench.datasets import (
    WORDS,
    multi_turn_dataset,
    parse_range,
    random_dataset,
    shared_prefix_dataset,
)


def test_words_are_unique_single_words() -> None:
    assert len(WORDS) == len(set(WORDS)) > 200
    assert all(w.isalpha() and w.islower() for w in WORDS)


@pytest.mark.parametrize(("text", "expected"), [("5", (5, 5)), (7, (7, 7)), ("3:9", (3, 9)), ("4:4", (4, 4))])
def test_parse_range(text: str | int, expected: tuple[int, int]) -> None:
    assert parse_range(text) == expected


@pytest.mark.parametrize("bad", ["0", "9:3", "a", "1:2:3", "-1:4", ""])
def test_parse_range_rejects_bad_input(bad: str) -> None:
    with pytest.raises(ValueError, match="length must be"):
        parse_range(bad)


def test_random_is_deterministic_by_seed_and_within_ranges() -> None:
    a = random_dataset(50, (10, 20), (5, 8), seed=1)
    assert a == random_dataset(50, (10, 20), (5, 8), seed=1)
    assert a != random_dataset(50, (10, 20), (5, 8), seed=2)
    for session in a:
        (turn,) = session.turns
        assert 10 <= len(turn.text.split()) == turn.approx_tokens <= 20
        assert 5 <= turn.max_tokens <= 8
        assert set(turn.text.split()) <= set(WORDS)
    assert len({s.turns[0].text for s in a}) == 50  # distinct prompts: no accidental prefix-cache hits
    assert len({s.session_id for s in a}) == 50
    # Both ends of the ranges are reachable, i.e. the ranges are inclusive.
    assert {len(s.turns[0].text.split()) for s in a} >= {10, 20}


def test_shared_prefix_groups_share_exactly_their_prefix() -> None:
    sessions = shared_prefix_dataset(
        40, num_groups=4, prefix_len=30, suffix_len=(5, 10), output_len=(4, 4), seed=3
    )
    assert sessions == shared_prefix_dataset(40, 4, 30, (5, 10), (4, 4), seed=3)
    prefixes = {" ".join(s.turns[0].text.split()[:30]) for s in sessions}
    assert len(prefixes) == 4
    for s in sessions:
        assert 35 <= s.turns[0].approx_tokens == len(s.turns[0].text.split()) <= 40
    groups = [s.session_id.split("-")[2] for s in sessions]
    assert groups != sorted(groups)  # shuffled: one group's prompts do not arrive back to back


def test_shared_prefix_rejects_more_groups_than_prompts() -> None:
    with pytest.raises(ValueError, match="num_groups"):
        shared_prefix_dataset(3, num_groups=4, prefix_len=10, suffix_len=(1, 1), output_len=(1, 1), seed=0)


def test_multi_turn_total_turns_and_session_sizes() -> None:
    sessions = multi_turn_dataset(10, turns_per_session=4, input_len=(3, 6), output_len=(2, 2), seed=0)
    assert [len(s.turns) for s in sessions] == [4, 4, 2]
    assert all(s.multi_turn for s in sessions)
    assert sessions == multi_turn_dataset(10, 4, (3, 6), (2, 2), seed=0)


@pytest.mark.parametrize("n", [0, -3])
def test_prompt_count_must_be_positive(n: int) -> None:
    with pytest.raises(ValueError, match="num_prompts"):
        random_dataset(n, (1, 1), (1, 1), seed=0)
