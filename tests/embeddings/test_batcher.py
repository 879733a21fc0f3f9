"""The embedding batcher's window and token budget (no torch, no model)."""

from __future__ import annotations

import pytest

from edgeinfer.engine.scheduler.embed_batcher import EmbedBatcher, EmbedItem


def _items(request_id: str, lengths: list[int], at: float = 0.0) -> list[EmbedItem]:
    return [EmbedItem(request_id, i, n, at) for i, n in enumerate(lengths)]


def test_window_holds_small_batches_until_it_closes() -> None:
    batcher = EmbedBatcher(max_batch_tokens=100, max_batch_size=8, window_s=0.005)
    assert batcher.ready_at() is None
    batcher.add(_items("a", [10], at=1.0))
    batcher.add(_items("b", [10, 10], at=1.002))
    assert batcher.ready_at() == pytest.approx(1.005)  # the oldest item's window
    assert [(it.request_id, it.index) for it in batcher.take()] == [("a", 0), ("b", 0), ("b", 1)]
    assert len(batcher) == 0


def test_full_batch_goes_at_once_and_the_budget_splits_requests() -> None:
    batcher = EmbedBatcher(max_batch_tokens=50, max_batch_size=8, window_s=10.0)
    batcher.add(_items("a", [20, 20, 20]))
    assert batcher.ready_at() == float("-inf")
    assert [it.index for it in batcher.take()] == [0, 1]  # a third would exceed 50 tokens
    assert [it.index for it in batcher.take()] == [2]


def test_size_limit_and_an_oversized_item_still_goes_alone() -> None:
    batcher = EmbedBatcher(max_batch_tokens=16, max_batch_size=2, window_s=0.0)
    batcher.add(_items("a", [1, 1, 1]))
    assert len(batcher.take()) == 2
    batcher.add(_items("b", [40]))
    assert [it.request_id for it in batcher.take()] == ["a"]
    assert [it.num_tokens for it in batcher.take()] == [40]


def test_drop_forgets_a_request() -> None:
    batcher = EmbedBatcher(max_batch_tokens=100, max_batch_size=8, window_s=0.0)
    batcher.add(_items("a", [5, 5]) + _items("b", [5]))
    batcher.drop("a")
    assert [it.request_id for it in batcher.take()] == ["b"]
    assert batcher.ready_at() is None
