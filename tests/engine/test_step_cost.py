"""The step-time line the scheduler budgets with: fitted from observed steps, clamped, None until it fits."""

from __future__ import annotations

import random

import pytest

from edgeinfer.engine.scheduler.step_cost import StepCost


def test_recovers_a_line_from_noisy_steps() -> None:
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(200):
        tokens = rng.choice([1, 6, 64, 200, 512])
        cost.observe(tokens, (0.040 + 0.0013 * tokens) * rng.uniform(0.95, 1.05))
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.040, abs=0.01)
    assert per_token == pytest.approx(0.0013, rel=0.1)
    assert cost.tokens_within(0.250, 32, 1024) == pytest.approx(160, abs=25)


def test_no_line_from_steps_of_one_size() -> None:
    cost = StepCost()
    for _ in range(10):
        cost.observe(8, 0.02)
    assert cost.line() is None
    assert cost.tokens_within(0.250, 32, 1024) == 1024


def test_a_line_holds_through_steps_of_one_size() -> None:
    """Budgeted steps are all of about one size: the line they came from must not be forgotten, or the next
    budget would be the maximum (one long step) again."""
    cost = StepCost()
    for tokens in [1, 256] * 20:
        cost.observe(tokens, 0.02 + 0.001 * tokens)
    budget = cost.tokens_within(0.050, 1, 1024)
    assert budget == pytest.approx(30, abs=3)
    for _ in range(300):
        cost.observe(budget, 0.02 + 0.001 * budget)
    assert cost.tokens_within(0.050, 1, 1024) == pytest.approx(30, abs=3)


def test_budget_is_clamped() -> None:
    slow, fast = StepCost(), StepCost()
    for tokens in (1, 100, 1, 100):
        slow.observe(tokens, 0.3 + 0.01 * tokens)  # the fixed part alone is over the target
        fast.observe(tokens, 1e-5 * tokens)
    assert slow.tokens_within(0.250, 32, 1024) == 32
    assert fast.tokens_within(0.250, 32, 1024) == 1024


def test_follows_a_machine_that_slows_down() -> None:
    cost = StepCost()
    for tokens in [1, 256] * 20:
        cost.observe(tokens, 0.001 * tokens)
    before = cost.tokens_within(0.250, 32, 1024)
    for tokens in [1, 256] * 30:
        cost.observe(tokens, 0.003 * tokens)
    assert before == pytest.approx(250, abs=5)
    assert cost.tokens_within(0.250, 32, 1024) == pytest.approx(83, abs=10)
