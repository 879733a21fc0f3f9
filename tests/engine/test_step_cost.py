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


def test_the_mixed_model_tells_decode_rows_from_prefill_tokens() -> None:
    """t = a + b·rows + c·tokens, from noisy steps of a busy node's mixes; no fit from one mix alone."""
    from edgeinfer.engine.scheduler.mixed_cost import MixedStepCost

    one_mix = MixedStepCost()
    for _ in range(10):
        one_mix.observe(8, 16, 0.03)
    assert one_mix.fit is None and one_mix.plan(0.03, 8, 1, 256) is None
    rng = random.Random(1)
    cost = MixedStepCost()
    for _ in range(300):
        rows, tokens = rng.choice([(1, 0), (40, 0), (10, 200), (0, 500), (30, 16), (5, 1000)])
        cost.observe(rows, tokens, (0.020 + 0.0005 * rows + 0.0012 * tokens) * rng.uniform(0.97, 1.03))
    fixed, per_row, per_token = cost.fit
    assert fixed == pytest.approx(0.020, abs=0.004)
    assert per_row == pytest.approx(0.0005, rel=0.2)
    assert per_token == pytest.approx(0.0012, rel=0.1)
    rows, decodes_only = cost.plan(0.030, 60, 2, 1024)  # 60 decodes owed: about 20 fit
    assert decodes_only and rows == pytest.approx(20, abs=4)
    tokens, decodes_only = cost.plan(0.030, 6, 2, 1024)  # 6 fit in 23 ms: ~6 prefill tokens in the rest
    assert not decodes_only and tokens == pytest.approx(6 + 5, abs=3)
